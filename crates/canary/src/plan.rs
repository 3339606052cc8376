//! What each request of a run is (class, endpoint, tenant, marker, body), from the seed and
//! its index alone, and the registry of every marker issued.

use crate::shared::SharedPrefix;
use crate::tenants::Tenant;
use crate::Options;
use crate::BASE32;
use crate::CODE_LEN;
use crate::LONG_FILL;
use crate::MARKER_EVERY;
use crate::MARKER_TOKENS;
use crate::PROMPT_OVERHEAD_TOKENS;
use crate::WORDS;
use stats::SplitMix64;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::MutexGuard;
use std::sync::PoisonError;

/// Everything a request needs, shared read-only by the lanes.
pub(crate) struct Setup {
    pub(crate) url: String,
    pub(crate) model: String,
    pub(crate) tenants: Vec<Tenant>,
    pub(crate) context_length: usize,
    pub(crate) context_source: &'static str,
    pub(crate) options: Options,
    pub(crate) client: reqwest::Client,
    /// Shared-system-prompt mode's prompt, when on.
    pub(crate) shared: Option<SharedPrefix>,
}

impl Setup {
    pub(crate) fn describe(&self) -> String {
        let keys = self
            .tenants
            .iter()
            .filter_map(|t| t.key.as_deref())
            .collect::<std::collections::HashSet<_>>()
            .len();
        let how = match keys {
            0 => "no key, told apart by `user`".to_string(),
            1 => "one key, told apart by `user`".to_string(),
            n => format!("{n} keys"),
        };
        let bound = match (self.options.requests, self.options.duration) {
            (Some(n), Some(d)) => format!("{n} requests or {:.0} s", d.as_secs_f64()),
            (Some(n), None) => format!("{n} requests"),
            (None, Some(d)) => format!("{:.0} s", d.as_secs_f64()),
            (None, None) => "unbounded".to_string(),
        };
        let shared = self.shared.as_ref().map_or(String::new(), |shared| {
            format!(
                ", a shared system prompt of about {} tokens (session {}), a fresh cache_salt \
                 on {:.0}% of requests",
                shared.tokens,
                shared.nonce,
                shared.fresh_salt * 100.0
            )
        });
        format!(
            "seed {} (repeat with --seed {}), {} tenants ({how}), {} model {}, context {} ({}), \
             {bound}, concurrency {}, max_tokens {}{shared}",
            self.options.seed,
            self.options.seed,
            self.tenants.len(),
            self.url,
            self.model,
            self.context_length,
            self.context_source,
            self.options.concurrency,
            self.options.max_tokens,
        )
    }

    /// The class of request `index`: a golden-ratio sequence, so every stretch of the run
    /// holds each class in its fraction (a short run still gets its oversized and invalid
    /// requests), with the seed choosing where the sequence starts.
    pub(crate) fn class_of(&self, index: usize) -> Class {
        const GOLDEN: f64 = 0.618_033_988_749_894_9;
        if index < self.probes() {
            return Class::Short;
        }
        let offset = SplitMix64::new(self.options.seed).unit();
        let u = (offset + GOLDEN * (index as f64 + 1.0)).fract();
        let o = &self.options;
        if u < o.oversized {
            Class::Oversized
        } else if u < o.oversized + o.invalid {
            Class::Invalid
        } else if u < o.oversized + o.invalid + o.long {
            Class::Long
        } else {
            Class::Short
        }
    }

    /// Requests sent one at a time before the rest: in shared-system-prompt mode, each
    /// tenant's first, so each is answered before its tenant sends again and can judge reuse.
    pub(crate) fn probes(&self) -> usize {
        match (&self.shared, self.options.requests) {
            (None, _) => 0,
            (Some(_), Some(limit)) => self.tenants.len().min(limit),
            (Some(_), None) => self.tenants.len(),
        }
    }
}

