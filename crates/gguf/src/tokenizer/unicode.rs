//! Unicode character classes used by the pre-tokenizer.
//!
//! `\p{L}` (general category Letter) has no exact equivalent in `std`
//! (`char::is_alphabetic` also accepts Nl and combining marks), so the ranges
//! come from `regex-syntax`'s Unicode tables. `\p{N}` is `char::is_numeric`
//! (Nd | Nl | No) and `\s` is `char::is_whitespace` (White_Space), both
//! exact.

use std::sync::OnceLock;

use regex_syntax::hir::{Class, HirKind};

/// The class of a character as the GPT-2 pre-tokenizer regex sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CharClass {
    Letter,
    Number,
    Whitespace,
    /// Anything else: `[^\s\p{L}\p{N}]`.
    Other,
}

pub(crate) fn classify(c: char) -> CharClass {
    if c.is_ascii() {
        return match c {
            'a'..='z' | 'A'..='Z' => CharClass::Letter,
            '0'..='9' => CharClass::Number,
            ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r' => CharClass::Whitespace,
            _ => CharClass::Other,
        };
    }
    if c.is_whitespace() {
        CharClass::Whitespace
    } else if c.is_numeric() {
        CharClass::Number
    } else if is_letter(c) {
        CharClass::Letter
    } else {
        CharClass::Other
    }
}

/// True for `\p{N}`.
pub(crate) fn is_number(c: char) -> bool {
    c.is_numeric()
}

fn is_letter(c: char) -> bool {
    let ranges = letter_ranges();
    // Last range whose start is <= c.
    let idx = ranges.partition_point(|&(start, _)| start <= c);
    idx > 0 && c <= ranges[idx - 1].1
}

fn letter_ranges() -> &'static [(char, char)] {
    static RANGES: OnceLock<Vec<(char, char)>> = OnceLock::new();
    RANGES.get_or_init(|| {
        let hir = regex_syntax::Parser::new()
            .parse(r"\p{L}")
            .expect("the constant pattern \\p{L} is valid for regex-syntax");
        match hir.kind() {
            HirKind::Class(Class::Unicode(class)) => class
                .ranges()
                .iter()
                .map(|r| (r.start(), r.end()))
                .collect(),
            // regex-syntax always compiles a Unicode property to a Unicode class.
            _ => Vec::new(),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes() {
        assert_eq!(classify('a'), CharClass::Letter);
        assert_eq!(classify('é'), CharClass::Letter);
        assert_eq!(classify('日'), CharClass::Letter);
        assert_eq!(classify('ß'), CharClass::Letter);
        assert_eq!(classify('5'), CharClass::Number);
        assert_eq!(classify('٣'), CharClass::Number); // Arabic-Indic digit
        assert_eq!(classify('²'), CharClass::Number); // No
        assert_eq!(classify('Ⅻ'), CharClass::Number); // Nl, alphabetic but not a letter
        assert_eq!(classify('\u{3000}'), CharClass::Whitespace);
        assert_eq!(classify('\u{a0}'), CharClass::Whitespace);
        assert_eq!(classify('\u{0301}'), CharClass::Other); // combining acute: Mn
        assert_eq!(classify('\u{093e}'), CharClass::Other); // Devanagari vowel sign: Mc
        assert_eq!(classify('🙂'), CharClass::Other);
        assert_eq!(classify('!'), CharClass::Other);
        assert_eq!(classify('\u{0}'), CharClass::Other);
        assert!(letter_ranges().len() > 100);
    }
}
