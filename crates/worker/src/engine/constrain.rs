//! Structured output on the engine. The model's vocabulary for the grammar engine is built on
//! a thread of its own when a decoding engine starts, so no step waits for it. Each step, the
//! constrained requests in the batch hand their grammars to a thread that computes their
//! masks while the model computes the step's logits: a mask reads only the tokens accepted
//! so far, so it is ready when the logits are, and the batch is not held up by it. Sampling
//! then applies each mask and gives the grammar the chosen token.

use super::{Constrained, DecodeState, Engine, Key, Phase, Stage};
use gguf::Tokenizer;
use grammar::{Constraint, Mask};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use transfer::Role;

/// The model's tokens for the grammar engine, built once per engine.
#[derive(Clone)]
pub(super) struct GrammarVocabulary(Arc<OnceLock<Result<grammar::Vocabulary, String>>>);

impl GrammarVocabulary {
    /// Starts building the vocabulary on its own thread (a tenth of a second for this model)
    /// when `role` decodes; a prefill engine never needs it.
    pub(super) fn start(role: Role, tokenizer: &Tokenizer) -> GrammarVocabulary {
        let cell = GrammarVocabulary(Arc::default());
        if role != Role::Prefill {
            let (builder, tokenizer) = (cell.clone(), tokenizer.clone());
            let spawned = std::thread::Builder::new()
                .name("grammar-vocabulary".into())
                .spawn(move || {
                    builder
                        .0
                        .get_or_init(|| grammar::Vocabulary::new(&tokenizer));
                });
            if let Err(error) = spawned {
                tracing::warn!(%error, "building the grammar vocabulary at its first use");
            }
        }
        cell
    }

    /// The vocabulary, waiting for it (or building it here) if it is not ready yet.
    fn get(&self, tokenizer: &Tokenizer) -> Result<&grammar::Vocabulary, String> {
        self.0
            .get_or_init(|| grammar::Vocabulary::new(tokenizer))
            .as_ref()
            .map_err(Clone::clone)
    }
}

/// The grammars of one step's constrained requests, out of their states while their masks
/// are computed, each compiled at its request's first step.
pub(super) struct Masking {
    grammars: Vec<(Key, Result<Box<Constraint>, String>)>,
}

/// Each constrained request's mask for this step (or why it has none).
pub(super) type Masks = HashMap<Key, Result<Mask, String>>;

impl Engine {
    /// Takes the grammars of the constrained requests among `keys` (decoding requests in this
    /// step) out of their states, compiling those not compiled yet; they are marked
    /// `Masking` until [`Engine::masked`] puts them back.
    pub(super) fn take_grammars(&mut self, keys: &[Key]) -> Masking {
        let mut grammars = Vec::new();
        for key in keys {
            let Some(state) = decode_state(&mut self.requests, key) else {
                continue;
            };
            let grammar = match std::mem::replace(&mut state.constraint, Constrained::Masking) {
                Constrained::Free => {
                    state.constraint = Constrained::Free;
                    continue;
                }
                Constrained::Active(grammar) => Ok(grammar),
                Constrained::Pending(wire) => compile(&self.vocabulary, &self.tokenizer, &wire),
                Constrained::Masking => Err("a grammar was taken twice".to_string()),
            };
            grammars.push((*key, grammar));
        }
        Masking { grammars }
    }

    /// Puts the grammars back into their requests' states, with the masks computed.
    pub(super) fn masked(
        &mut self,
        masking: Masking,
        masks: Vec<Option<Result<Mask, String>>>,
    ) -> Masks {
        let mut out = Masks::new();
        // A mask thread that panicked computed none: its requests fail, their grammars back.
        let masks = masks.into_iter().chain(std::iter::repeat_with(|| None));
        for ((key, grammar), mask) in masking.grammars.into_iter().zip(masks) {
            let mask = match grammar {
                Ok(grammar) => {
                    if let Some(state) = decode_state(&mut self.requests, &key) {
                        state.constraint = Constrained::Active(grammar);
                    }
                    mask.unwrap_or_else(|| Err("the step computed no mask".to_string()))
                }
                Err(error) => Err(error),
            };
            out.insert(key, mask);
        }
        out
    }
}

impl Masking {
    pub(super) fn is_empty(&self) -> bool {
        self.grammars.is_empty()
    }

    /// Every compiled grammar's mask for the next token, in order (`None` where it did not
    /// compile). Runs beside the forward pass.
    pub(super) fn compute(&mut self) -> Vec<Option<Result<Mask, String>>> {
        self.grammars
            .iter_mut()
            .map(|(_, grammar)| grammar.as_mut().ok().map(|g| g.next_mask()))
            .collect()
    }
}

fn compile(
    vocabulary: &GrammarVocabulary,
    tokenizer: &Tokenizer,
    wire: &str,
) -> Result<Box<Constraint>, String> {
    let shape = grammar::Shape::from_wire(wire)?;
    Ok(Box::new(vocabulary.get(tokenizer)?.constraint(&shape)?))
}

fn decode_state<'a>(
    requests: &'a mut HashMap<Key, super::Request>,
    key: &Key,
) -> Option<&'a mut DecodeState> {
    match requests.get_mut(key) {
        Some(super::Request {
            phase:
                Phase::Admitted {
                    stage: Stage::Decoding(state),
                    ..
                },
            ..
        }) => Some(state),
        _ => None,
    }
}

/// Samples the next token, within the request's grammar if it has one, with the mask this
/// step computed for it (the model's own scores, for logprobs, stay unmasked).
pub(super) fn constrained_sample(
    state: &mut DecodeState,
    logits: &[f32],
    mask: Option<Result<Mask, String>>,
) -> Result<u32, String> {
    match (&mut state.constraint, mask) {
        (Constrained::Free, None) => Ok(state.sampler.sample(logits)),
        (Constrained::Active(grammar), Some(Ok(mask))) => {
            let mut masked = logits.to_vec();
            mask.apply(&mut masked);
            let token = state.sampler.sample(&masked);
            grammar.accept(token)?;
            Ok(token)
        }
        (_, Some(Err(error))) => Err(error),
        // A grammar still out, or a mask without one: never sample unconstrained.
        _ => Err("the request's grammar and this step's mask do not match".to_string()),
    }
}
