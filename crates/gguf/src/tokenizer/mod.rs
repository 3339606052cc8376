//! The tokenizer stored in a GGUF file, matching llama.cpp's tokenization: byte-level BPE
//! (`tokenizer.ggml.model = "gpt2"`) or SentencePiece-style (`"llama"`, as Gemma's files).
//!
//! Encoding: split the text on special-token strings (`special`); then, for BPE, split each
//! raw piece into words (`pretokenize`) and merge each word's bytes by rank (`bpe`); for
//! SentencePiece, merge each raw piece's characters by score with byte fallback (`spm`).
//! Decoding maps each token back to the bytes it stands for.

mod bpe;
mod byte_level;
mod pretokenize;
mod special;
mod spm;
mod unicode;

use std::collections::HashMap;

use crate::{Error, GgufFile, Result, Value};
use bpe::{Merges, Session, NO_TOKEN};
use pretokenize::PreTokenizer;
use special::{Fragment, SpecialToken};

/// The kind of a vocabulary entry (`tokenizer.ggml.token_type`, llama.cpp's
/// `llama_token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    Undefined,
    Normal,
    Unknown,
    /// Special tokens such as `<|im_start|>`; matched in text only when
    /// encoding with `parse_special`.
    Control,
    /// Added tokens that are always matched in text as a whole.
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    fn from_raw(raw: i128) -> Option<TokenType> {
        Some(match raw {
            0 => TokenType::Undefined,
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => return None,
        })
    }

    /// Whether the token's vocabulary text is its literal text (rather than
    /// GPT-2 byte-level characters).
    fn is_literal(self) -> bool {
        matches!(
            self,
            TokenType::Control | TokenType::UserDefined | TokenType::Unknown
        )
    }
}

/// How the text between special tokens becomes ids.
#[derive(Debug, Clone)]
enum Encoding {
    /// Byte-level BPE (`gpt2`).
    Bpe {
        merges: Merges,
        pre: PreTokenizer,
        /// Token for each single byte's byte-level character, or `NO_TOKEN`.
        byte_tokens: Box<[u32; 256]>,
        /// Each byte's byte-level character.
        byte_chars: Box<[char; 256]>,
    },
    /// SentencePiece-style (`llama`).
    Spm {
        /// `tokenizer.ggml.scores`: which merge wins.
        scores: Vec<f32>,
        /// The `<0xXX>` token of each byte.
        byte_tokens: Box<[u32; 256]>,
        /// Whether text after a special token (or at the start) gets a leading space.
        add_space_prefix: bool,
    },
}

/// A tokenizer built from a GGUF file's metadata.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    /// Vocabulary strings as stored in the file.
    tokens: Vec<String>,
    types: Vec<TokenType>,
    /// Decoded bytes of token `i`: `bytes[offsets[i]..offsets[i + 1]]`.
    bytes: Vec<u8>,
    offsets: Vec<usize>,
    token_to_id: HashMap<String, u32>,
    encoding: Encoding,
    specials: Vec<SpecialToken>,
    bos: Option<u32>,
    eos: u32,
    add_bos: bool,
}

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TYPES: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";

