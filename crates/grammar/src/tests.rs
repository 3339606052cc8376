use super::*;
use std::path::PathBuf;
use std::sync::OnceLock;

/// The served model's tokenizer (`scripts/fetch-model.sh` fetches the file).
fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let path = std::env::var_os("AIRLOCK_MODEL").map_or_else(
            || {
                PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                    .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf")
            },
            PathBuf::from,
        );
        let bytes = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e}; run scripts/fetch-model.sh", path.display()));
        let file = gguf::GgufFile::parse(&bytes).expect("the model parses");
        Tokenizer::from_gguf(&file).expect("the model's tokenizer")
    })
}

fn vocabulary() -> &'static Vocabulary {
    static VOCABULARY: OnceLock<Vocabulary> = OnceLock::new();
    VOCABULARY.get_or_init(|| Vocabulary::new(tokenizer()).expect("vocabulary"))
}

/// Which tokens the constraint allows now.
fn allowed(constraint: &mut Constraint) -> Vec<u32> {
    let mut logits = vec![0.0; tokenizer().vocab_size()];
    constraint.next_mask().expect("a mask").apply(&mut logits);
    (0..logits.len() as u32)
        .filter(|&id| logits[id as usize] == 0.0)
        .collect()
}

#[test]
fn an_object_must_open_with_a_brace_and_may_end_only_once_closed() {
    let mut constraint = vocabulary()
        .constraint(&Shape::JsonObject)
        .expect("compiles");
    let eos = tokenizer().eos_id();
    let first = allowed(&mut constraint);
    assert!(!first.contains(&eos), "nothing is no object");
    for id in &first {
        let text = String::from_utf8_lossy(tokenizer().token_bytes(*id)).into_owned();
        assert!(
            text.trim_start().starts_with('{') || text.trim().is_empty(),
            "token {id} {text:?} cannot open an object"
        );
    }
    for token in tokenizer().encode("{\"a\": 1, \"b\": [2, 3]}", false) {
        assert!(allowed(&mut constraint).contains(&token), "token {token}");
        constraint.accept(token).expect("valid");
    }
    assert!(
        allowed(&mut constraint).contains(&eos),
        "a whole object may end"
    );
}

#[test]
fn the_json_is_written_on_one_line_unless_the_schema_says_otherwise() {
    let newline = tokenizer().encode("\n", false)[0];
    let open = tokenizer().encode("{", false)[0];
    let mut compact = vocabulary()
        .constraint(&Shape::JsonObject)
        .expect("compiles");
    compact.accept(open).expect("valid");
    assert!(!allowed(&mut compact).contains(&newline));
    let flexible =
        serde_json::json!({"type": "object", "x-guidance": {"whitespace_flexible": true}});
    let mut loose = vocabulary()
        .constraint(&Shape::JsonSchema(flexible))
        .expect("compiles");
    loose.accept(open).expect("valid");
    assert!(allowed(&mut loose).contains(&newline));
}

#[test]
fn a_schema_is_followed_and_a_bad_one_is_refused() {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": false,
    });
    let mut constraint = vocabulary()
        .constraint(&Shape::JsonSchema(schema.clone()))
        .expect("compiles");
    let prefix = tokenizer().encode("{\"answer\": ", false);
    for &token in &prefix {
        constraint.accept(token).expect("valid prefix");
    }
    // A string is not an integer: no token starting with a quote is allowed here.
    let quote = tokenizer().encode("\"", false)[0];
    assert!(!allowed(&mut constraint).contains(&quote));
    assert!(vocabulary()
        .constraint(&Shape::JsonSchema(
            serde_json::json!({"type": "no-such-type"})
        ))
        .is_err());
    assert_eq!(
        Shape::from_wire(&Shape::JsonSchema(schema.clone()).to_wire()),
        Ok(Shape::JsonSchema(schema))
    );
    assert_eq!(Shape::from_wire(""), Ok(Shape::JsonObject));
}
