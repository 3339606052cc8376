//! `--timing-audit` (TEST-MATRIX I07, after Gu et al., arXiv 2502.07776): can a tenant tell
//! from its time to first token whether another tenant has a prefix cached?
//!
//! Tenant A sends a prefix P so it is cached. Then, for each of N rounds, four streamed
//! requests in a random order, timed to their first token: B sends P + a suffix, and a fresh
//! prefix of the same length + a suffix (the cross-tenant pair); A sends the same two (the
//! control). B's requests each carry a cache_salt never used before, so B's own cache helps
//! neither sample; A's carry one salt of the run, so A's repeats of P hit. The two-sample KS
//! test must find B's samples indistinguishable and A's different, which shows the cache
//! works and the audit could have seen a difference. One request at a time: queueing would
//! drown the signal.

use crate::plan::json_bytes;
use crate::plan::Setup;
use crate::random_seed;
use crate::send::clip;
use crate::send::send_timed;
use crate::send::Timed;
use crate::write_json;
use crate::PROMPT_OVERHEAD_TOKENS;
use crate::WORDS;
use anyhow::bail;
use anyhow::Result;
use stats::KsTest;
use stats::SplitMix64;
use std::path::Path;

/// The audit's two numbers, from the flags.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TimingOptions {
    pub(crate) prefix_tokens: usize,
    pub(crate) samples: usize,
}

/// Words after the prefix: enough that no request is the prefix alone, few enough that the
/// prefix is nearly all of the prompt.
pub(crate) const SUFFIX_WORDS: usize = 8;
/// The cross-tenant pair must not differ at this level...
pub(crate) const CROSS_P_MIN: f64 = 0.01;
/// ...and the control must, at this one (the matrix's thresholds).
pub(crate) const CONTROL_P_MAX: f64 = 1e-6;
/// Failed requests shown in the report.
pub(crate) const FAILURES_SHOWN: usize = 8;

/// An upper estimate of one request's prompt tokens.
pub(crate) fn prompt_tokens(timing: TimingOptions) -> usize {
    timing.prefix_tokens + SUFFIX_WORDS + PROMPT_OVERHEAD_TOKENS
}

/// The four samples: who sends, and whether the prompt opens with P.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    CrossShared,
    CrossFresh,
    OwnShared,
    OwnFresh,
}

impl Kind {
    pub(crate) const ALL: [Kind; 4] = [
        Kind::CrossShared,
        Kind::CrossFresh,
        Kind::OwnShared,
        Kind::OwnFresh,
    ];

    /// Tenant A is the first, B the second.
    pub(crate) fn tenant(self) -> usize {
        match self {
            Kind::CrossShared | Kind::CrossFresh => 1,
            Kind::OwnShared | Kind::OwnFresh => 0,
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Kind::CrossShared => "B: A's prefix P + suffix",
            Kind::CrossFresh => "B: fresh prefix + suffix",
            Kind::OwnShared => "A: its prefix P + suffix (control)",
            Kind::OwnFresh => "A: fresh prefix + suffix (control)",
        }
    }

    pub(crate) fn key(self) -> &'static str {
        match self {
            Kind::CrossShared => "cross_shared",
            Kind::CrossFresh => "cross_fresh",
            Kind::OwnShared => "own_shared",
            Kind::OwnFresh => "own_fresh",
        }
    }
}

/// What the rounds measured, per kind.
#[derive(Default)]
pub(crate) struct Measured {
    pub(crate) seconds: [Vec<f64>; 4],
    pub(crate) cached_tokens: [Vec<u64>; 4],
    pub(crate) failures: Vec<String>,
    pub(crate) failures_seen: usize,
}

impl Measured {
    pub(crate) fn test(&self, shared: Kind, fresh: Kind) -> KsTest {
        stats::ks_two_sample(
            &self.seconds[shared as usize],
            &self.seconds[fresh as usize],
        )
    }

    /// B's answers that said they reused cached tokens: its salts were fresh, so any reuse
    /// came from another tenant.
    pub(crate) fn cross_hits(&self) -> usize {
        [Kind::CrossShared, Kind::CrossFresh]
            .iter()
            .map(|&kind| {
                self.cached_tokens[kind as usize]
                    .iter()
                    .filter(|&&n| n > 0)
                    .count()
            })
            .sum()
    }