/// `len` random base32 characters.
pub(crate) fn code(rng: &mut SplitMix64, len: usize) -> String {
    (0..len)
        .map(|_| BASE32[rng.below(BASE32.len())] as char)
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    Short,
    Long,
    Oversized,
    Invalid,
}

impl Class {
    pub(crate) const ALL: [Class; 4] =
        [Class::Short, Class::Long, Class::Oversized, Class::Invalid];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Class::Short => "short",
            Class::Long => "long",
            Class::Oversized => "oversized",
            Class::Invalid => "invalid",
        }
    }

    /// Requests the server must refuse with a 4xx.
    pub(crate) fn should_fail(self) -> bool {
        matches!(self, Class::Oversized | Class::Invalid)
    }

    pub(crate) fn slot(self) -> usize {
        self as usize
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    pub(crate) fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// One request, decided before it is sent: its marker is registered first, so any answer
/// can be traced back to it.
pub(crate) struct Plan {
    pub(crate) index: usize,
    pub(crate) tenant: usize,
    pub(crate) class: Class,
    /// What makes it that class ("max_tokens -1", "prompt past the context", ...).
    pub(crate) detail: &'static str,
    pub(crate) endpoint: Endpoint,
    pub(crate) stream: bool,
    pub(crate) body: Vec<u8>,
    /// Sent again once answered; both answers must agree.
    pub(crate) twin: bool,
    /// A cache_salt never used before (shared-system-prompt mode).
    pub(crate) salt: Option<String>,
}

impl Plan {
    pub(crate) fn id(&self) -> String {
        request_id(self.index)
    }

    /// "short prompt, /v1/completions stream": what the request was, for the report.
    pub(crate) fn describe(&self) -> String {
        let stream = if self.stream { " stream" } else { "" };
        format!(
            "{} {}, {}{stream}",
            self.class.name(),
            self.detail,
            self.endpoint.path()
        )
    }
}

pub(crate) fn request_id(index: usize) -> String {
    format!("r{:04}", index + 1)
}

/// Every marker issued, by its random part: (tenant, request index).
#[derive(Default)]
pub(crate) struct Registry {
    pub(crate) issued: Mutex<HashMap<String, (usize, usize)>>,
}

impl Registry {
    /// A fresh code for `index`, registered before anything is sent. A (40-bit) collision
    /// with an earlier one is drawn again, so no marker names two requests.
    pub(crate) fn issue(&self, rng: &mut SplitMix64, tenant: usize, index: usize) -> String {
        let mut issued = lock(&self.issued);
        loop {
            let code = code(rng, CODE_LEN);
            if let std::collections::hash_map::Entry::Vacant(slot) = issued.entry(code.clone()) {
                slot.insert((tenant, index));
                return code;
            }
        }
    }

    /// The issued markers in `text`: every 8-character window of every run of base32
    /// characters, so a marker is found whole, without its `CANARY-n-` prefix, or glued to
    /// other capitals.
    pub(crate) fn find(&self, text: &str) -> Vec<(String, usize, usize)> {
        let issued = lock(&self.issued);
        let bytes = text.as_bytes();
        let mut found: Vec<(String, usize, usize)> = Vec::new();
        let mut start = 0;
        while start < bytes.len() {
            let run = bytes[start..]
                .iter()
                .take_while(|b| BASE32.contains(b))
                .count();
            if run >= CODE_LEN {
                for window in bytes[start..start + run].windows(CODE_LEN) {
                    // Base32 bytes are ASCII: the window is valid UTF-8.
                    let code = String::from_utf8_lossy(window);
                    if let Some(&(tenant, index)) = issued.get(code.as_ref()) {
                        if !found.iter().any(|(c, _, _)| c == code.as_ref()) {
                            found.push((code.into_owned(), tenant, index));
                        }
                    }
                }
            }
            start += run.max(1);
        }
        found
    }
}

/// A poisoned lock only means a lane panicked; the tallies are still worth reporting.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Request `index`: its tenant (round-robin), class, endpoint, streaming, marker and body.
pub(crate) fn plan(setup: &Setup, index: usize, registry: &Registry) -> Plan {
    let mut rng = SplitMix64::for_stream(setup.options.seed, index as u64);
    let tenant = index % setup.tenants.len();
    let class = setup.class_of(index);
    let endpoint = if rng.below(2) == 0 {
        Endpoint::Completions
    } else {
        Endpoint::Chat
    };
    let stream = rng.below(2) == 0;
    // From a stream of its own, so a seed's requests are the same in every mode.
    let salted = setup.shared.as_ref().filter(|shared| {
        index >= setup.probes()
            && SplitMix64::for_stream(!setup.options.seed, index as u64).unit() < shared.fresh_salt
    });
    let salt = salted.map(|shared| shared.salt(index));
    let marker = format!(
        "CANARY-{tenant}-{}",
        registry.issue(&mut rng, tenant, index)
    );
    let request = Request {
        setup,
        tenant,
        endpoint,
        stream,
        salt: salt.as_deref(),
    };
    let max_tokens = setup.options.max_tokens as i64;
    let (low, high) = setup.options.words;
    let short_words = low + rng.below(high - low + 1);
    let (detail, body) = match class {
        Class::Short => {
            let prompt = canary_prompt(&mut rng, &marker, short_words);
            ("prompt", json_bytes(&request.body(&prompt, max_tokens)))
        }
        Class::Long => {
            let prompt = canary_prompt(&mut rng, &marker, long_words(setup));
            let body = request.body(&prompt, max_tokens);
            ("prompt near the context length", json_bytes(&body))
        }
        Class::Oversized => oversized(&request, &mut rng, &marker, short_words),
        Class::Invalid => invalid(&request, &mut rng, &marker, short_words),
    };
    // Drawn last, so a seed's requests are the same with or without twins.
    let twin = !class.should_fail() && rng.unit() < setup.options.twins;
    Plan {
        index,
        tenant,
        class,
        detail,
        endpoint,
        stream,
        body,
        twin,
        salt,
    }
}

pub(crate) fn json_bytes(value: &serde_json::Value) -> Vec<u8> {
    value.to_string().into_bytes()
}

/// What every body of one request shares.
pub(crate) struct Request<'a> {
    pub(crate) setup: &'a Setup,
    pub(crate) tenant: usize,
    pub(crate) endpoint: Endpoint,
    pub(crate) stream: bool,
    pub(crate) salt: Option<&'a str>,
}