fn bad(reason: impl Into<String>) -> Error {
    Error::BadTokenizer {
        reason: reason.into(),
    }
}

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata.
    ///
    /// Refuses tokenizer models other than `gpt2` and `llama`, and BPE pre-tokenizers whose
    /// splitting rules this crate does not implement.
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
        let model = file.get_str(KEY_MODEL)?;
        if model != "gpt2" && model != "llama" {
            return Err(Error::UnsupportedTokenizer {
                model: model.to_string(),
            });
        }
        let spm = model == "llama";
        let pre = if spm {
            None
        } else {
            Some(bpe_pre_tokenizer(file)?)
        };
        let tokens = string_array(file, KEY_TOKENS)?;
        let n = tokens.len();
        if n == 0 || n >= NO_TOKEN as usize {
            return Err(bad(format!("{KEY_TOKENS} has {n} entries")));
        }
        let types = token_types(file, n)?;
        let check_id = |key: &str, id: u32| {
            if (id as usize) < n {
                Ok(id)
            } else {
                Err(bad(format!("{key} is {id}, outside the vocabulary of {n}")))
            }
        };
        let bos = match file.get(KEY_BOS) {
            None => None,
            Some(_) => Some(check_id(KEY_BOS, file.get_u32(KEY_BOS)?)?),
        };
        let eos = check_id(KEY_EOS, file.get_u32(KEY_EOS)?)?;

        // Later duplicates win, as in llama.cpp.
        let token_to_id: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();

        let (encoding, add_bos_default) = if let Some(pre) = pre {
            let byte_chars = Box::new(byte_level::byte_to_char_table());
            let byte_tokens = Box::new(byte_chars.map(|c| {
                token_to_id
                    .get(c.encode_utf8(&mut [0u8; 4]) as &str)
                    .copied()
                    .unwrap_or(NO_TOKEN)
            }));
            let encoding = Encoding::Bpe {
                merges: merges(file, &token_to_id)?,
                pre,
                byte_tokens,
                byte_chars,
            };
            // llama.cpp's default where the file is silent: Llama 3 vocabularies start with
            // BOS, other BPE ones do not.
            (encoding, pre == PreTokenizer::Llama3)
        } else {
            (spm_encoding(file, &tokens, &token_to_id)?, true)
        };
        let add_bos = file.get_bool_or(KEY_ADD_BOS, add_bos_default)?;
        let (bytes, offsets) = decoded_bytes(&tokens, &types, spm);

        let mut specials: Vec<SpecialToken> = types
            .iter()
            .enumerate()
            .filter(|(_, t)| t.is_literal())
            .map(|(id, &t)| SpecialToken {
                text: tokens[id].clone(),
                id: id as u32,
                only_when_parsing_special: t != TokenType::UserDefined,
            })
            .collect();
        special::sort_specials(&mut specials);

        Ok(Tokenizer {
            tokens,
            types,
            bytes,
            offsets,
            token_to_id,
            encoding,
            specials,
            bos,
            eos,
            add_bos,
        })
    }

    /// Tokenizes `text`. No BOS is added (see [`Tokenizer::add_bos`]).
    ///
    /// With `parse_special`, control tokens written in the text (such as
    /// `<|im_start|>`) become their ids; without it they are tokenized as
    /// ordinary text. User-defined tokens are always matched.
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut session = Session::default();
        let (mut words, mut symbols, mut escaped) = (Vec::new(), Vec::new(), String::new());
        // SentencePiece's space prefix goes before text at the start or after a special token.
        let mut after_special = true;
        for fragment in special::partition(text, &self.specials, parse_special) {
            let t = match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                    continue;
                }
                Fragment::Text(t) => t,
            };
            match &self.encoding {
                Encoding::Bpe {
                    merges,
                    pre,
                    byte_tokens,
                    ..
                } => {
                    words.clear();
                    pretokenize::split(t, *pre, &mut words);
                    for word in &words {
                        let word = &t.as_bytes()[word.clone()];
                        // Llama 3's vocabularies take a word that is a token whole, as
                        // llama.cpp does (`ignore_merges`), even where merges would not
                        // reach it.
                        if *pre == PreTokenizer::Llama3 {
                            if let Some(id) = self.whole_word(word) {
                                out.push(id);
                                continue;
                            }
                        }
                        symbols.clear();
                        symbols.extend(word.iter().map(|&b| byte_tokens[usize::from(b)]));
                        session.merge(&symbols, merges, &mut out);
                    }
                }
                Encoding::Spm {
                    scores,
                    byte_tokens,
                    add_space_prefix,
                } => {
                    escaped.clear();
                    if *add_space_prefix && after_special {
                        escaped.push(spm::SPACE);
                    }
                    escaped.extend(t.chars().map(|c| if c == ' ' { spm::SPACE } else { c }));
                    let vocab = spm::Vocab {
                        token_to_id: &self.token_to_id,
                        scores,
                        byte_tokens,
                    };
                    spm::encode(&escaped, &vocab, &mut out);
                }
            }
            after_special = false;
        }
        out
    }

    /// A prompt as the model expects it: [`Tokenizer::encode`], with BOS first where the file
    /// asks for it ([`Tokenizer::add_bos`]) and the text did not already start with it (a
    /// chat template may write it).
    pub fn encode_prompt(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut ids = self.encode(text, parse_special);
        if let Some(bos) = self.bos.filter(|_| self.add_bos) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        ids
    }

    /// The token spelled exactly as `word`'s byte-level text, if there is one.
    fn whole_word(&self, word: &[u8]) -> Option<u32> {
        let Encoding::Bpe { byte_chars, .. } = &self.encoding else {
            return None;
        };
        let text: String = word.iter().map(|&b| byte_chars[usize::from(b)]).collect();
        self.token_to_id.get(&text).copied()
    }

    /// The raw bytes token `id` stands for: byte-level decoded for ordinary
    /// tokens, the literal text for control, user-defined and unknown
    /// tokens. Empty for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let i = id as usize;
        match (self.offsets.get(i), self.offsets.get(i + 1)) {
            (Some(&start), Some(&end)) => &self.bytes[start..end],
            _ => &[],
        }
    }

    /// Concatenates the tokens' bytes as UTF-8, replacing invalid sequences
    /// with U+FFFD. Ids outside the vocabulary are skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The beginning-of-sequence token, if the file names one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence token.
    pub fn eos_id(&self) -> u32 {
        self.eos
    }

    /// Whether the model expects BOS before the prompt
    /// (`tokenizer.ggml.add_bos_token`, default false).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The id of the vocabulary entry spelled exactly `text`, as stored in
    /// the file: literal for special tokens (`"<|im_end|>"`), byte-level for
    /// ordinary ones (`"Ġthe"` for " the").
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// The vocabulary entry of `id`, as stored in the file.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The kind of token `id`.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    /// Number of usable merge rules (BPE; 0 for SentencePiece).
    pub fn merge_count(&self) -> usize {
        match &self.encoding {
            Encoding::Bpe { merges, .. } => merges.len(),
            Encoding::Spm { .. } => 0,
        }
    }
}

