//! Splitting text on special-token strings before pre-tokenization.
//!
//! Mirrors llama.cpp's `tokenizer_st_partition`: special tokens are tried
//! longest first; each one splits every still-raw fragment at all of its
//! (non-overlapping, left-to-right) occurrences.

/// A piece of the input: raw text to pre-tokenize, or a special token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

/// A string that is matched in the input as a whole token.
#[derive(Debug, Clone)]
pub(crate) struct SpecialToken {
    pub(crate) text: String,
    pub(crate) id: u32,
    /// Control and unknown tokens are matched only when the caller asks for
    /// special-token parsing; user-defined ones always are.
    pub(crate) only_when_parsing_special: bool,
}

/// Orders specials as they are tried: longest text first, then by id.
pub(crate) fn sort_specials(specials: &mut [SpecialToken]) {
    specials.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));
}

/// Splits `text` on the given specials (already sorted by [`sort_specials`]).
pub(crate) fn partition<'t>(
    text: &'t str,
    specials: &[SpecialToken],
    parse_special: bool,
) -> Vec<Fragment<'t>> {
    let mut fragments = vec![Fragment::Text(text)];
    for special in specials {
        if special.text.is_empty() || (special.only_when_parsing_special && !parse_special) {
            continue;
        }
        let needle = special.text.as_str();
        if !fragments
            .iter()
            .any(|f| matches!(f, Fragment::Text(t) if t.contains(needle)))
        {
            continue;
        }
        let mut next = Vec::with_capacity(fragments.len() + 2);
        for fragment in fragments {
            let Fragment::Text(t) = fragment else {
                next.push(fragment);
                continue;
            };
            let mut last = 0;
            for (start, matched) in t.match_indices(needle) {
                if start > last {
                    next.push(Fragment::Text(&t[last..start]));
                }
                next.push(Fragment::Token(special.id));
                last = start + matched.len();
            }
            if last < t.len() {
                next.push(Fragment::Text(&t[last..]));
            }
        }
        fragments = next;
    }
    fragments
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specials() -> Vec<SpecialToken> {
        let mut s = vec![
            SpecialToken {
                text: "<s>".into(),
                id: 1,
                only_when_parsing_special: true,
            },
            SpecialToken {
                text: "<s><s>".into(),
                id: 2,
                only_when_parsing_special: true,
            },
            SpecialToken {
                text: "<user>".into(),
                id: 3,
                only_when_parsing_special: false,
            },
        ];
        sort_specials(&mut s);
        s
    }

    #[test]
    fn longest_first() {
        use Fragment::*;
        let s = specials();
        assert_eq!(
            partition("a<s><s><s>b", &s, true),
            [Text("a"), Token(2), Token(1), Text("b")]
        );
        assert_eq!(partition("<s>", &s, true), [Token(1)]);
    }

    #[test]
    fn control_tokens_only_when_parsing_special() {
        use Fragment::*;
        let s = specials();
        assert_eq!(
            partition("x<s><user>y", &s, false),
            [Text("x<s>"), Token(3), Text("y")]
        );
        assert_eq!(partition("", &s, true), [Text("")]);
    }
}
