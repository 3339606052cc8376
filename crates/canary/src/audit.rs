//! The run: lanes sending requests and the findings they record.

use crate::plan::lock;
use crate::plan::plan;
use crate::plan::Class;
use crate::plan::Plan;
use crate::plan::Registry;
use crate::send::clip;
use crate::send::send;
use crate::send::Outcome;
use crate::shared::Answered;
use crate::shared::PrefixAudit;
use crate::shared::Ticket;
use crate::Setup;
use std::collections::BTreeMap;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::sync::PoisonError;
use std::time::Duration;
use std::time::Instant;

/// A marker of one request found in the answer to another.
#[derive(Clone, Debug)]
pub(crate) struct Finding {
    /// The answer's request.
    pub(crate) request: usize,
    pub(crate) tenant: usize,
    pub(crate) what: String,
    pub(crate) server_id: Option<String>,
    /// The marker found, and the request and tenant it was issued to.
    pub(crate) marker: String,
    pub(crate) victim: usize,
    pub(crate) victim_tenant: usize,
    /// The answer around the marker.
    pub(crate) context: String,
}

/// A should-fail request answered 2xx.
#[derive(Clone, Debug)]
pub(crate) struct WrongAnswer {
    pub(crate) request: usize,
    pub(crate) tenant: usize,
    pub(crate) what: String,
    pub(crate) status: u16,
    pub(crate) body: String,
}

/// A request sent twice (greedy) whose two answers differ.
#[derive(Clone, Debug)]
pub(crate) struct Inconsistent {
    pub(crate) request: usize,
    pub(crate) tenant: usize,
    pub(crate) what: String,
    pub(crate) first: String,
    pub(crate) second: String,
}

/// Requests of one class by how they ended.
#[derive(Default)]
pub(crate) struct Tally {
    pub(crate) sent: usize,
    pub(crate) statuses: BTreeMap<u16, usize>,
    pub(crate) transport: usize,
    pub(crate) prompt_tokens_max: Option<u64>,
}

impl Tally {
    pub(crate) fn count(&self, range: std::ops::Range<u16>) -> usize {
        self.statuses
            .iter()
            .filter(|(status, _)| range.contains(status))
            .map(|(_, n)| n)
            .sum()
    }

    pub(crate) fn other(&self) -> usize {
        self.sent - self.transport - self.count(200..300) - self.count(400..600)
    }
}

/// Everything the run found.
#[derive(Default)]
pub(crate) struct Audit {
    pub(crate) tallies: [Tally; 4],
    pub(crate) leaks: Vec<Finding>,
    /// A tenant's own marker from another of its requests: informational.
    pub(crate) echoes: Vec<Finding>,
    pub(crate) wrong: Vec<WrongAnswer>,
    /// Greedy twins answered differently.
    pub(crate) inconsistent: Vec<Inconsistent>,
    pub(crate) twins_compared: usize,
    /// Seconds of the should-succeed requests answered 2xx.
    pub(crate) latencies: Vec<f64>,
    /// A few 5xx and transport errors, to show what they were.
    pub(crate) failures: Vec<String>,
    pub(crate) failures_seen: usize,
    pub(crate) cut_short: usize,
    pub(crate) stream_errors: usize,
    /// Shared-system-prompt mode's reuse checks.
    pub(crate) prefix: PrefixAudit,
}

/// Failures and echoes shown in the report (all are counted, and all in --json).
pub(crate) const FAILURES_SHOWN: usize = 8;
/// Leaks and wrong 2xx shown in the report (all are in --json).
pub(crate) const LINES_SHOWN: usize = 20;

/// The line that says how many were not shown.
pub(crate) fn more(count: usize, shown: usize) {
    if count > shown {
        println!("  ... and {} more (all in --json FILE)", count - shown);
    }
}

