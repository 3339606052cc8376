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
const WHOLE_WORD: &str = "xyz";

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
    // A whole word no merge reaches: Llama 3's vocabularies take it as one token anyway.
    tokens.push(WHOLE_WORD.to_string());
    types.push(Value::I32(1));
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
    assert_eq!(t.vocab_size(), 4 + 256 + MERGES.len() + 1);
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
        tokenizer_from(file("bert", "smollm")).map(|_| ()),
        Err(Error::UnsupportedTokenizer {
            model: "bert".into()
        })
    );
    let err = tokenizer_from(file("gpt2", "falcon")).expect_err("falcon pre-tokenizer is refused");
    for named in ["\"falcon\"", "\"smollm\"", "\"llama-bpe\"", "\"qwen2\""] {
        assert!(err.to_string().contains(named), "{err}");
    }
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

/// Llama 3's vocabularies take a word that is a token whole, though no merge reaches it, as
/// llama.cpp does (`ignore_merges`); others merge it from bytes. And without an
/// `add_bos_token` key, Llama 3's add BOS and the others do not (llama.cpp's defaults).
#[test]
fn llama3_vocabularies_take_whole_words_and_default_to_bos() {
    let whole_word = tokenizer().token_id(WHOLE_WORD).expect("in the vocabulary");
    let pre = |name: &str| with("tokenizer.ggml.pre", Value::String(name.into())).unwrap();
    let llama3 = pre("llama-bpe");
    assert_eq!(llama3.encode("xyz", false), [whole_word]);
    let twice = llama3.encode("xyz xyz", false);
    assert_eq!(
        (twice[0], twice.len()),
        (whole_word, 1 + 4),
        "' xyz' is no token: 4 bytes"
    );
    for other in ["smollm", "qwen2", "gpt-2"] {
        assert_eq!(pre(other).encode("xyz", false).len(), 3, "{other}");
        assert!(!pre(other).add_bos(), "{other}");
    }
    assert!(llama3.add_bos());
    // A prompt gets BOS first, once, even when the text writes it (as chat templates do).
    let bos = llama3.bos_id().expect("the test vocabulary names BOS");
    assert_eq!(llama3.encode_prompt("xyz", false), [bos, whole_word]);
    let written = llama3.token_text(bos).unwrap().to_string() + "xyz";
    assert_eq!(llama3.encode_prompt(&written, true), [bos, whole_word]);
    assert_eq!(
        pre("smollm").encode_prompt("xyz", false).len(),
        3,
        "no BOS asked for"
    );
    let mut file = GgufFile::parse(&builder().build()).unwrap();
    let pre = Value::String("llama-bpe".into());
    file.metadata.insert("tokenizer.ggml.pre".into(), pre);
    let no = Value::Bool(false);
    file.metadata
        .insert("tokenizer.ggml.add_bos_token".into(), no);
    assert!(
        !Tokenizer::from_gguf(&file).unwrap().add_bos(),
        "the file's key wins"
    );
}

/// A SentencePiece vocabulary (`llama`) is refused, not run, when its scores do not match its
/// tokens or a byte has no `<0xXX>` token for byte fallback; a whole one loads, and any text
/// encodes to ids of the vocabulary, bytes falling back where no piece covers them.
#[test]
fn sentencepiece_vocabularies_are_checked_at_load() {
    let bytes: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
    let spm = |tokens: &[String], scores: Vec<Value>| {
        let types = vec![Value::I32(6); 256]
            .into_iter()
            .chain(std::iter::repeat_n(Value::I32(1), tokens.len() - 256))
            .collect();
        tokenizer_from(
            Builder::new()
                .kv("tokenizer.ggml.model", Value::String("llama".into()))
                .kv("tokenizer.ggml.tokens", strings(tokens))
                .kv("tokenizer.ggml.token_type", Value::Array(types))
                .kv("tokenizer.ggml.scores", Value::Array(scores))
                .kv("tokenizer.ggml.add_space_prefix", Value::Bool(false))
                .kv("tokenizer.ggml.eos_token_id", Value::U32(0)),
        )
    };
    let tokens: Vec<String> = bytes
        .iter()
        .cloned()
        .chain(["▁hi".into(), "hi".into(), "▁".into()])
        .collect();
    let scores = |n| vec![Value::F32(-1.0); n];
    let t = spm(&tokens, scores(tokens.len())).expect("a whole vocabulary loads");
    let ids = t.encode(" hi é", false);
    assert_eq!(ids.len(), 4, "▁hi, then ▁ and é as bytes: {ids:?}");
    assert_eq!(t.decode(&ids), " hi é");
    let short = spm(&tokens, scores(tokens.len() - 1)).expect_err("a score short");
    assert!(short.to_string().contains("scores"), "{short}");
    let mut no_byte = tokens.clone();
    no_byte[0x41] = "A".into();
    let missing = spm(&no_byte, scores(no_byte.len())).expect_err("no <0x41>");
    assert!(missing.to_string().contains("<0x41>"), "{missing}");
}