    /// One answer: its first token's time and cached tokens, or why there was none.
    pub(crate) fn record(&mut self, kind: Kind, timed: &Timed) {
        match (timed.status == Ok(200), timed.first_token) {
            (true, Some(seconds)) => {
                self.seconds[kind as usize].push(seconds);
                let cached = timed.cached_tokens.unwrap_or(0);
                self.cached_tokens[kind as usize].push(cached);
            }
            _ => {
                self.failures_seen += 1;
                if self.failures.len() < FAILURES_SHOWN {
                    self.failures.push(describe(timed));
                }
            }
        }
    }

    pub(crate) fn verdict(&self) -> std::result::Result<(), String> {
        let cross = self.test(Kind::CrossShared, Kind::CrossFresh);
        let control = self.test(Kind::OwnShared, Kind::OwnFresh);
        let mut problems = Vec::new();
        if self.cross_hits() > 0 {
            problems.push(format!(
                "{} of B's answers reused cached tokens",
                self.cross_hits()
            ));
        }
        if cross.p_value.is_nan() || cross.p_value <= CROSS_P_MIN {
            problems.push(format!(
                "B's TTFT tells whether A cached the prefix (KS p = {:.3e}, must be > \
                 {CROSS_P_MIN})",
                cross.p_value
            ));
        }
        if control.p_value.is_nan() || control.p_value >= CONTROL_P_MAX {
            problems.push(format!(
                "the control shows no cache effect (KS p = {:.3e}, must be < {CONTROL_P_MAX:e}): \
                 the audit has no power",
                control.p_value
            ));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }
}

/// Runs the audit, prints the report (and writes it as JSON), and fails unless both tests
/// pass.
pub(crate) fn run(
    setup: &Setup,
    timing: TimingOptions,
    runtime: &tokio::runtime::Runtime,
    json: Option<&Path>,
) -> Result<()> {
    let started = std::time::Instant::now();
    let measured = runtime.block_on(measure(setup, timing))?;
    let wall = started.elapsed().as_secs_f64();
    print(setup, timing, &measured, wall);
    if let Some(path) = json {
        write_json(path, &report_json(setup, timing, &measured, wall))?;
    }
    let shortest = measured.seconds.iter().map(Vec::len).min().unwrap_or(0);
    if shortest < 2 {
        bail!("canary timing audit: INCONCLUSIVE: too few requests answered");
    }
    match measured.verdict() {
        Ok(()) => Ok(()),
        Err(problems) => bail!("canary timing audit: FAILED: {problems}"),
    }
}

/// `words` random common words, one token each.
pub(crate) fn words(rng: &mut SplitMix64, words: usize) -> String {
    let mut text = String::with_capacity(words * 8);
    for _ in 0..words {
        text.push(' ');
        text.push_str(WORDS[rng.below(WORDS.len())]);
    }
    text
}

/// The rounds. Prompts and salts come from a nonce fresh for each run (mixed with the seed),
/// so nothing an earlier run cached on the same server can answer them.
pub(crate) async fn measure(setup: &Setup, timing: TimingOptions) -> Result<Measured> {
    let nonce = random_seed();
    let mut rng = SplitMix64::new(setup.options.seed ^ nonce.rotate_left(32));
    let shared = words(&mut rng, timing.prefix_tokens);
    let own_salt = format!("canary-timing-{nonce}-a");
    let body = |prompt: String, salt: &str| {
        json_bytes(&serde_json::json!({
            "model": setup.model,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
            "cache_salt": salt,
        }))
    };
    let warm = send_timed(setup, 0, body(shared.clone(), &own_salt)).await;
    if warm.status != Ok(200) {
        bail!(
            "tenant A's first request, caching P, failed: {}",
            describe(&warm)
        );
    }
    // B's first request opens its connection: not measured, so neither sample pays for it.
    let fresh = words(&mut rng, timing.prefix_tokens);
    let warm = send_timed(setup, 1, body(fresh, &format!("canary-timing-{nonce}-b"))).await;
    if warm.status != Ok(200) {
        bail!("tenant B's first request failed: {}", describe(&warm));
    }
    let mut measured = Measured::default();
    for round in 0..timing.samples {
        let mut order = Kind::ALL;
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i + 1));
        }
        for kind in order {
            let prefix = match kind {
                Kind::CrossShared | Kind::OwnShared => shared.clone(),
                Kind::CrossFresh | Kind::OwnFresh => words(&mut rng, timing.prefix_tokens),
            };
            let prompt = prefix + &words(&mut rng, SUFFIX_WORDS);
            let salt = match kind.tenant() {
                0 => own_salt.clone(),
                _ => format!("canary-timing-{nonce}-b{round}-{}", kind.key()),
            };
            let timed = send_timed(setup, kind.tenant(), body(prompt, &salt)).await;
            measured.record(kind, &timed);
        }
        if (round + 1) % 10 == 0 {
            eprintln!(
                "canary: timing audit, {}/{} rounds",
                round + 1,
                timing.samples
            );
        }
    }
    Ok(measured)
}