impl Audit {
    pub(crate) fn record(
        &mut self,
        plan: &Plan,
        outcome: &Outcome,
        found: &[(String, usize, usize)],
    ) {
        let tally = &mut self.tallies[plan.class.slot()];
        tally.sent += 1;
        match &outcome.status {
            Ok(status) => *tally.statuses.entry(*status).or_default() += 1,
            Err(_) => tally.transport += 1,
        }
        let ok = matches!(outcome.status, Ok(200..=299));
        if ok && !plan.class.should_fail() {
            self.latencies.push(outcome.seconds);
            if let Some(tokens) = outcome.prompt_tokens {
                tally.prompt_tokens_max = tally.prompt_tokens_max.max(Some(tokens));
            }
        }
        self.cut_short += usize::from(outcome.cut_short.is_some());
        self.stream_errors += usize::from(ok && outcome.stream_error);
        if let (true, Ok(status)) = (plan.class.should_fail() && ok, &outcome.status) {
            self.wrong.push(WrongAnswer {
                request: plan.index,
                tenant: plan.tenant,
                what: plan.describe(),
                status: *status,
                body: clip(&outcome.body, 200),
            });
        }
        self.note_failure(plan, outcome);
        for (code, victim_tenant, victim) in found {
            if *victim == plan.index {
                continue;
            }
            let finding = Finding {
                request: plan.index,
                tenant: plan.tenant,
                what: plan.describe(),
                server_id: outcome.server_id.clone(),
                marker: format!("CANARY-{victim_tenant}-{code}"),
                victim: *victim,
                victim_tenant: *victim_tenant,
                context: around(&outcome.text, &outcome.body, code),
            };
            if *victim_tenant == plan.tenant {
                self.echoes.push(finding);
            } else {
                self.leaks.push(finding);
            }
        }
    }

    /// Ends a request's claim on its partition and, for a 2xx answer to a request that
    /// should succeed, records what it says of reuse.
    pub(crate) fn record_reuse(&mut self, plan: &Plan, outcome: &Outcome, ticket: Ticket) {
        let checked = self.prefix.partitions.end(ticket);
        if plan.class.should_fail() || !matches!(outcome.status, Ok(200..=299)) {
            return;
        }
        let answered = Answered {
            request: plan.index,
            tenant: plan.tenant,
            what: plan.describe(),
            salted: plan.salt.is_some(),
            outcome,
        };
        self.prefix.record(answered, checked);
    }

    /// Both twins answered 200: their texts must be equal.
    pub(crate) fn compare_twins(&mut self, plan: &Plan, first: &Outcome, second: &Outcome) {
        if second.status != Ok(200) || first.cut_short.is_some() || second.cut_short.is_some() {
            return;
        }
        self.twins_compared += 1;
        if first.text != second.text {
            self.inconsistent.push(Inconsistent {
                request: plan.index,
                tenant: plan.tenant,
                what: plan.describe(),
                first: clip(&first.text, 120),
                second: clip(&second.text, 120),
            });
        }
    }

    pub(crate) fn note_failure(&mut self, plan: &Plan, outcome: &Outcome) {
        let what = format!("{} ({})", plan.id(), plan.describe());
        let line = match &outcome.status {
            Err(error) => format!("{what}: {}", clip(error, 200)),
            Ok(status @ 500..=599) => format!("{what}: HTTP {status} {}", clip(&outcome.body, 160)),
            Ok(_) => match &outcome.cut_short {
                Some(why) => format!("{what}: body cut short ({})", clip(why, 160)),
                None => return,
            },
        };
        self.failures_seen += 1;
        if self.failures.len() < FAILURES_SHOWN {
            self.failures.push(line);
        }
    }

    pub(crate) fn sent(&self) -> usize {
        self.tallies.iter().map(|t| t.sent).sum()
    }

    pub(crate) fn total(&self, range: std::ops::Range<u16>) -> usize {
        self.tallies.iter().map(|t| t.count(range.clone())).sum()
    }

    pub(crate) fn transport(&self) -> usize {
        self.tallies.iter().map(|t| t.transport).sum()
    }

    pub(crate) fn should_fail(&self) -> impl Iterator<Item = &Tally> {
        Class::ALL
            .iter()
            .filter(|c| c.should_fail())
            .map(|c| &self.tallies[c.slot()])
    }

    pub(crate) fn should_succeed(&self) -> impl Iterator<Item = &Tally> {
        Class::ALL
            .iter()
            .filter(|c| !c.should_fail())
            .map(|c| &self.tallies[c.slot()])
    }

    pub(crate) fn progress(&self, limit: Option<usize>, left: Option<Duration>) -> String {
        let done = match (limit, left) {
            (Some(n), _) => format!("{}/{n} done", self.sent()),
            (None, Some(left)) => {
                format!("{} done ({:.0} s left)", self.sent(), left.as_secs_f64())
            }
            (None, None) => format!("{} done", self.sent()),
        };
        format!(
            "canary: {done}, 2xx {}, 4xx {}, 5xx {}, transport errors {}, leaks {}, \
             wrong 200s {}, cross-tenant cache hits {}",
            self.total(200..300),
            self.total(400..500),
            self.total(500..600),
            self.transport(),
            self.leaks.len(),
            self.wrong.len(),
            self.prefix.cross_hits.len()
        )
    }
}

