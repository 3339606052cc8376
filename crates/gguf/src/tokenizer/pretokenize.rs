//! Pre-tokenization: splitting text into words before BPE.
//!
//! llama.cpp's `smollm` pre-tokenizer applies two regexes in sequence, each
//! splitting the pieces the previous one produced (matches and the text
//! between matches both become pieces):
//!
//! 1. `\p{N}` — every number character becomes a piece of its own;
//! 2. the GPT-2 regex
//!    `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
//!
//! This is a hand-written scanner rather than `fancy-regex`: the look-ahead
//! `(?!\S)` forces fancy-regex onto its backtracking engine, which was about
//! 9x slower than this single linear pass on a 5,000-token prompt (3.5 ms vs
//! 0.4 ms), and llama.cpp itself runs the
//! same hand-written scanner (`unicode_regex_split_custom_gpt2`), so mirroring
//! it keeps edge cases identical. A property test checks this scanner against
//! fancy-regex running the literal regexes.

use std::ops::Range;

use super::unicode::{classify, is_number, CharClass};

/// Which pre-tokenizer a vocabulary uses (`tokenizer.ggml.pre`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PreTokenizer {
    /// `smollm`: digits split one by one, then the GPT-2 regex.
    SmolLm,
    /// `gpt-2`: the GPT-2 regex alone.
    Gpt2,
}

/// Appends to `out` the byte ranges of the words of `text`, in order; they
/// tile `text` exactly.
pub(crate) fn split(text: &str, pre: PreTokenizer, out: &mut Vec<Range<usize>>) {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let end_offset = |i: usize| chars.get(i).map_or(text.len(), |&(off, _)| off);
    match pre {
        PreTokenizer::Gpt2 => gpt2(&chars, 0, chars.len(), text.len(), out),
        PreTokenizer::SmolLm => {
            let mut run_start = 0;
            for (i, &(_, c)) in chars.iter().enumerate() {
                if is_number(c) {
                    gpt2(&chars, run_start, i, end_offset(i), out);
                    out.push(end_offset(i)..end_offset(i + 1));
                    run_start = i + 1;
                }
            }
            gpt2(&chars, run_start, chars.len(), text.len(), out);
        }
    }
}

/// The GPT-2 regex over the characters `chars[lo..hi]`, whose text ends at
/// byte `hi_offset`.
fn gpt2(
    chars: &[(usize, char)],
    lo: usize,
    hi: usize,
    hi_offset: usize,
    out: &mut Vec<Range<usize>>,
) {
    let offset = |i: usize| if i < hi { chars[i].0 } else { hi_offset };
    let char_at = |i: usize| if i < hi { Some(chars[i].1) } else { None };
    let class_at = |i: usize| char_at(i).map(classify);

    let mut pos = lo;
    while pos < hi {
        let start = pos;
        let c = chars[pos].1;
        pos = match_at(pos, c, hi, &char_at, &class_at);
        out.push(offset(start)..offset(pos));
    }
}

/// End (exclusive, in chars) of the regex match starting at `pos`.
fn match_at(
    pos: usize,
    c: char,
    hi: usize,
    char_at: &impl Fn(usize) -> Option<char>,
    class_at: &impl Fn(usize) -> Option<CharClass>,
) -> usize {
    // 's|'t|'re|'ve|'m|'ll|'d (case-sensitive, as in the regex)
    if c == '\'' {
        match (char_at(pos + 1), char_at(pos + 2)) {
            (Some('s' | 't' | 'm' | 'd'), _) => return pos + 2,
            (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l')) => {
                return pos + 3
            }
            _ => {}
        }
    }

    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`
    let run_class = if c == ' ' {
        class_at(pos + 1)
    } else {
        class_at(pos)
    };
    if let Some(class @ (CharClass::Letter | CharClass::Number | CharClass::Other)) = run_class {
        let mut end = pos + usize::from(c == ' ');
        while class_at(end) == Some(class) {
            end += 1;
        }
        return end;
    }

    // `\s+(?!\S)` then `\s+`
    let mut n_ws = 0;
    while class_at(pos + n_ws) == Some(CharClass::Whitespace) {
        n_ws += 1;
    }
    if n_ws > 1 && pos + n_ws < hi {
        // Leave the last whitespace to prefix the following word.
        return pos + n_ws - 1;
    }
    if n_ws > 0 {
        return pos + n_ws;
    }
    // Unreachable: every character is a letter, number, whitespace or other.
    pos + 1
}

#[cfg(test)]
mod tests;
