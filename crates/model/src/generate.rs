//! A single-sequence generation loop: admission against the context length, all pages
//! allocated up front (so a request that cannot fit fails before any work), chunked prefill,
//! then one decode step per token. The pages are released on every path out.

use crate::sampling::{Sampler, SamplingParams};
use crate::{Error, Logits, Model, Result, SeqStep, StopMatcher};
use gguf::Tokenizer;
use kv::{Owner, PagePool, PageTable};
use std::time::Instant;

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Stop at the model's end-of-sequence token (the usual choice).
    pub stop_at_eos: bool,
    /// Prompt tokens per prefill step.
    pub prefill_chunk: usize,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// A stop string or the end-of-sequence token.
    Stop,
}

/// Timings and counts of one generation.
#[derive(Clone, Debug, Default)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
}

/// The result of one generation.
#[derive(Clone, Debug)]
pub struct Generated {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub stats: GenerateStats,
    /// Logits for the first generated token (after the whole prompt).
    pub first_logits: Vec<f32>,
}

/// Generates for one request, calling `on_text` with each piece of text as it becomes final.
pub fn generate(
    model: &Model,
    tokenizer: &Tokenizer,
    pool: &mut PagePool,
    owner: Owner,
    request: &GenerateRequest,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generated> {
    if request.prompt.is_empty() {
        return Err(Error::EmptyPrompt);
    }
    let context_length = model.config().context_length;
    let prompt_tokens = request.prompt.len();
    let total_tokens = prompt_tokens.saturating_add(request.max_tokens);
    if total_tokens > context_length {
        return Err(Error::ContextLengthExceeded {
            prompt_tokens,
            max_tokens: request.max_tokens,
            context_length,
        });
    }
    let table = pool.allocate(owner, total_tokens)?;
    // The pages go back even if a step panics (a broken invariant), before the panic goes on.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run(model, tokenizer, &mut *pool, &table, request, on_text)
    }));
    pool.release(table)?;
    result.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

fn run(
    model: &Model,
    tokenizer: &Tokenizer,
    pool: &mut PagePool,
    table: &PageTable,
    request: &GenerateRequest,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generated> {
    let mut stats = GenerateStats {
        prompt_tokens: request.prompt.len(),
        ..Default::default()
    };
    let started = Instant::now();
    let chunk = request.prefill_chunk.max(1);
    let mut logits = None;
    for (i, tokens) in request.prompt.chunks(chunk).enumerate() {
        let start_pos = i * chunk;
        let rows = if start_pos + tokens.len() == request.prompt.len() {
            crate::LogitRows::Last
        } else {
            crate::LogitRows::None
        };
        let step = SeqStep {
            table,
            tokens,
            start_pos,
            logits: rows,
        };
        logits = Some(model.forward(pool, &[step])?);
    }
    stats.prefill_seconds = started.elapsed().as_secs_f64();
    let first_logits = logits
        .as_ref()
        .and_then(Logits::last)
        .expect("the last prefill chunk asks for logits")
        .to_vec();

    let started = Instant::now();
    let mut sampler = Sampler::new(request.sampling.clone(), &request.prompt);
    let mut stops = StopMatcher::new(&request.stop);
    let mut pending_bytes = Vec::new();
    let mut tokens = Vec::new();
    let mut finish_reason = FinishReason::Length;
    let mut next_logits = first_logits.clone();
    while tokens.len() < request.max_tokens {
        let token = sampler.sample(&next_logits);
        if request.stop_at_eos && token == tokenizer.eos_id() {
            finish_reason = FinishReason::Stop;
            break;
        }
        tokens.push(token);
        pending_bytes.extend_from_slice(tokenizer.token_bytes(token));
        let (shown, stopped) = stops.push(&take_complete_utf8(&mut pending_bytes));
        on_text(&shown);
        if stopped {
            finish_reason = FinishReason::Stop;
            break;
        }
        if tokens.len() == request.max_tokens {
            break;
        }
        let start_pos = request.prompt.len() + tokens.len() - 1;
        let step = SeqStep {
            table,
            tokens: &tokens[tokens.len() - 1..],
            start_pos,
            logits: crate::LogitRows::Last,
        };
        next_logits.copy_from_slice(
            model
                .forward(pool, &[step])?
                .last()
                .expect("the step asks for logits"),
        );
    }
    if finish_reason == FinishReason::Length || !pending_bytes.is_empty() {
        let (shown, _) = stops.push(&String::from_utf8_lossy(&pending_bytes));
        on_text(&shown);
    }
    on_text(&stops.finish());
    stats.completion_tokens = tokens.len();
    stats.decode_seconds = started.elapsed().as_secs_f64();
    Ok(Generated {
        tokens,
        text: stops.text().to_string(),
        finish_reason,
        stats,
        first_logits,
    })
}

/// Takes the longest valid UTF-8 prefix out of `bytes`, leaving an incomplete character (a
/// token can end mid-character) for the next token. Invalid bytes become U+FFFD.
pub fn take_complete_utf8(bytes: &mut Vec<u8>) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) => {
            let text = text.to_string();
            bytes.clear();
            text
        }
        Err(e) if e.error_len().is_none() => {
            let valid = e.valid_up_to();
            let text = String::from_utf8_lossy(&bytes[..valid]).into_owned();
            bytes.drain(..valid);
            text
        }
        Err(e) => {
            // Replace the invalid sequence, keep what follows for the next round.
            let end = e.valid_up_to() + e.error_len().unwrap_or(0);
            let mut text = String::from_utf8_lossy(&bytes[..end]).into_owned();
            bytes.drain(..end);
            text.push_str(&take_complete_utf8(bytes));
            text
        }
    }
}

#[cfg(test)]
mod tests {
    use super::take_complete_utf8;

    #[test]
    fn incomplete_characters_wait_and_invalid_bytes_are_replaced() {
        let euro = "€".as_bytes();
        let mut bytes = vec![b'a', euro[0], euro[1]];
        assert_eq!(take_complete_utf8(&mut bytes), "a");
        bytes.push(euro[2]);
        assert_eq!(take_complete_utf8(&mut bytes), "€");
        let mut bytes = vec![0xFF, euro[0], euro[1]];
        assert_eq!(take_complete_utf8(&mut bytes), "\u{FFFD}");
        bytes.push(euro[2]);
        assert_eq!(take_complete_utf8(&mut bytes), "€");
        assert!(bytes.is_empty());
    }
}
