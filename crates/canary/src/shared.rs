//! Shared-system-prompt mode: every tenant's prompts open with one long system prompt, so a
//! prefix cache holds the same tokens for every tenant, and the run counts the answers whose
//! `usage.prompt_tokens_details.cached_tokens` says they reused a prefix that their own tenant
//! cannot have cached: cross-tenant hits (TEST-MATRIX I04 under load).
//!
//! Which answers can judge that is decided from what was sent, never from timing: a request
//! is checked when it is the first of its (tenant, partition) and no other request of that
//! pair was sent before it was answered. Two kinds qualify: each tenant's first request (the
//! run sends those one at a time before any other) and requests with a fresh `cache_salt`,
//! a partition nobody used before. A hit on either came from somewhere else.

use crate::send::Outcome;
use crate::WORDS;
use stats::SplitMix64;
use std::collections::HashMap;

/// An upper estimate of the tokens of the shared prompt's opening sentence.
pub(crate) const HEADER_TOKENS: usize = 32;
/// Words per sentence of the shared prompt; each sentence ends in one more token, a period.
pub(crate) const SENTENCE_WORDS: usize = 12;
/// Cross-tenant hits shown in the report (all are in --json).
pub(crate) const HITS_SHOWN: usize = 20;

/// The run's shared system prompt and how often a request gets a fresh salt.
pub(crate) struct SharedPrefix {
    pub(crate) text: String,
    /// An upper estimate of its length in tokens (common words, one token each).
    pub(crate) tokens: usize,
    /// Fresh for every run (not from --seed), and in the prompt's first words and in every
    /// salt: no cache from an earlier run, of a server audited again, can answer a check.
    pub(crate) nonce: u64,
    pub(crate) fresh_salt: f64,
}

impl SharedPrefix {
    pub(crate) fn new(tokens: usize, nonce: u64, fresh_salt: f64) -> SharedPrefix {
        let mut rng = SplitMix64::new(nonce);
        let mut text = format!(
            "Session {nonce}. You are the assistant of a shared service; every user's \
             conversation starts with these house notes:"
        );
        let words = tokens.saturating_sub(HEADER_TOKENS) * SENTENCE_WORDS / (SENTENCE_WORDS + 1);
        for i in 0..words {
            text.push_str(if i > 0 && i % SENTENCE_WORDS == 0 {
                ". "
            } else {
                " "
            });
            text.push_str(WORDS[rng.below(WORDS.len())]);
        }
        text.push_str(".\n");
        SharedPrefix {
            text,
            tokens: HEADER_TOKENS + words + words.div_ceil(SENTENCE_WORDS) + 1,
            nonce,
            fresh_salt,
        }
    }

    /// A salt never used before: the run's nonce and the request's index.
    pub(crate) fn salt(&self, index: usize) -> String {
        format!("canary-{}-{index}", self.nonce)
    }
}

/// A request's partition in its tenant: the default one, or a salt's.
pub(crate) type PartitionKey = (usize, Option<String>);

/// Requests begun per (tenant, partition), to tell which answers can judge reuse.
#[derive(Default)]
pub(crate) struct Partitions {
    begun: HashMap<PartitionKey, usize>,
}

/// One request's claim on its partition, from `begin` to `end`.
pub(crate) struct Ticket {
    key: PartitionKey,
    first: bool,
}

impl Partitions {
    /// Call before the request is sent.
    pub(crate) fn begin(&mut self, tenant: usize, salt: Option<&str>) -> Ticket {
        let key = (tenant, salt.map(str::to_string));
        let begun = self.begun.entry(key.clone()).or_default();
        *begun += 1;
        Ticket {
            key,
            first: *begun == 1,
        }
    }

    /// Call once answered: whether the answer can judge cross-tenant reuse. Only the first
    /// request of its partition, and only when no other request of that partition began
    /// while it was in flight (that one could have cached the prefix first).
    pub(crate) fn end(&self, ticket: Ticket) -> bool {
        ticket.first && self.begun.get(&ticket.key) == Some(&1)
    }
}

/// An answer that reused a prefix its tenant had not cached.
#[derive(Clone, Debug)]
pub(crate) struct CrossHit {
    pub(crate) request: usize,
    pub(crate) tenant: usize,
    pub(crate) what: String,
    pub(crate) cached_tokens: u64,
    pub(crate) salted: bool,
    pub(crate) server_id: Option<String>,
}

/// What the mode found.
#[derive(Default)]
pub(crate) struct PrefixAudit {
    pub(crate) partitions: Partitions,
    /// Answers that judged reuse: tenants' first requests, and fresh-salt ones.
    pub(crate) checked_first: usize,
    pub(crate) checked_salted: usize,
    pub(crate) cross_hits: Vec<CrossHit>,
    /// Answers in a partition their tenant had used: reuse is allowed, and expected.
    pub(crate) reusable: usize,
    pub(crate) own_hits: usize,
    pub(crate) own_cached_tokens: u64,
    /// 2xx answers without `cached_tokens`: nothing to judge.
    pub(crate) unreported: usize,
}

/// One answered request, as this mode sees it.
pub(crate) struct Answered<'a> {
    pub(crate) request: usize,
    pub(crate) tenant: usize,
    pub(crate) what: String,
    pub(crate) salted: bool,
    pub(crate) outcome: &'a Outcome,
}

impl PrefixAudit {
    pub(crate) fn checked(&self) -> usize {
        self.checked_first + self.checked_salted
    }

    /// Records a 2xx answer to a request that should succeed; `checked` is what `end` said.
    pub(crate) fn record(&mut self, answered: Answered, checked: bool) {
        let Some(cached_tokens) = answered.outcome.cached_tokens else {
            self.unreported += 1;
            return;
        };
        if !checked {
            self.reusable += 1;
            self.own_hits += usize::from(cached_tokens > 0);
            self.own_cached_tokens += cached_tokens;
            return;
        }
        if answered.salted {
            self.checked_salted += 1;
        } else {
            self.checked_first += 1;
        }
        if cached_tokens > 0 {
            self.cross_hits.push(CrossHit {
                request: answered.request,
                tenant: answered.tenant,
                what: answered.what,
                cached_tokens,
                salted: answered.salted,
                server_id: answered.outcome.server_id.clone(),
            });
        }
    }
}
