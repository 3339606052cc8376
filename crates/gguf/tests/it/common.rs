use std::path::PathBuf;
use std::sync::OnceLock;

use gguf::{GgufFile, Tokenizer};

const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

pub fn model_path() -> PathBuf {
    if let Some(path) = std::env::var_os("AIRLOCK_MODEL") {
        return PathBuf::from(path);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(MODEL_FILE)
}

/// The model file, its parsed header and its tokenizer, loaded once.
pub struct Model {
    pub bytes: Vec<u8>,
    pub file: GgufFile,
    pub tokenizer: Tokenizer,
}

pub fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = model_path();
        let bytes = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "cannot read the model file {} ({e}); run scripts/fetch-model.sh \
                 from the workspace root, or point AIRLOCK_MODEL at the file",
                path.display()
            )
        });
        let file = GgufFile::parse(&bytes)
            .unwrap_or_else(|e| panic!("the real model {} must parse: {e}", path.display()));
        let tokenizer = Tokenizer::from_gguf(&file)
            .unwrap_or_else(|e| panic!("the real model's tokenizer must load: {e}"));
        Model {
            bytes,
            file,
            tokenizer,
        }
    })
}
