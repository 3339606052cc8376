//! SentencePiece-style encoding (`tokenizer.ggml.model = "llama"`, as Gemma's and Llama 2's
//! files have): spaces become `▁`, then adjacent pieces merge, highest vocabulary score
//! first, while their concatenation is a token; a piece left that is no token goes out as
//! its bytes' `<0xXX>` tokens (byte fallback). This is llama.cpp's `llm_tokenizer_spm`
//! step for step, so ties break the same way: equal scores merge leftmost first.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// SentencePiece's visible space, which stands for ' ' in the vocabulary.
pub(crate) const SPACE: char = '\u{2581}';

/// One piece of the text being merged: bytes `start..start + len`, linked to its neighbours.
#[derive(Clone, Copy)]
struct Piece {
    start: usize,
    /// 0 once merged into the piece on its left.
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of two adjacent pieces into a token.
struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    /// Bytes of the merged text, to tell a stale candidate (a side merged since) from a live one.
    len: usize,
}

impl Ord for Candidate {
    /// Higher score first; on equal scores the leftmost first.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

/// What SentencePiece encoding needs of the vocabulary.
pub(crate) struct Vocab<'a> {
    pub token_to_id: &'a HashMap<String, u32>,
    pub scores: &'a [f32],
    /// The `<0xXX>` token of each byte.
    pub byte_tokens: &'a [u32; 256],
}

/// Appends the ids of `text` (spaces already written as [`SPACE`]) to `out`.
pub(crate) fn encode(text: &str, vocab: &Vocab, out: &mut Vec<u32>) {
    let mut pieces: Vec<Piece> = Vec::with_capacity(text.len());
    for (i, (start, c)) in text.char_indices().enumerate() {
        pieces.push(Piece {
            start,
            len: c.len_utf8(),
            prev: i.checked_sub(1),
            next: Some(i + 1),
        });
    }
    let Some(last) = pieces.last_mut() else {
        return;
    };
    last.next = None;

    let mut queue = BinaryHeap::new();
    let candidate = |pieces: &[Piece], left: Option<usize>, right: Option<usize>| {
        let (left, right) = (left?, right?);
        let (l, r) = (pieces[left], pieces[right]);
        let merged = &text[l.start..r.start + r.len];
        let id = *vocab.token_to_id.get(merged)?;
        let score = *vocab.scores.get(id as usize)?;
        Some(Candidate {
            score,
            left,
            right,
            len: merged.len(),
        })
    };
    for right in 1..pieces.len() {
        queue.extend(candidate(&pieces, Some(right - 1), Some(right)));
    }
    while let Some(best) = queue.pop() {
        let (left, right) = (pieces[best.left], pieces[best.right]);
        if left.len == 0 || right.len == 0 || left.len + right.len != best.len {
            continue;
        }
        pieces[best.left].len += right.len;
        pieces[best.right].len = 0;
        pieces[best.left].next = right.next;
        if let Some(next) = right.next {
            pieces[next].prev = Some(best.left);
        }
        queue.extend(candidate(&pieces, left.prev, Some(best.left)));
        queue.extend(candidate(&pieces, Some(best.left), right.next));
    }

    // Every merge made a token, so a piece that is no token is a single character the
    // vocabulary lacks: its bytes go out one by one. (llama.cpp also keeps a map from each
    // merged text back to its halves for such pieces, but it only ever holds tokens, so
    // it never applies.)
    let mut at = Some(0);
    while let Some(i) = at {
        let piece = pieces[i];
        let text = &text[piece.start..piece.start + piece.len];
        match vocab.token_to_id.get(text) {
            Some(&id) => out.push(id),
            None => out.extend(text.bytes().map(|b| vocab.byte_tokens[usize::from(b)])),
        }
        at = piece.next;
    }
}

/// The text of vocabulary entry `token` as it reads: `▁` back to spaces.
pub(crate) fn unescape(token: &str, out: &mut Vec<u8>) {
    for c in token.chars() {
        let c = if c == SPACE { ' ' } else { c };
        out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
    }
}

