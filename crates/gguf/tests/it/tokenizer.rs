use std::time::{Duration, Instant};

use serde::Deserialize;

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

/// The committed cases, or the file named by `AIRLOCK_TOKENIZER_CASES` (same
/// format) to compare against a larger corpus.
fn cases() -> Cases {
    let default = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/tokenizer_cases.json"
    );
    let path = std::env::var("AIRLOCK_TOKENIZER_CASES").unwrap_or_else(|_| default.to_string());
    let path = path.as_str();
    let json = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{path} is committed with the tests: {e}"));
    serde_json::from_str(&json).unwrap_or_else(|e| panic!("{path} is valid JSON: {e}"))
}

#[test]
fn matches_llama_cpp() {
    let t = &model().tokenizer;
    let cases = cases();
    assert!(cases.cases.len() >= 24, "only {} cases", cases.cases.len());
    let mut failures = Vec::new();
    for case in &cases.cases {
        let ids = t.encode(&case.text, case.parse_special);
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