fn describe(timed: &Timed) -> String {
    match &timed.status {
        Err(error) => clip(error, 200),
        Ok(status) => format!("HTTP {status}, no first token: {}", clip(&timed.body, 160)),
    }
}

pub(crate) fn median_ms(values: &[f64]) -> f64 {
    stats::median(values) * 1e3
}

fn print(setup: &Setup, timing: TimingOptions, measured: &Measured, wall: f64) {
    println!(
        "\n== airlock canary timing audit (TEST-MATRIX I07)\n{} model {}, tenant A {}, tenant \
         B {}, seed {}",
        setup.url, setup.model, setup.tenants[0].name, setup.tenants[1].name, setup.options.seed
    );
    println!(
        "prefix P of {} tokens, suffix {SUFFIX_WORDS} words, max_tokens 1, {} rounds, one \
         request at a time, {wall:.1} s\n",
        timing.prefix_tokens, timing.samples
    );
    println!(
        "{:<36} {:>8} {:>14} {:>19}",
        "sample", "answers", "median TTFT", "median cached tok"
    );
    for kind in Kind::ALL {
        let cached: Vec<f64> = measured.cached_tokens[kind as usize]
            .iter()
            .map(|&n| n as f64)
            .collect();
        println!(
            "{:<36} {:>8} {:>11.1} ms {:>19}",
            kind.label(),
            measured.seconds[kind as usize].len(),
            median_ms(&measured.seconds[kind as usize]),
            stats::median(&cached)
        );
    }
    let cross = measured.test(Kind::CrossShared, Kind::CrossFresh);
    let control = measured.test(Kind::OwnShared, Kind::OwnFresh);
    println!(
        "\ncross-tenant (B): KS D = {:.3}, p = {:.3e} (must be > {CROSS_P_MIN}: indistinguishable)",
        cross.statistic, cross.p_value
    );
    println!(
        "control (A):      KS D = {:.3}, p = {:.3e} (must be < {CONTROL_P_MAX:e}: the cache \
         works, the audit has power)",
        control.statistic, control.p_value
    );
    println!(
        "B's answers reporting cached tokens: {}",
        measured.cross_hits()
    );
    if measured.failures_seen > 0 {
        println!("failed requests ({}):", measured.failures_seen);
        for line in &measured.failures {
            println!("  {line}");
        }
    }
    match measured.verdict() {
        Ok(()) => println!("verdict: clean (seed {})", setup.options.seed),
        Err(problems) => println!("verdict: FAILED: {problems}"),
    }
}

fn report_json(
    setup: &Setup,
    timing: TimingOptions,
    measured: &Measured,
    wall: f64,
) -> serde_json::Value {
    let samples: serde_json::Map<String, serde_json::Value> = Kind::ALL
        .iter()
        .map(|&kind| {
            let value = serde_json::json!({
                "label": kind.label(),
                "answers": measured.seconds[kind as usize].len(),
                "median_ttft_ms": median_ms(&measured.seconds[kind as usize]),
                "ttft_ms": measured.seconds[kind as usize]
                    .iter()
                    .map(|s| s * 1e3)
                    .collect::<Vec<_>>(),
                "cached_tokens": measured.cached_tokens[kind as usize],
            });
            (kind.key().to_string(), value)
        })
        .collect();
    let test = |test: KsTest| serde_json::json!({"d": test.statistic, "p": test.p_value});
    serde_json::json!({
        "mode": "timing_audit",
        "clean": measured.verdict().is_ok(),
        "problems": measured.verdict().err(),
        "seed": setup.options.seed,
        "url": setup.url,
        "model": setup.model,
        "prefix_tokens": timing.prefix_tokens,
        "rounds": timing.samples,
        "seconds": wall,
        "samples": samples,
        "cross_tenant": test(measured.test(Kind::CrossShared, Kind::CrossFresh)),
        "control": test(measured.test(Kind::OwnShared, Kind::OwnFresh)),
        "cross_tenant_hits": measured.cross_hits(),
        "failures_seen": measured.failures_seen,
        "failures": measured.failures,
    })
}