/// The byte a `<0xXX>` token stands for.
pub(crate) fn byte_token_value(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab_of(entries: &[(&str, f32)]) -> (HashMap<String, u32>, Vec<f32>, [u32; 256]) {
        let mut token_to_id = HashMap::new();
        let mut scores = Vec::new();
        let mut byte_tokens = [0u32; 256];
        for b in 0..=255u8 {
            byte_tokens[usize::from(b)] = scores.len() as u32;
            token_to_id.insert(format!("<0x{b:02X}>"), scores.len() as u32);
            scores.push(0.0);
        }
        for &(text, score) in entries {
            token_to_id.insert(text.to_string(), scores.len() as u32);
            scores.push(score);
        }
        (token_to_id, scores, byte_tokens)
    }

    fn pieces(text: &str, entries: &[(&str, f32)]) -> Vec<String> {
        let (token_to_id, scores, byte_tokens) = vocab_of(entries);
        let vocab = Vocab {
            token_to_id: &token_to_id,
            scores: &scores,
            byte_tokens: &byte_tokens,
        };
        let mut ids = Vec::new();
        encode(text, &vocab, &mut ids);
        let names: HashMap<u32, &String> = token_to_id.iter().map(|(t, &i)| (i, t)).collect();
        ids.iter().map(|id| names[id].to_string()).collect()
    }

    #[test]
    fn highest_scores_merge_first_and_ties_go_left() {
        let vocab = [
            ("a", -1.0),
            ("b", -1.0),
            ("ab", -2.0),
            ("bb", -1.5),
            ("abb", -3.0),
        ];
        // "bb" outscores "ab" and merges first; then a + bb is the token "abb".
        assert_eq!(pieces("abb", &vocab), ["abb"]);
        let no_abb = [("a", -1.0), ("b", -1.0), ("ab", -2.0), ("bb", -1.5)];
        assert_eq!(pieces("abb", &no_abb), ["a", "bb"]);
        // Equal scores: the leftmost pair merges first.
        let tie = [("a", -1.0), ("aa", -1.0)];
        assert_eq!(pieces("aaa", &tie), ["aa", "a"]);
    }

    /// A token reached only through pieces that are tokens: "▁hi" needs "hi" (or "▁h").
    #[test]
    fn characters_the_vocabulary_lacks_fall_back_to_bytes() {
        let vocab = [
            ("▁hi", -1.0),
            ("hi", -1.5),
            ("▁", -2.0),
            ("h", -3.0),
            ("i", -3.0),
        ];
        assert_eq!(pieces("▁hi▁é", &vocab), ["▁hi", "▁", "<0xC3>", "<0xA9>"]);
        assert_eq!(pieces("", &vocab), Vec::<String>::new());
        let no_bridge = [("▁hi", -1.0), ("▁", -2.0), ("h", -3.0), ("i", -3.0)];
        assert_eq!(pieces("▁hi", &no_bridge), ["▁", "h", "i"]);
    }

    proptest::proptest! {
        /// Any text encodes without a panic, to ids of the vocabulary whose bytes are the
        /// text's.
        #[test]
        fn any_text_encodes_to_its_own_bytes(text in "\\PC*") {
            let entries = [("▁a", -1.0), ("ab", -2.0), ("▁", -3.0), ("a", -3.0), ("b", -3.0)];
            let (token_to_id, scores, byte_tokens) = vocab_of(&entries);
            let vocab = Vocab { token_to_id: &token_to_id, scores: &scores, byte_tokens: &byte_tokens };
            let escaped: String = text.chars().map(|c| if c == ' ' { SPACE } else { c }).collect();
            let mut ids = Vec::new();
            encode(&escaped, &vocab, &mut ids);
            let names: HashMap<u32, &String> = token_to_id.iter().map(|(t, &i)| (i, t)).collect();
            let mut bytes = Vec::new();
            for id in &ids {
                let name = names[id];
                match byte_token_value(name) {
                    Some(b) => bytes.push(b),
                    None => bytes.extend_from_slice(name.as_bytes()),
                }
            }
            proptest::prop_assert_eq!(bytes, escaped.into_bytes());
        }
    }

    #[test]
    fn byte_tokens_and_spaces_read_back() {
        assert_eq!(byte_token_value("<0x0A>"), Some(b'\n'));
        assert_eq!(byte_token_value("<0xfF>"), Some(0xff));
        assert_eq!(byte_token_value("<0x0>"), None);
        assert_eq!(byte_token_value("0x0A"), None);
        let mut out = Vec::new();
        unescape("▁the▁end", &mut out);
        assert_eq!(out, b" the end");
    }
}