impl Request<'_> {
    /// A well-formed body: greedy, so a run repeats, and `user` naming the tenant, which is
    /// all that tells tenants apart when they share a key. In shared-system-prompt mode the
    /// prompt follows the shared one (a system message in chat), streams ask for the usage
    /// (it carries cached_tokens), and a salted request carries its salt.
    pub(crate) fn body(&self, prompt: &str, max_tokens: i64) -> serde_json::Value {
        let mut body = serde_json::json!({
            "model": self.setup.model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": self.stream,
            "user": self.setup.tenants[self.tenant].name,
        });
        let shared = self
            .setup
            .shared
            .as_ref()
            .map(|shared| shared.text.as_str());
        match (self.endpoint, shared) {
            (Endpoint::Completions, None) => body["prompt"] = prompt.into(),
            (Endpoint::Completions, Some(shared)) => {
                body["prompt"] = format!("{shared}\n{prompt}").into()
            }
            (Endpoint::Chat, None) => {
                body["messages"] = serde_json::json!([{"role": "user", "content": prompt}]);
            }
            (Endpoint::Chat, Some(shared)) => {
                body["messages"] = serde_json::json!([
                    {"role": "system", "content": shared},
                    {"role": "user", "content": prompt},
                ]);
            }
        }
        if shared.is_some() && self.stream {
            body["stream_options"] = serde_json::json!({"include_usage": true});
        }
        if let Some(salt) = self.salt {
            body["cache_salt"] = salt.into();
        }
        body
    }
}

