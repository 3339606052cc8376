//! The verdict and the report, as text and as JSON.

use crate::audit::more;
use crate::audit::Audit;
use crate::audit::Finding;
use crate::audit::FAILURES_SHOWN;
use crate::audit::LINES_SHOWN;
use crate::plan::request_id;
use crate::plan::Class;
use crate::shared::CrossHit;
use crate::shared::HITS_SHOWN;
use crate::Setup;

/// How the run ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Clean,
    /// Leaks or wrong 200s.
    Failed,
    /// Requests that should succeed were sent and none got a 2xx: nothing was audited.
    Inconclusive,
    /// Shared-system-prompt mode, and no answer could judge reuse (none said cached_tokens).
    Unchecked,
}

impl Verdict {
    pub(crate) fn describe(self, audit: &Audit) -> String {
        match self {
            Verdict::Clean => "clean".to_string(),
            Verdict::Failed => format!(
                "FAILED: {} leak(s), {} should-fail request(s) answered 2xx, {} greedy twin(s) \
                 answered differently, {} cross-tenant cache hit(s)",
                audit.leaks.len(),
                audit.wrong.len(),
                audit.inconsistent.len(),
                audit.prefix.cross_hits.len()
            ),
            Verdict::Inconclusive => "INCONCLUSIVE: no request that should succeed got a 2xx, \
                 so no answer was audited (check the URL, keys and --model)"
                .to_string(),
            Verdict::Unchecked => "INCONCLUSIVE: no answer could judge cross-tenant cache \
                 reuse (a tenant's first request or a fresh cache_salt's, answered 2xx with \
                 usage.prompt_tokens_details.cached_tokens)"
                .to_string(),
        }
    }
}

pub(crate) struct Report<'a> {
    pub(crate) setup: &'a Setup,
    pub(crate) audit: &'a Audit,
    pub(crate) wall: f64,
}

