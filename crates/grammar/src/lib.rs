//! Structured output: a JSON schema (or "any JSON object") compiled with llguidance into a
//! [`Constraint`] that says, before each sampling step, which tokens keep the answer a prefix
//! of some document the schema accepts, and is told each token chosen. Only the served
//! model's vocabulary ([`Vocabulary`], built once from its tokenizer) is involved; the
//! router compiles a request's schema once to refuse a bad one with 400, the worker compiles
//! it again for the request's decode.

use gguf::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use std::sync::Arc;
use toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};

/// What a request's answer must be.
#[derive(Clone, Debug, PartialEq)]
pub enum Shape {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A document this JSON schema accepts (`{"type": "json_schema"}`).
    JsonSchema(Value),
}

impl Shape {
    /// The schema llguidance compiles. Unless the schema says otherwise (its own
    /// `x-guidance`), the JSON is written on one line with OpenAI's separators: free
    /// whitespace lets a small model pad its answer with blank lines until `max_tokens`.
    fn schema(&self) -> Value {
        let mut schema = match self {
            Shape::JsonObject => serde_json::json!({"type": "object"}),
            Shape::JsonSchema(schema) => schema.clone(),
        };
        if let Some(object) = schema.as_object_mut() {
            object.entry("x-guidance").or_insert_with(|| {
                serde_json::json!({
                    "whitespace_flexible": false,
                    "item_separator": ", ",
                    "key_separator": ": ",
                })
            });
        }
        schema
    }

    /// The text a `Submit` carries: the schema, or "" for any object.
    pub fn to_wire(&self) -> String {
        match self {
            Shape::JsonObject => String::new(),
            Shape::JsonSchema(schema) => schema.to_string(),
        }
    }

    /// [`Shape::to_wire`]'s inverse.
    pub fn from_wire(text: &str) -> Result<Shape, String> {
        if text.is_empty() {
            return Ok(Shape::JsonObject);
        }
        serde_json::from_str(text)
            .map(Shape::JsonSchema)
            .map_err(|error| format!("the schema is not JSON: {error}"))
    }
}

/// The served model's tokens as the grammar engine sees them; build once, share.
#[derive(Clone)]
pub struct Vocabulary {
    factory: Arc<ParserFactory>,
}

impl Vocabulary {
    pub fn new(tokenizer: &Tokenizer) -> Result<Vocabulary, String> {
        let vocab = tokenizer.vocab_size();
        let mut words = Vec::with_capacity(vocab);
        for id in 0..vocab as u32 {
            let bytes = tokenizer.token_bytes(id).to_vec();
            // Control tokens (end of sequence, chat markers) are special: a grammar can never
            // spell them with text. toktrie marks those with a leading 0xFF byte.
            let special = matches!(
                tokenizer.token_type(id),
                Some(gguf::TokenType::Control | gguf::TokenType::UserDefined)
            );
            words.push(if special {
                let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                marked.extend_from_slice(&bytes);
                marked
            } else {
                bytes
            });
        }
        let info = TokRxInfo::new(vocab as u32, tokenizer.eos_id());
        let env = ApproximateTokEnv::new(TokTrie::from(&info, &words));
        let mut factory = ParserFactory::new_simple(&(Arc::new(env) as toktrie::TokEnv))
            .map_err(|error| format!("grammar engine: {error}"))?;
        factory.quiet();
        Ok(Vocabulary {
            factory: Arc::new(factory),
        })
    }

    /// The constraint for one answer of `shape`, or why the shape cannot be compiled.
    pub fn constraint(&self, shape: &Shape) -> Result<Constraint, String> {
        let grammar = TopLevelGrammar::from_json_schema(shape.schema());
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|error| error.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(error);
        }
        Ok(Constraint { matcher })
    }
}

/// The tokens a grammar allows at one step.
pub struct Mask {
    allowed: toktrie::SimpleVob,
}

impl Mask {
    /// Sets the logit of every token not allowed to -infinity.
    pub fn apply(&self, logits: &mut [f32]) {
        for (id, logit) in logits.iter_mut().enumerate() {
            if !self.allowed.is_allowed(id as u32) {
                *logit = f32::NEG_INFINITY;
            }
        }
    }
}

/// One answer's grammar state.
pub struct Constraint {
    matcher: Matcher,
}

impl Constraint {
    /// The tokens the grammar allows next (the end-of-sequence token once the document is
    /// complete). It reads only the tokens accepted so far, so it can be computed while the
    /// model computes the logits it will be applied to.
    pub fn next_mask(&mut self) -> Result<Mask, String> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|error| error.to_string())?;
        if allowed.num_set() == 0 {
            return Err("the grammar allows no token".into());
        }
        Ok(Mask { allowed })
    }

    /// Takes the token chosen.
    pub fn accept(&mut self, token: u32) -> Result<(), String> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|error| error.to_string())
    }
}

#[cfg(test)]
mod tests;