/// Up to 60 characters either side of `code` in the answer's text (else its raw body).
pub(crate) fn around(text: &str, body: &str, code: &str) -> String {
    let haystack = if text.contains(code) { text } else { body };
    let Some(at) = haystack.find(code) else {
        return String::new();
    };
    let start = (0..=at.saturating_sub(60))
        .rev()
        .find(|&i| haystack.is_char_boundary(i))
        .unwrap_or(0);
    let end = ((at + code.len() + 60).min(haystack.len())..=haystack.len())
        .find(|&i| haystack.is_char_boundary(i))
        .unwrap_or(haystack.len());
    clip(&haystack[start..end], 200)
}

/// Runs the requests: first the probes one at a time (shared-system-prompt mode), then
/// `concurrency` lanes pulling the next index until the bound, with a progress line on
/// stderr every 2 s.
pub(crate) async fn audit(setup: &Setup) -> Audit {
    let probes = setup.probes();
    let next = AtomicUsize::new(probes);
    let registry = Registry::default();
    let audit = Mutex::new(Audit::default());
    let started = Instant::now();
    let deadline = setup.options.duration.map(|d| started + d);
    let limit = setup.options.requests;
    let past_deadline = || deadline.is_some_and(|d| Instant::now() >= d);
    let run = async {
        for index in 0..probes {
            if past_deadline() {
                return;
            }
            one(setup, index, &registry, &audit).await;
        }
        let lanes = (0..setup.options.concurrency).map(|_| async {
            loop {
                if past_deadline() {
                    return;
                }
                let index = next.fetch_add(1, Ordering::Relaxed);
                if limit.is_some_and(|n| index >= n) {
                    return;
                }
                one(setup, index, &registry, &audit).await;
            }
        });
        futures_util::future::join_all(lanes).await;
    };
    let progress = async {
        loop {
            tokio::time::sleep(Duration::from_secs(2)).await;
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            eprintln!("{}", lock(&audit).progress(limit, left));
        }
    };
    tokio::select! {
        _ = run => {}
        _ = progress => {}
    }
    let mut audit = audit.into_inner().unwrap_or_else(PoisonError::into_inner);
    // In request order, not finishing order: easier to read, and the same for the same seed.
    audit.leaks.sort_by_key(|f| (f.request, f.victim));
    audit.echoes.sort_by_key(|f| (f.request, f.victim));
    audit.wrong.sort_by_key(|w| w.request);
    audit.prefix.cross_hits.sort_by_key(|h| h.request);
    audit
}

/// Request `index`, and its twin when it has one: sent, scanned and recorded. Reuse is
/// judged only in shared-system-prompt mode, whose prompts open with a nonce fresh for the
/// run: elsewhere a prompt seen in an earlier run (same seed, same server) may be cached.
async fn one(setup: &Setup, index: usize, registry: &Registry, audit: &Mutex<Audit>) {
    let plan = plan(setup, index, registry);
    let begin = |audit: &Mutex<Audit>| {
        let mut audit = lock(audit);
        let partitions = &mut audit.prefix.partitions;
        setup
            .shared
            .is_some()
            .then(|| partitions.begin(plan.tenant, plan.salt.as_deref()))
    };
    let ticket = begin(audit);
    let outcome = send(setup, &plan).await;
    let found = registry.find(&format!("{}\n{}", outcome.body, outcome.text));
    {
        let mut audit = lock(audit);
        audit.record(&plan, &outcome, &found);
        if let Some(ticket) = ticket {
            audit.record_reuse(&plan, &outcome, ticket);
        }
    }
    if plan.twin && outcome.status == Ok(200) {
        let ticket = begin(audit);
        let twin = send(setup, &plan).await;
        let found = registry.find(&format!("{}\n{}", twin.body, twin.text));
        let mut audit = lock(audit);
        audit.record(&plan, &twin, &found);
        if let Some(ticket) = ticket {
            audit.record_reuse(&plan, &twin, ticket);
        }
        audit.compare_twins(&plan, &outcome, &twin);
    }
}