impl Report<'_> {
    pub(crate) fn verdict(&self) -> Verdict {
        let audit = self.audit;
        if !audit.leaks.is_empty()
            || !audit.wrong.is_empty()
            || !audit.inconsistent.is_empty()
            || !audit.prefix.cross_hits.is_empty()
        {
            return Verdict::Failed;
        }
        let sent: usize = audit.should_succeed().map(|t| t.sent).sum();
        let answered: usize = audit.should_succeed().map(|t| t.count(200..300)).sum();
        if sent > 0 && answered == 0 {
            return Verdict::Inconclusive;
        }
        if self.setup.shared.is_some() && audit.prefix.checked() == 0 {
            return Verdict::Unchecked;
        }
        Verdict::Clean
    }

    pub(crate) fn tenant(&self, index: usize) -> &str {
        &self.setup.tenants[index].name
    }

    pub(crate) fn print(&self) {
        let (setup, audit) = (self.setup, self.audit);
        println!("\n== airlock canary report\n{}", setup.describe());
        println!(
            "{} requests in {:.1} s ({:.1}/s)\n",
            audit.sent(),
            self.wall,
            audit.sent() as f64 / self.wall.max(1e-9)
        );
        println!(
            "{:<10} {:<6} {:>5} {:>5} {:>5} {:>5} {:>6} {:>9}  statuses",
            "class", "expect", "sent", "2xx", "4xx", "5xx", "other", "transport"
        );
        for class in Class::ALL {
            let t = &audit.tallies[class.slot()];
            let statuses: Vec<String> = t
                .statuses
                .iter()
                .map(|(status, n)| format!("{status}x{n}"))
                .collect();
            println!(
                "{:<10} {:<6} {:>5} {:>5} {:>5} {:>5} {:>6} {:>9}  {}",
                class.name(),
                if class.should_fail() { "4xx" } else { "2xx" },
                t.sent,
                t.count(200..300),
                t.count(400..500),
                t.count(500..600),
                t.other(),
                t.transport,
                statuses.join(" ")
            );
        }
        self.print_details();
        println!(
            "verdict: {} (seed {})",
            self.verdict().describe(audit),
            setup.options.seed
        );
    }

    pub(crate) fn print_details(&self) {
        let (setup, audit) = (self.setup, self.audit);
        let latencies = &audit.latencies;
        if !latencies.is_empty() {
            println!(
                "\nlatency of 2xx answers: p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
                stats::percentile(latencies, 50.0) * 1e3,
                stats::percentile(latencies, 99.0) * 1e3,
                stats::percentile(latencies, 100.0) * 1e3
            );
        }
        if let Some(tokens) = audit.tallies[Class::Long.slot()].prompt_tokens_max {
            println!(
                "long prompts: up to {tokens} prompt tokens, of a context of {}",
                setup.context_length
            );
        }
        if audit.cut_short + audit.stream_errors > 0 {
            println!(
                "bodies cut short: {}; 200 streams ended by an error event: {}",
                audit.cut_short, audit.stream_errors
            );
        }
        if audit.failures_seen > 0 {
            println!(
                "\n5xx, transport errors, cut bodies ({}):",
                audit.failures_seen
            );
            for line in &audit.failures {
                println!("  {line}");
            }
        }
        let should_fail: usize = audit.should_fail().map(|t| t.sent).sum();
        let refused: usize = audit.should_fail().map(|t| t.count(400..500)).sum();
        println!(
            "\nshould-fail requests: {should_fail}, answered 4xx: {refused}, answered 2xx \
             (wrong): {}",
            audit.wrong.len()
        );
        for wrong in audit.wrong.iter().take(LINES_SHOWN) {
            println!(
                "  WRONG {}: {} (tenant {}; {}) should have got a 4xx; body: {}",
                wrong.status,
                request_id(wrong.request),
                self.tenant(wrong.tenant),
                wrong.what,
                wrong.body
            );
        }
        more(audit.wrong.len(), LINES_SHOWN);
        println!("leaks: {}", audit.leaks.len());
        for leak in audit.leaks.iter().take(LINES_SHOWN) {
            println!("  LEAK: {}", self.finding(leak));
        }
        more(audit.leaks.len(), LINES_SHOWN);
        if audit.twins_compared > 0 {
            println!(
                "greedy twins compared: {}, answered differently: {}",
                audit.twins_compared,
                audit.inconsistent.len()
            );
        }
        for twin in audit.inconsistent.iter().take(LINES_SHOWN) {
            println!(
                "  INCONSISTENT: {} (tenant {}; {}) answered {:?}, then {:?}",
                request_id(twin.request),
                self.tenant(twin.tenant),
                twin.what,
                twin.first,
                twin.second
            );
        }
        more(audit.inconsistent.len(), LINES_SHOWN);
        println!(
            "own-tenant markers of another request (informational): {}",
            audit.echoes.len()
        );
        for echo in audit.echoes.iter().take(FAILURES_SHOWN) {
            println!("  echo: {}", self.finding(echo));
        }
        more(audit.echoes.len(), FAILURES_SHOWN);
        self.print_reuse();
    }

    /// Shared-system-prompt mode's counts, and every cross-tenant hit (up to HITS_SHOWN).
    pub(crate) fn print_reuse(&self) {
        let Some(shared) = &self.setup.shared else {
            return;
        };
        let prefix = &self.audit.prefix;
        println!(
            "\nshared system prompt: about {} tokens, session {}",
            shared.tokens, shared.nonce
        );
        println!(
            "checked for cross-tenant reuse: {} (tenants' first requests {}, fresh cache_salt \
             {}); cross-tenant cache hits: {}",
            prefix.checked(),
            prefix.checked_first,
            prefix.checked_salted,
            prefix.cross_hits.len()
        );
        for hit in prefix.cross_hits.iter().take(HITS_SHOWN) {
            println!("  CROSS-TENANT HIT: {}", self.hit(hit));
        }
        more(prefix.cross_hits.len(), HITS_SHOWN);
        println!(
            "same-tenant reuse allowed: {} answers, {} of them hits ({} cached tokens in all)",
            prefix.reusable, prefix.own_hits, prefix.own_cached_tokens
        );
        if prefix.unreported > 0 {
            println!(
                "2xx answers without usage.prompt_tokens_details.cached_tokens: {}",
                prefix.unreported
            );
        }
        if prefix.reusable > 0 && prefix.own_hits == 0 {
            println!(
                "note: no same-tenant hit either: the prefix cache looks off, so 0 cross-tenant \
                 hits shows little"
            );
        }
    }

    pub(crate) fn hit(&self, hit: &CrossHit) -> String {
        let server = hit
            .server_id
            .as_deref()
            .map_or(String::new(), |id| format!("; server id {id}"));
        let why = if hit.salted {
            "its cache_salt was fresh"
        } else {
            "it was its tenant's first request"
        };
        format!(
            "{} (tenant {}; {}{server}) reported {} cached tokens, but {why}",
            request_id(hit.request),
            self.tenant(hit.tenant),
            hit.what,
            hit.cached_tokens
        )
    }

    pub(crate) fn finding(&self, f: &Finding) -> String {
        let server = f
            .server_id
            .as_deref()
            .map_or(String::new(), |id| format!("; server id {id}"));
        format!(
            "{} (tenant {}; {}{server}) contains {}, issued to {} (tenant {}): \"{}\"",
            request_id(f.request),
            self.tenant(f.tenant),
            f.what,
            f.marker,
            request_id(f.victim),
            self.tenant(f.victim_tenant),
            f.context
        )
    }

    pub(crate) fn json(&self) -> serde_json::Value {
        let (setup, audit) = (self.setup, self.audit);
        let classes: serde_json::Map<String, serde_json::Value> = Class::ALL
            .iter()
            .map(|&class| {
                let t = &audit.tallies[class.slot()];
                let statuses: serde_json::Map<String, serde_json::Value> = t
                    .statuses
                    .iter()
                    .map(|(status, n)| (status.to_string(), (*n).into()))
                    .collect();
                let value = serde_json::json!({
                    "expect": if class.should_fail() { "4xx" } else { "2xx" },
                    "sent": t.sent,
                    "2xx": t.count(200..300),
                    "4xx": t.count(400..500),
                    "5xx": t.count(500..600),
                    "other": t.other(),
                    "transport_errors": t.transport,
                    "statuses": statuses,
                    "prompt_tokens_max": t.prompt_tokens_max,
                });
                (class.name().to_string(), value)
            })
            .collect();
        let finding = |f: &Finding| {
            serde_json::json!({
                "request": request_id(f.request),
                "tenant": self.tenant(f.tenant),
                "what": f.what,
                "server_id": f.server_id,
                "marker": f.marker,
                "victim_request": request_id(f.victim),
                "victim_tenant": self.tenant(f.victim_tenant),
                "context": f.context,
            })
        };
        let wrong: Vec<serde_json::Value> = audit
            .wrong
            .iter()
            .map(|w| {
                serde_json::json!({
                    "request": request_id(w.request),
                    "tenant": self.tenant(w.tenant),
                    "what": w.what,
                    "status": w.status,
                    "body": w.body,
                })
            })
            .collect();
        let latencies = &audit.latencies;
        let verdict = self.verdict();
        serde_json::json!({
            "verdict": match verdict {
                Verdict::Clean => "clean",
                Verdict::Failed => "failed",
                Verdict::Inconclusive | Verdict::Unchecked => "inconclusive",
            },
            "shared_prefix": self.reuse_json(),
            "clean": verdict == Verdict::Clean,
            "seed": setup.options.seed,
            "url": setup.url,
            "model": setup.model,
            "tenants": setup.tenants.iter().map(|t| t.name.clone()).collect::<Vec<_>>(),
            "context_length": setup.context_length,
            "context_source": setup.context_source,
            "concurrency": setup.options.concurrency,
            "max_tokens": setup.options.max_tokens,
            "requests": audit.sent(),
            "seconds": self.wall,
            "classes": classes,
            "should_fail": {
                "sent": audit.should_fail().map(|t| t.sent).sum::<usize>(),
                "got_4xx": audit.should_fail().map(|t| t.count(400..500)).sum::<usize>(),
                "got_2xx": audit.wrong.len(),
            },
            "leaks": audit.leaks.iter().map(finding).collect::<Vec<_>>(),
            "wrong_200": wrong,
            "twins_compared": audit.twins_compared,
            "inconsistent_twins": audit
                .inconsistent
                .iter()
                .map(|t| serde_json::json!({
                    "request": request_id(t.request),
                    "tenant": self.tenant(t.tenant),
                    "what": t.what,
                    "first": t.first,
                    "second": t.second,
                }))
                .collect::<Vec<_>>(),
            "own_tenant_echoes": audit.echoes.iter().map(finding).collect::<Vec<_>>(),
            "failures_seen": audit.failures_seen,
            "failures": audit.failures,
            "bodies_cut_short": audit.cut_short,
            "stream_error_events": audit.stream_errors,
            "latency_ms": {
                "p50": (!latencies.is_empty()).then(|| stats::percentile(latencies, 50.0) * 1e3),
                "p99": (!latencies.is_empty()).then(|| stats::percentile(latencies, 99.0) * 1e3),
            },
        })
    }

    /// Shared-system-prompt mode's counts and hits; null when the mode is off.
    pub(crate) fn reuse_json(&self) -> serde_json::Value {
        let Some(shared) = &self.setup.shared else {
            return serde_json::Value::Null;
        };
        let prefix = &self.audit.prefix;
        let hits: Vec<serde_json::Value> = prefix
            .cross_hits
            .iter()
            .map(|hit| {
                serde_json::json!({
                    "request": request_id(hit.request),
                    "tenant": self.tenant(hit.tenant),
                    "what": hit.what,
                    "cached_tokens": hit.cached_tokens,
                    "fresh_salt": hit.salted,
                    "server_id": hit.server_id,
                })
            })
            .collect();
        serde_json::json!({
            "tokens": shared.tokens,
            "session": shared.nonce,
            "fresh_salt_fraction": shared.fresh_salt,
            "checked": prefix.checked(),
            "checked_first": prefix.checked_first,
            "checked_fresh_salt": prefix.checked_salted,
            "cross_tenant_hits": hits,
            "reusable": prefix.reusable,
            "same_tenant_hits": prefix.own_hits,
            "same_tenant_cached_tokens": prefix.own_cached_tokens,
            "no_cached_tokens": prefix.unreported,
        })
    }
}