fn string_array(file: &GgufFile, key: &str) -> Result<Vec<String>> {
    file.get_array(key)?
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) => Ok(s.clone()),
            other => Err(Error::WrongType {
                key: format!("{key}[{i}]"),
                expected: "string",
                found: other.type_name().to_string(),
            }),
        })
        .collect()
}

fn token_types(file: &GgufFile, n: usize) -> Result<Vec<TokenType>> {
    if file.get(KEY_TYPES).is_none() {
        return Ok(vec![TokenType::Normal; n]);
    }
    let raw = file.get_array(KEY_TYPES)?;
    if raw.len() != n {
        return Err(bad(format!(
            "{KEY_TYPES} has {} entries but {KEY_TOKENS} has {n}",
            raw.len()
        )));
    }
    raw.iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_i128()
                .and_then(TokenType::from_raw)
                .ok_or_else(|| bad(format!("{KEY_TYPES}[{i}] is {v:?}, not a token type 0..=6")))
        })
        .collect()
}

/// Each token's bytes, concatenated, and where each starts: literal text for special tokens;
/// byte-level decoded for BPE; for SentencePiece, `▁` read as a space, a byte token as its
/// byte, and unused or undefined tokens as nothing (llama.cpp's `token_to_piece`).
fn decoded_bytes(tokens: &[String], types: &[TokenType], spm: bool) -> (Vec<u8>, Vec<usize>) {
    let mut bytes = Vec::new();
    let mut offsets = Vec::with_capacity(tokens.len() + 1);
    offsets.push(0);
    for (text, &ty) in tokens.iter().zip(types) {
        if ty.is_literal() {
            bytes.extend_from_slice(text.as_bytes());
        } else if !spm {
            byte_level::decode(text, &mut bytes);
        } else if ty == TokenType::Normal {
            spm::unescape(text, &mut bytes);
        } else if ty == TokenType::Byte {
            bytes.extend(spm::byte_token_value(text));
        }
        offsets.push(bytes.len());
    }
    (bytes, offsets)
}

