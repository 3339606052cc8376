use std::time::{Duration, Instant};

use serde::Deserialize;

use std::path::PathBuf;

use gguf::{GgufFile, Tokenizer};

use crate::common::model;

#[derive(Deserialize)]
struct Cases {
    generator: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    parse_special: bool,
    ids: Vec<u32>,
}

/// The committed cases of `name`, or for SmolLM2's the file named by
/// `AIRLOCK_TOKENIZER_CASES` (same format) to compare against a larger corpus.
fn cases(name: &str) -> Cases {
    let default = format!("{}/tests/data/{name}", env!("CARGO_MANIFEST_DIR"));
    let path = match std::env::var("AIRLOCK_TOKENIZER_CASES") {
        Ok(path) if name == "tokenizer_cases.json" => path,
        _ => default,
    };
    let json = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path} is committed with the tests: {e}"));
    serde_json::from_str(&json).unwrap_or_else(|e| panic!("{path} is valid JSON: {e}"))
}

/// `tokenizer` encodes every case of `cases_file` as llama.cpp did.
fn check_against_llama_cpp(tokenizer: &Tokenizer, cases_file: &str) {
    let cases = cases(cases_file);
    assert!(cases.cases.len() >= 24, "only {} cases", cases.cases.len());
    let mut failures = Vec::new();
    for case in &cases.cases {
        let ids = tokenizer.encode(&case.text, case.parse_special);
        if ids != case.ids {
            failures.push(format!(
                "text {:?} (parse_special {}):\n  ours:      {ids:?}\n  llama.cpp: {:?}",
                case.text, case.parse_special, case.ids
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from {}:\n{}",
        failures.len(),
        cases.cases.len(),
        cases.generator,
        failures.join("\n")
    );
}

#[test]
fn matches_llama_cpp() {
    check_against_llama_cpp(&model().tokenizer, "tokenizer_cases.json");
}

/// The tokenizer of scripts/fetch-test-models.sh's model `name`: a random model's (SmolLM2's
/// vocabulary with the pre-tokenizer of that family's real files) or Gemma's.
fn test_model_tokenizer(name: &str) -> Tokenizer {
    let dir = std::env::var_os("AIRLOCK_TEST_MODELS").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/requant"),
        PathBuf::from,
    );
    let path = dir.join(format!("{name}.gguf"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{} ({e}): run scripts/fetch-test-models.sh from the workspace root",
            path.display()
        )
    });
    let file = GgufFile::parse(&bytes).expect("the test model parses");
    assert_ne!(file.get_str("tokenizer.ggml.pre"), Ok("smollm"));
    Tokenizer::from_gguf(&file).expect("its tokenizer loads")
}

/// Llama 3's pre-tokenizer (`llama-bpe`). SmolLM2's vocabulary has no multi-digit tokens, so
/// its digit runs of three and whole-word lookups give the ids `qwen2`'s do here; the
/// splitting itself is checked against the regex (`pretokenize` tests).
#[test]
fn the_llama3_pre_tokenizer_matches_llama_cpp() {
    let tokenizer = test_model_tokenizer("random-llama");
    check_against_llama_cpp(&tokenizer, "tokenizer_cases.llama-bpe.json");
}

/// Gemma 3's SentencePiece vocabulary (262,144 pieces, byte fallback), from Gemma 3 270M.
#[test]
fn the_gemma3_sentencepiece_tokenizer_matches_llama_cpp() {
    let tokenizer = test_model_tokenizer("gemma-3-270m-q4_k_m");
    assert_eq!(
        tokenizer.merge_count(),
        0,
        "SentencePiece merges by score, not rules"
    );
    check_against_llama_cpp(&tokenizer, "tokenizer_cases.gemma3.json");
}

/// Qwen 2's pre-tokenizer (`qwen2`, which Qwen 2.5 and Qwen 3 files name too).
#[test]
fn the_qwen2_pre_tokenizer_matches_llama_cpp() {
    let tokenizer = test_model_tokenizer("random-qwen2");
    check_against_llama_cpp(&tokenizer, "tokenizer_cases.qwen2.json");
}

#[test]
fn vocabulary_facts() {
    let t = &model().tokenizer;
    assert_eq!(t.vocab_size(), 49152);
    assert_eq!(t.bos_id(), Some(1));
    assert_eq!(t.eos_id(), 2);
    assert!(!t.add_bos());
    assert_eq!(t.token_id("<|im_start|>"), Some(1));
    assert_eq!(t.token_id("<|im_end|>"), Some(2));
    assert_eq!(t.token_id("<|endoftext|>"), Some(0));
    assert_eq!(t.token_bytes(2), b"<|im_end|>");
    assert_eq!(
        t.token_id("Ġthe").map(|id| t.token_bytes(id)),
        Some(&b" the"[..])
    );
    assert_eq!(t.token_bytes(198), b"\n");
    assert_eq!(t.encode("", true), Vec::<u32>::new());
}

#[test]
fn decode_inverts_encode() {
    let t = &model().tokenizer;
    let texts = [
        "Hello, world!",
        "  \n\n  x",
        "héllo wörld 日本語 🙂",
        "\t\tindented\r\n\tcode();\n",
        "<|im_start|>user\nHi<|im_end|>\n",
        "1234567890 3.14159 -42",
        "👨‍👩‍👧‍👦🇫🇷 e\u{301} \u{0}\u{1f}\u{7f}",
        "Ωμέγα Привет مرحبا שלום नमस्ते",
        "   trailing   ",
        "'s 't 're 've 'm 'll 'd 'S",
    ];
    for text in texts {
        for special in [false, true] {
            let ids = t.encode(text, special);
            assert_eq!(t.decode(&ids), text, "parse_special {special}");
            let bytes: Vec<u8> = ids
                .iter()
                .flat_map(|&id| t.token_bytes(id).to_vec())
                .collect();
            assert_eq!(bytes, text.as_bytes());
        }
    }
}

/// A prompt of about 5,000 tokens mixing prose, code, numbers and unicode.
fn long_prompt() -> String {
    let chunk = "The quick brown fox jumps over the lazy dog; it's 2024 and \
                 temperatures reached 38.5°C. fn main() {\n    let x = vec![1, 2, 3];\n    \
                 println!(\"{:?}\", x);\n}\nCafé, naïve, 日本語のテキスト, emoji 🙂🚀.\n\n";
    chunk.repeat(55)
}

#[test]
fn encodes_five_thousand_tokens_fast() {
    let t = &model().tokenizer;
    let prompt = long_prompt();
    let ids = t.encode(&prompt, true);
    assert!((4500..5500).contains(&ids.len()), "{} tokens", ids.len());
    assert_eq!(t.decode(&ids), prompt);
    let best = (0..5)
        .map(|_| {
            let start = Instant::now();
            let n = t.encode(&prompt, true).len();
            assert_eq!(n, ids.len());
            start.elapsed()
        })
        .min()
        .unwrap_or(Duration::MAX);
    eprintln!("encoding {} tokens took {best:?} (best of 5)", ids.len());
    assert!(
        best < Duration::from_millis(100),
        "encoding {} tokens took {best:?}",
        ids.len()
    );
}