/// A request past the context length: a prompt longer than it (every filler word is at least
/// one token), or a short prompt asking for more new tokens than it holds.
pub(crate) fn oversized(
    request: &Request,
    rng: &mut SplitMix64,
    marker: &str,
    short_words: usize,
) -> (&'static str, Vec<u8>) {
    let context = request.setup.context_length;
    if rng.below(2) == 0 {
        let prompt = canary_prompt(rng, marker, context + 64);
        let max_tokens = request.setup.options.max_tokens as i64;
        let body = request.body(&prompt, max_tokens);
        ("prompt past the context length", json_bytes(&body))
    } else {
        let prompt = canary_prompt(rng, marker, short_words);
        let body = request.body(&prompt, context as i64 + 1);
        ("max_tokens past the context length", json_bytes(&body))
    }
}

/// A request no server should run: each still carries the marker, so an error message that
/// quotes another request's body is caught too.
pub(crate) fn invalid(
    request: &Request,
    rng: &mut SplitMix64,
    marker: &str,
    short_words: usize,
) -> (&'static str, Vec<u8>) {
    let prompt = canary_prompt(rng, marker, short_words);
    let max_tokens = request.setup.options.max_tokens as i64;
    let mut body = request.body(&prompt, max_tokens);
    match rng.below(4) {
        0 => {
            body["max_tokens"] = (-1).into();
            ("max_tokens -1", json_bytes(&body))
        }
        1 => {
            // The body cut in half (all ASCII but the prompt, which is ASCII too).
            let mut bytes = json_bytes(&body);
            bytes.truncate(bytes.len() / 2);
            ("malformed JSON", bytes)
        }
        2 => {
            body["model"] = "canary-no-such-model".into();
            ("unknown model", json_bytes(&body))
        }
        _ => {
            match request.endpoint {
                Endpoint::Completions => body["prompt"] = serde_json::json!({"text": prompt}),
                Endpoint::Chat => body["messages"] = prompt.into(),
            }
            ("prompt of the wrong type", json_bytes(&body))
        }
    }
}

/// The filler words of a long prompt: as many as fit in LONG_FILL of the context (less
/// max_tokens and any shared system prompt) by the token estimate, and at least a short
/// prompt's.
pub(crate) fn long_words(setup: &Setup) -> usize {
    let shared = setup.shared.as_ref().map_or(0, |shared| shared.tokens);
    let budget = setup
        .context_length
        .saturating_sub(setup.options.max_tokens + shared);
    let target = (budget as f64 * LONG_FILL) as usize;
    let mut words = target;
    while words > setup.options.words.0 && estimated_tokens(words) > target {
        words -= (estimated_tokens(words) - target).div_ceil(2).max(1);
    }
    words.max(setup.options.words.0)
}

/// An upper estimate of a canary prompt's tokens with `words` filler words.
pub(crate) fn estimated_tokens(words: usize) -> usize {
    PROMPT_OVERHEAD_TOKENS + words + markers_in(words) * MARKER_TOKENS
}

pub(crate) fn markers_in(words: usize) -> usize {
    2 + words.saturating_sub(1) / MARKER_EVERY
}

/// The marker at the start, every MARKER_EVERY words and at the end, then the instruction
/// to repeat it all: a model that reads this prompt's KV (its own, or wrongly another
/// request's) is likely to say the marker.
pub(crate) fn canary_prompt(rng: &mut SplitMix64, marker: &str, words: usize) -> String {
    let mut text = String::with_capacity(words * 8 + markers_in(words) * (marker.len() + 1));
    text.push_str("Secret note: ");
    text.push_str(marker);
    for i in 0..words {
        if i > 0 && i % MARKER_EVERY == 0 {
            text.push(' ');
            text.push_str(marker);
        }
        text.push(' ');
        text.push_str(WORDS[rng.below(WORDS.len())]);
    }
    text.push(' ');
    text.push_str(marker);
    text.push_str(".\nRepeat the secret note above exactly, with its code, twice:\n");
    text
}