/// The pre-tokenizer a BPE vocabulary names, by the names llama.cpp gives each rule set
/// (`llama_vocab::impl::load`).
fn bpe_pre_tokenizer(file: &GgufFile) -> Result<PreTokenizer> {
    Ok(match file.get_str(KEY_PRE)? {
        "smollm" => PreTokenizer::SmolLm,
        "gpt-2" => PreTokenizer::Gpt2,
        "llama3" | "llama-v3" | "llama-bpe" => PreTokenizer::Llama3,
        "qwen2" | "deepseek-r1-qwen" => PreTokenizer::Qwen2,
        other => {
            return Err(bad(format!(
                "{KEY_PRE} is {other:?}; the supported pre-tokenizers are \"smollm\", \
                 \"gpt-2\", \"llama-bpe\" (Llama 3) and \"qwen2\""
            )))
        }
    })
}

/// A SentencePiece vocabulary's scores and byte tokens. Every byte must have its `<0xXX>`
/// token, so any text encodes.
fn spm_encoding(
    file: &GgufFile,
    tokens: &[String],
    token_to_id: &HashMap<String, u32>,
) -> Result<Encoding> {
    let raw = file.get_array(KEY_SCORES)?;
    if raw.len() != tokens.len() {
        return Err(bad(format!(
            "{KEY_SCORES} has {} entries but {KEY_TOKENS} has {}",
            raw.len(),
            tokens.len()
        )));
    }
    let scores = raw
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::F32(score) => Ok(*score),
            other => Err(bad(format!("{KEY_SCORES}[{i}] is {other:?}, not an f32"))),
        })
        .collect::<Result<Vec<f32>>>()?;
    let mut byte_tokens = Box::new([NO_TOKEN; 256]);
    for (byte, slot) in byte_tokens.iter_mut().enumerate() {
        *slot = *token_to_id
            .get(&format!("<0x{byte:02X}>"))
            .ok_or_else(|| bad(format!("no byte token <0x{byte:02X}> for byte fallback")))?;
    }
    Ok(Encoding::Spm {
        scores,
        byte_tokens,
        add_space_prefix: file.get_bool_or(KEY_ADD_SPACE_PREFIX, true)?,
    })
}

/// Parses `"left right"` merge rules into id pairs. Rules whose parts or
/// result are not in the vocabulary cannot produce a token and are skipped.
fn merges(file: &GgufFile, token_to_id: &HashMap<String, u32>) -> Result<Merges> {
    let rules = string_array(file, KEY_MERGES)?;
    let mut merges = Merges::default();
    let mut joined = String::new();
    for (rank, rule) in rules.iter().enumerate() {
        // As llama.cpp: the separator is the first space after the first
        // character, so a rule may merge a literal space on the left.
        let first_len = rule.chars().next().map_or(0, char::len_utf8);
        let Some(sep) = rule[first_len..].find(' ').map(|i| i + first_len) else {
            return Err(bad(format!("{KEY_MERGES}[{rank}] {rule:?} has no space")));
        };
        let (left, right) = (&rule[..sep], &rule[sep + 1..]);
        joined.clear();
        joined.push_str(left);
        joined.push_str(right);
        let ids = (
            token_to_id.get(left),
            token_to_id.get(right),
            token_to_id.get(joined.as_str()),
        );
        if let (Some(&l), Some(&r), Some(&m)) = ids {
            merges.insert(l, r, rank as u32, m);
        }
    }
    Ok(merges)
}

#[cfg(test)]
mod tests;
