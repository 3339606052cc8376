//! The prompts every target gets: the fixed-seed mix and the exact-length sweep sets.

use crate::curves;
use crate::machine::ModelFacts;
use crate::Args;
use crate::PromptLength;
use crate::PromptSet;
use anyhow::bail;
use anyhow::Context;
use anyhow::Result;

/// The prompts of every prompt-tokens point: --prompt-requests each, of exactly that many
/// tokens, none sharing a prefix with another (no engine can reuse an earlier prompt's KV).
pub(crate) fn prompt_sets(
    lengths: &[PromptLength],
    model: &ModelFacts,
    args: &Args,
) -> Result<Vec<PromptSet>> {
    let limit = model
        .context_length
        .saturating_sub(args.prompt_max_tokens + 1);
    let count = |text: &str| model.tokenizer.encode(text, false).len();
    let mut sets = Vec::new();
    for (point, length) in lengths.iter().enumerate() {
        let tokens = match *length {
            PromptLength::Tokens(n) if n > limit => bail!(
                "--sweep prompt-tokens={n} leaves no room for --prompt-max-tokens {} in the \
                 model's context of {} tokens (use at most {limit}, or `max`)",
                args.prompt_max_tokens,
                model.context_length
            ),
            PromptLength::Tokens(n) => n,
            PromptLength::Max => limit,
        };
        let mut prompts = Vec::new();
        for request in 0..args.prompt_requests.max(1) {
            let seed = args.seed ^ ((point as u64) << 32 | request as u64).wrapping_add(1);
            let (text, have) = curves::prompt_of_tokens(&count, tokens, seed);
            if have != tokens {
                eprintln!("  note: a prompt for {tokens} tokens has {have}");
            }
            prompts.push(text);
        }
        sets.push(PromptSet { tokens, prompts });
    }
    Ok(sets)
}

pub(crate) fn parse_range(text: &str) -> Result<(usize, usize)> {
    let (low, high) = text
        .split_once('-')
        .context("--prompt-words takes MIN-MAX")?;
    let (low, high): (usize, usize) = (low.parse()?, high.parse()?);
    if low == 0 || low > high {
        bail!("--prompt-words needs 1 <= MIN <= MAX");
    }
    Ok((low, high))
}

/// Prompts of random words (fixed seed), each asking for a long answer.
pub(crate) fn prompt_mix(
    seed: u64,
    count: usize,
    min_words: usize,
    max_words: usize,
) -> Vec<String> {
    const WORDS: &[&str] = &[
        "river", "mountain", "engine", "garden", "history", "signal", "copper", "market", "winter",
        "lantern", "harbor", "theory", "orchard", "circuit", "planet", "library", "teacher",
        "bridge", "storm", "village", "algebra", "violin", "desert", "factory",
    ];
    let mut rng = stats::SplitMix64::new(seed);
    (0..count)
        .map(|_| {
            let words = min_words + rng.below(max_words - min_words + 1);
            let body: Vec<&str> = (0..words).map(|_| WORDS[rng.below(WORDS.len())]).collect();
            format!(
                "Notes: {}.\nWrite a long, detailed story that uses these notes:\n",
                body.join(" ")
            )
        })
        .collect()
}
