use std::sync::OnceLock;

use fancy_regex::Regex;
use proptest::prelude::*;

use super::*;

const DIGITS: &str = r"\p{N}";
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

fn words(text: &str, pre: PreTokenizer) -> Vec<&str> {
    let mut ranges = Vec::new();
    split(text, pre, &mut ranges);
    ranges.into_iter().map(|r| &text[r]).collect()
}

/// Splits `text` by `re`: matches and the gaps between them both become pieces,
/// as llama.cpp's `unicode_regex_split` does.
fn regex_split<'t>(re: &Regex, text: &'t str) -> Vec<&'t str> {
    let mut out = Vec::new();
    let mut last = 0;
    for m in re.find_iter(text) {
        let m = m.expect("the reference regexes do not hit fancy-regex's backtrack limit");
        if m.start() > last {
            out.push(&text[last..m.start()]);
        }
        out.push(m.as_str());
        last = m.end();
    }
    if last < text.len() {
        out.push(&text[last..]);
    }
    out
}

const ALL: [PreTokenizer; 4] = [
    PreTokenizer::SmolLm,
    PreTokenizer::Gpt2,
    PreTokenizer::Llama3,
    PreTokenizer::Qwen2,
];

fn reference(text: &str, pre: PreTokenizer) -> Vec<&str> {
    static REGEXES: OnceLock<[Regex; 4]> = OnceLock::new();
    let [digits, gpt2, llama3, qwen2] = REGEXES.get_or_init(|| {
        [
            Regex::new(DIGITS).expect("digit regex is valid"),
            Regex::new(GPT2).expect("GPT-2 regex is valid"),
            Regex::new(LLAMA3).expect("Llama 3 regex is valid"),
            Regex::new(&LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")).expect("Qwen 2 regex is valid"),
        ]
    });
    let pieces = match pre {
        PreTokenizer::SmolLm => regex_split(digits, text),
        PreTokenizer::Gpt2 => vec![text],
        PreTokenizer::Llama3 => return regex_split(llama3, text),
        PreTokenizer::Qwen2 => return regex_split(qwen2, text),
    };
    pieces
        .into_iter()
        .flat_map(|p| regex_split(gpt2, p))
        .collect()
}

#[test]
fn hand_checked_examples() {
    let smol = PreTokenizer::SmolLm;
    assert_eq!(words("Hello world", smol), ["Hello", " world"]);
    assert_eq!(words("12345", smol), ["1", "2", "3", "4", "5"]);
    assert_eq!(words("abc 123", smol), ["abc", " ", "1", "2", "3"]);
    assert_eq!(words("abc 123", PreTokenizer::Gpt2), ["abc", " 123"]);
    assert_eq!(
        words("I'm you'll 'S", smol),
        ["I", "'m", " you", "'ll", " '", "S"]
    );
    assert_eq!(words("a   b", smol), ["a", "  ", " b"]);
    assert_eq!(words("  \n\n  x", smol), ["  \n\n ", " x"]);
    assert_eq!(words("x \n", smol), ["x", " \n"]);
    assert_eq!(
        words("\tif (x) {\n\t\treturn;", smol),
        ["\t", "if", " (", "x", ")", " {", "\n\t", "\t", "return", ";"]
    );
    assert_eq!(words("", smol), Vec::<&str>::new());
    let llama3 = PreTokenizer::Llama3;
    assert_eq!(
        words("(x) 1234567", llama3),
        ["(x", ")", " ", "123", "456", "7"]
    );
    assert_eq!(
        words("(x) 1234567", PreTokenizer::Qwen2)[3..],
        ["1", "2", "3", "4", "5", "6", "7"]
    );
    assert_eq!(words("\tif I'M", llama3), ["\tif", " I", "'M"]);
    assert_eq!(words("a.\n\nb", llama3), ["a", ".\n\n", "b"]);
    assert_eq!(
        words("héllo wörld 日本語 🙂", smol),
        ["héllo", " wörld", " 日本語", " 🙂"]
    );
}

#[test]
fn matches_fancy_regex_on_examples() {
    for text in [
        "Hello, world! It's 2024-05-01 at 10:30pm.",
        "  \n\n  x",
        "a\u{a0}\u{a0}b \u{3000}c",
        "don't DON'T we'Re they've I'd 'll",
        "x²+y³ = Ⅻ ٣٤",
        "e\u{301}t\u{e9} \u{915}\u{93e}",
        "tabs\t\tand\r\nnewlines\n\n\n",
        "   ",
        "🙂🙂 ok",
        "(x) \tif 1234567 x12345y 3.14159",
        "WE'RE I'M 'Ll it'S",
        "a.\n\n\tb!!\r\n\r\n  c  \n",
    ] {
        for pre in ALL {
            assert_eq!(
                words(text, pre),
                reference(text, pre),
                "text {text:?}, {pre:?}"
            );
        }
    }
}

/// Strings drawn from characters of every class the scanner distinguishes.
fn tricky_text() -> impl Strategy<Value = String> {
    let alphabet = vec![
        ' ', ' ', '\n', '\t', '\r', '\u{a0}', '\u{3000}', 'a', 'Z', 's', 't', 'r', 'e', 'v', 'l',
        'm', 'd', 'S', 'E', 'L', 'é', '日', '\'', '\'', '"', '!', '.', '-', '0', '7', '7', '²',
        'Ⅻ', '٣', '\u{301}', '🙂', '_', '\u{0}', '(',
    ];
    proptest::collection::vec(proptest::sample::select(alphabet), 0..40)
        .prop_map(|chars| chars.into_iter().collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn scanner_matches_fancy_regex(text in tricky_text()) {
        for pre in ALL {
            prop_assert_eq!(words(&text, pre), reference(&text, pre));
        }
    }

    #[test]
    fn pieces_tile_any_text(text in any::<String>()) {
        for pre in ALL {
            let pieces = words(&text, pre);
            prop_assert!(pieces.iter().all(|p| !p.is_empty()));
            prop_assert_eq!(pieces.concat(), text.clone());
        }
    }
}
