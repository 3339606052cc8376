use proptest::prelude::*;

use super::byte_level::byte_to_char_table;
use super::*;
use crate::testutil::Builder;

const SPECIALS: [(&str, i32); 4] = [
    ("<|endoftext|>", 3),
    ("<|im_start|>", 3),
    ("<|im_end|>", 3),
    ("<user>", 4),
];
const MERGES: [&str; 7] = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"];

fn strings(items: &[String]) -> Value {
    Value::Array(items.iter().map(|s| Value::String(s.clone())).collect())
}

/// A vocabulary of four specials, the 256 byte characters and a few merges.
fn builder() -> Builder {
    let mut tokens: Vec<String> = SPECIALS.iter().map(|(t, _)| t.to_string()).collect();
    let mut types: Vec<Value> = SPECIALS.iter().map(|&(_, ty)| Value::I32(ty)).collect();
    for c in byte_to_char_table() {
        tokens.push(c.to_string());
        types.push(Value::I32(1));
    }
    for m in MERGES {
        tokens.push(m.replace(' ', ""));
        types.push(Value::I32(1));
    }
    let merges: Vec<String> = MERGES.iter().map(|m| m.to_string()).collect();
    Builder::new()
        .kv("tokenizer.ggml.model", Value::String("gpt2".into()))
        .kv("tokenizer.ggml.pre", Value::String("smollm".into()))
        .kv("tokenizer.ggml.tokens", strings(&tokens))
        .kv("tokenizer.ggml.token_type", Value::Array(types))
        .kv("tokenizer.ggml.merges", strings(&merges))
        .kv("tokenizer.ggml.bos_token_id", Value::U32(1))
        .kv("tokenizer.ggml.eos_token_id", Value::U32(2))
}

fn tokenizer_from(b: Builder) -> Result<Tokenizer> {
    Tokenizer::from_gguf(&GgufFile::parse(&b.build())?)
}

fn tokenizer() -> Tokenizer {
    tokenizer_from(builder()).expect("test vocabulary is valid")
}

fn pieces(t: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter()
        .map(|&id| t.token_text(id).unwrap_or("?").to_string())
        .collect()
}

#[test]
fn merges_apply_by_rank() {
    let t = tokenizer();
    assert_eq!(t.vocab_size(), 4 + 256 + MERGES.len());
    assert_eq!(t.merge_count(), MERGES.len());
    let ids = t.encode("hello world", false);
    assert_eq!(pieces(&t, &ids), ["hello", "Ġwor", "l", "d"]);
    assert_eq!(t.decode(&ids), "hello world");
    // Digits are split one by one; "hel" has no full merge path.
    let ids = t.encode("hel 42", false);
    assert_eq!(pieces(&t, &ids), ["he", "l", "Ġ", "4", "2"]);
}

#[test]
fn special_tokens() {
    let t = tokenizer();
    let ids = t.encode("<|im_start|>hello<|im_end|>", true);
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.last(), Some(&2));
    assert_eq!(pieces(&t, &ids[1..ids.len() - 1]), ["hello"]);
    // Without parse_special the markers are plain text.
    let ids = t.encode("<|im_start|>", false);
    assert!(!ids.contains(&1));
    assert_eq!(t.decode(&ids), "<|im_start|>");
    // User-defined tokens always match.
    assert_eq!(t.encode("<user>", false), [3]);
    assert_eq!(t.token_bytes(1), b"<|im_start|>");
    assert_eq!(t.token_type(1), Some(TokenType::Control));
    assert_eq!(t.token_type(3), Some(TokenType::UserDefined));
    assert_eq!(t.bos_id(), Some(1));
    assert_eq!(t.eos_id(), 2);
    assert!(!t.add_bos());
    assert_eq!(t.token_id("<|im_end|>"), Some(2));
    assert_eq!(t.token_id("Ġwor"), t.encode(" wor", false).first().copied());
}

#[test]
fn token_bytes_are_byte_level_decoded() {
    let t = tokenizer();
    let id = t.token_id("Ġw").expect("Ġw is in the test vocabulary");
    assert_eq!(t.token_bytes(id), b" w");
    let newline = t
        .token_id("Ċ")
        .expect("every byte character is in the vocabulary");
    assert_eq!(t.token_bytes(newline), b"\n");
    assert_eq!(t.token_bytes(u32::MAX), b"");
    assert_eq!(t.token_bytes(t.vocab_size() as u32), b"");
    assert_eq!(t.decode(&[u32::MAX, id]), " w");
    // A lone continuation byte decodes lossily.
    let cont = t.encode("é", false);
    assert_eq!(cont.len(), 2);
    assert_eq!(t.decode(&cont[..1]), "\u{fffd}");
}

#[test]
fn refuses_unsupported_vocabularies() {
    let file = |model: &str, pre: &str| {
        Builder::new()
            .kv("tokenizer.ggml.model", Value::String(model.into()))
            .kv("tokenizer.ggml.pre", Value::String(pre.into()))
    };
    assert_eq!(
        tokenizer_from(file("llama", "smollm")).map(|_| ()),
        Err(Error::UnsupportedTokenizer {
            model: "llama".into()
        })
    );
    let err = tokenizer_from(file("gpt2", "qwen2")).expect_err("qwen2 pre-tokenizer is refused");
    assert!(err.to_string().contains("qwen2"), "{err}");
    assert!(matches!(
        tokenizer_from(file("gpt2", "smollm")),
        Err(Error::MissingKey { .. })
    ));
}

/// The test vocabulary with one key replaced.
fn with(key: &str, value: Value) -> Result<Tokenizer> {
    let file = GgufFile::parse(&builder().build())?;
    let mut file = file;
    file.metadata.insert(key.to_string(), value);
    Tokenizer::from_gguf(&file)
}

#[test]
fn refuses_inconsistent_metadata() {
    assert!(matches!(
        with("tokenizer.ggml.eos_token_id", Value::U32(100_000)),
        Err(Error::BadTokenizer { .. })
    ));
    assert!(matches!(
        with(
            "tokenizer.ggml.token_type",
            Value::Array(vec![Value::I32(1)])
        ),
        Err(Error::BadTokenizer { .. })
    ));
    assert!(matches!(
        with("tokenizer.ggml.merges", strings(&["nospace".to_string()])),
        Err(Error::BadTokenizer { .. })
    ));
    assert!(matches!(
        with("tokenizer.ggml.tokens", Value::Array(vec![Value::U8(1)])),
        Err(Error::WrongType { .. })
    ));
    assert!(matches!(
        with("tokenizer.ggml.tokens", Value::Array(vec![])),
        Err(Error::BadTokenizer { .. })
    ));
    let mut file = GgufFile::parse(&builder().build()).expect("test vocabulary parses");
    file.metadata.remove("tokenizer.ggml.eos_token_id");
    assert_eq!(
        Tokenizer::from_gguf(&file).map(|_| ()),
        Err(Error::MissingKey {
            key: "tokenizer.ggml.eos_token_id".into()
        })
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn decode_inverts_encode(text in any::<String>(), parse_special in any::<bool>()) {
        let t = tokenizer();
        prop_assert_eq!(t.decode(&t.encode(&text, parse_special)), text);
    }
}
