//! Fault injection, for tests only: with the `fault-injection` feature a worker can be told to
//! misbehave at named points of prefill, transfer and decode, to show that the guards are what
//! stop each fault. Without the feature (every default build) a [`FaultPlan`] is empty, every
//! hook below is a constant, and a plan cannot be built: `AIRLOCK_FAULTS` is refused.
//!
//! A plan is a list of rules `[role:]fault[@when]`, separated by `;` (the `AIRLOCK_FAULTS`
//! syntax; a rule with a role prefix, e.g. `decode:stall-ack=500`, applies only to workers of
//! that role):
//! `when` is `always` (the default), a number `n` (only the n-th occurrence, from 0), or
//! `p%` (each occurrence with that chance, from a seeded generator). Faults:
//!
//! | name | point | what happens |
//! |---|---|---|
//! | `drop-page` | prefill send | one page frame of the transfer is never sent |
//! | `duplicate-page` | prefill send | one page frame is sent twice |
//! | `reorder` | prefill send | pages go in reverse order (`Done` still last) |
//! | `done-early` | prefill send | `Done` goes before the last page |
//! | `corrupt-page` | prefill send | one bit of one page's bytes is flipped |
//! | `foreign-page` | prefill send | one page frame names another tenant (metadata corruption) |
//! | `truncate` | prefill send | only the first half of the pages, then `Done` |
//! | `delay-done=MS` | prefill send | `Done` is held back MS milliseconds |
//! | `crash-mid-transfer` | prefill send | the process aborts after sending half the pages |
//! | `incident` | prefill admit | the 2026 incident: a prompt that does not fit the pool is replaced by a one-token placeholder, and `Done` claims the whole prompt |
//! | `delay-prompt-scores=MS` | prefill prompt scores | `PromptLogprobs` frames reach the router MS milliseconds late (sent from another thread), so decode's answer comes first |
//! | `slow-step=MS` | any step | each forward step takes MS milliseconds longer (widens the windows for disconnects and aborts) |
//! | `stall-ack=MS` | decode answer | `Ack`, `Nack` and `AbortAck` are held back MS milliseconds |
//! | `recycle-early` | decode seal | a request's pages are freed while it still decodes |
//! | `crash-on-page` | decode receive | the process aborts when a transfer's second page lands |
//! | `no-admission` | guard off | the worker skips its pool-size admission check and advertises its context length as its capacity |
//! | `no-preflight` | guard off | only the start-up check (I8) is skipped: the worker runs with a pool smaller than its context and advertises its real capacity, so admission must refuse what it cannot hold |
//! | `no-transfer-verify` | guard off | decode seals a transfer without checking counts, pages or checksum (I4) |
//! | `no-owner-check` | guard off | the pool skips the owner/generation compare on reads (I1), and the tenant compare of shared prefix-cache pages everywhere |
//! | `delay-writes=MS` | prefill one-sided write | each posted page write waits MS milliseconds before it copies (a stalled transport: writes land after an abort); `@N` delays only each link's N-th transfer |
//! | `abort-ack-early` | guard off | prefill answers decode's `WriteAbort` at once, while its posted writes may still land (the spec's `AbortAckBeforeQuiescence`) |
//! | `report-twice` | prefill one-sided write | each write of the link's first transfer (`@N`: its N-th) is reported landed (`Written`) twice, a writer bug decode must refuse |
//! | `no-write-quarantine` | guard off | decode frees a reservation a one-sided prefill may still write into at once, as it may a framed one (the spec's `ImmediateRelease`) |
//! | `cache-ignores-tenant` | guard off | the prefix index forgets the tenant: any tenant's cached pages match a prompt (I10's first guard; the pool's tenant check is the second) |

use std::time::Duration;

#[cfg(feature = "fault-injection")]
pub use imp::*;

/// Why a plan was refused.
#[derive(Debug, thiserror::Error)]
#[error("AIRLOCK_FAULTS: {0}")]
pub struct FaultPlanError(pub String);

#[cfg(not(feature = "fault-injection"))]
mod imp_off {
    use super::*;

    /// The empty plan of a build without fault injection.
    #[derive(Clone, Debug, Default)]
    pub struct FaultPlan;

    impl FaultPlan {
        pub fn none() -> FaultPlan {
            FaultPlan
        }

        /// Refuses any `AIRLOCK_FAULTS`: this build cannot inject faults.
        pub fn from_env(_role: transfer::Role) -> Result<FaultPlan, FaultPlanError> {
            refuse_faults(std::env::var("AIRLOCK_FAULTS").ok().as_deref())?;
            Ok(FaultPlan)
        }

        pub fn is_empty(&self) -> bool {
            true
        }

        /// Whether the worker checks that requests (and, at start-up, one context) fit its pool.
        #[inline(always)]
        pub fn admission_checked(&self) -> bool {
            true
        }
        /// Whether the worker refuses to start when its pool cannot hold one context (I8).
        #[inline(always)]
        pub fn preflight_checked(&self) -> bool {
            true
        }
        #[inline(always)]
        pub(crate) fn transfer_verified(&self) -> bool {
            true
        }
        #[inline(always)]
        pub(crate) fn incident(&mut self) -> bool {
            false
        }
        #[inline(always)]
        pub(crate) fn shape_transfer(&mut self, frames: Vec<transfer::Frame>) -> Outgoing {
            Outgoing {
                frames,
                delay_done: None,
                crash_after: None,
            }
        }
        #[inline(always)]
        pub(crate) fn reshapes_transfers(&self) -> bool {
            false
        }
        #[inline(always)]
        pub(crate) fn answer_delay(&mut self) -> Option<Duration> {
            None
        }
        #[inline(always)]
        pub(crate) fn prompt_scores_delay(&mut self) -> Option<Duration> {
            None
        }
        #[inline(always)]
        pub(crate) fn recycle_early(&mut self) -> bool {
            false
        }
        #[inline(always)]
        pub(crate) fn step_delay(&mut self) -> Option<Duration> {
            None
        }
        #[inline(always)]
        pub(crate) fn crash_on_page(&mut self, _index: usize) -> bool {
            false
        }
        #[inline(always)]
        pub(crate) fn write_quarantined(&self) -> bool {
            true
        }
        #[inline(always)]
        pub fn one_sided_writer(&self) -> transfer::one_sided::WriterFaults {
            transfer::one_sided::WriterFaults::default()
        }
    }
}
#[cfg(not(feature = "fault-injection"))]
pub use imp_off::FaultPlan;

/// What a build without fault injection says to a non-empty `AIRLOCK_FAULTS`.
#[cfg_attr(feature = "fault-injection", allow(dead_code))]
fn refuse_faults(spec: Option<&str>) -> Result<(), FaultPlanError> {
    match spec {
        Some(spec) if !spec.trim().is_empty() => Err(FaultPlanError(format!(
            "this build has no fault injection (the `fault-injection` feature, test builds \
             only), so `{spec}` cannot be honoured; unset AIRLOCK_FAULTS"
        ))),
        _ => Ok(()),
    }
}

#[test]
fn a_build_without_fault_injection_refuses_a_plan() {
    assert!(refuse_faults(None).is_ok());
    assert!(refuse_faults(Some(" ")).is_ok());
    let error = refuse_faults(Some("incident"))
        .expect_err("refused")
        .to_string();
    assert!(error.contains("unset AIRLOCK_FAULTS"), "{error}");
}

/// The process dies at once, as under SIGKILL: no cleanup, no goodbye frames (the kernel
/// closes its sockets). Exits rather than aborts, so no core file is left behind.
pub(crate) fn crash(point: &str) -> ! {
    eprintln!("airlock: fault injection: crash {point}");
    std::process::exit(CRASH_EXIT)
}

/// The exit status of a planted crash.
pub const CRASH_EXIT: i32 = 86;

/// A transfer's frames as the (possibly faulty) sender will send them.
pub(crate) struct Outgoing {
    /// Pages and `Done`, in sending order.
    pub frames: Vec<transfer::Frame>,
    /// Send `Done` this much later, from another thread.
    pub delay_done: Option<Duration>,
    /// Abort the process after sending this many frames.
    pub crash_after: Option<usize>,
}

#[cfg(feature = "fault-injection")]
mod imp {
    use super::*;
    use transfer::Frame;

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Fault {
        DropPage,
        DuplicatePage,
        Reorder,
        DoneEarly,
        CorruptPage,
        ForeignPage,
        Truncate,
        DelayDone(Duration),
        CrashMidTransfer,
        Incident,
        StallAck(Duration),
        SlowStep(Duration),
        /// Prompt scores reach the router this much later than they were computed.
        DelayPromptScores(Duration),
        RecycleEarly,
        CrashOnPage,
        NoAdmission,
        /// Only the start-up check off: the worker runs with a pool smaller than its context,
        /// as the incident's node did, and advertises its real capacity, so admission (I3)
        /// is what must refuse a request the pool cannot hold.
        NoPreflight,
        NoTransferVerify,
        NoOwnerCheck,
        CacheIgnoresTenant,
        DelayWrites(Duration),
        AbortAckEarly,
        ReportTwice,
        NoWriteQuarantine,
    }

    #[derive(Clone, Copy, Debug, PartialEq)]
    pub enum When {
        Always,
        /// Only the n-th occurrence (from 0) of the fault's point.
        Nth(u64),
        /// Each occurrence with this chance in percent.
        Chance(f64),
    }

    #[derive(Clone, Debug)]
    struct Rule {
        fault: Fault,
        when: When,
        seen: u64,
    }

    /// The faults one worker injects; see the module docs.
    #[derive(Clone, Debug, Default)]
    pub struct FaultPlan {
        rules: Vec<Rule>,
        rng: stats::SplitMix64,
    }

    impl FaultPlan {
        pub fn none() -> FaultPlan {
            FaultPlan::default()
        }

        /// The rules of `AIRLOCK_FAULTS` for a worker of `role` (empty when unset);
        /// `AIRLOCK_FAULT_SEED` seeds `p%`.
        pub fn from_env(role: transfer::Role) -> Result<FaultPlan, FaultPlanError> {
            let spec = std::env::var("AIRLOCK_FAULTS").unwrap_or_default();
            let seed = std::env::var("AIRLOCK_FAULT_SEED")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(1);
            let plan = FaultPlan::parse_for(&spec, seed, Some(role))?;
            if !plan.is_empty() {
                eprintln!("airlock: FAULT INJECTION ACTIVE ({spec}); a test build, never serve users with it");
            }
            Ok(plan)
        }

        /// A plan from `fault@when;...` (see the module docs), role prefixes not allowed.
        pub fn parse(spec: &str, seed: u64) -> Result<FaultPlan, FaultPlanError> {
            FaultPlan::parse_for(spec, seed, None)
        }

        /// The rules of `spec` for a worker of `role`; `None` refuses role prefixes.
        fn parse_for(
            spec: &str,
            seed: u64,
            role: Option<transfer::Role>,
        ) -> Result<FaultPlan, FaultPlanError> {
            let mut plan = FaultPlan {
                rules: Vec::new(),
                rng: stats::SplitMix64::new(seed),
            };
            for item in spec.split(';').map(str::trim).filter(|s| !s.is_empty()) {
                let (only, rule) = match item.split_once(':') {
                    Some((prefix, rule)) => (Some(parse_role(prefix)?), rule),
                    None => (None, item),
                };
                let (fault, when) = rule.split_once('@').unwrap_or((rule, "always"));
                let (fault, when) = (parse_fault(fault)?, parse_when(when)?);
                match (only, role) {
                    (Some(_), None) => {
                        return Err(FaultPlanError(format!("`{item}`: no role prefix here")))
                    }
                    (Some(only), Some(role)) if only != role => continue,
                    _ => plan = plan.with(fault, when),
                }
            }
            Ok(plan)
        }

        /// This plan and one more rule.
        pub fn with(mut self, fault: Fault, when: When) -> FaultPlan {
            self.rules.push(Rule {
                fault,
                when,
                seen: 0,
            });
            self
        }

        pub fn is_empty(&self) -> bool {
            self.rules.is_empty()
        }

        /// Whether a rule may reshape a transfer's frames: then prefill holds them until
        /// `Done` and shapes the whole transfer instead of streaming it.
        pub(crate) fn reshapes_transfers(&self) -> bool {
            self.rules.iter().any(|rule| reshapes_transfer(rule.fault))
        }

        fn has(&self, fault: Fault) -> bool {
            self.rules.iter().any(|rule| rule.fault == fault)
        }

        /// Whether a rule matching `pick` fires at this occurrence (counts the occurrence).
        fn fires(&mut self, pick: impl Fn(Fault) -> bool) -> Option<Fault> {
            let mut fired = None;
            for index in 0..self.rules.len() {
                if !pick(self.rules[index].fault) {
                    continue;
                }
                let rule = &mut self.rules[index];
                let occurrence = rule.seen;
                rule.seen += 1;
                let when = rule.when;
                let fault = rule.fault;
                let hit = match when {
                    When::Always => true,
                    When::Nth(n) => occurrence == n,
                    When::Chance(percent) => self.rng.unit() * 100.0 < percent,
                };
                if hit && fired.is_none() {
                    fired = Some(fault);
                }
            }
            fired
        }

        /// Whether the worker checks that requests (and, at start-up, one context) fit its pool.
        pub fn admission_checked(&self) -> bool {
            !self.has(Fault::NoAdmission)
        }

        /// Whether the worker refuses to start when its pool cannot hold one context (I8).
        pub fn preflight_checked(&self) -> bool {
            self.admission_checked() && !self.has(Fault::NoPreflight)
        }

        pub(crate) fn transfer_verified(&self) -> bool {
            !self.has(Fault::NoTransferVerify)
        }

        pub(crate) fn owner_checked(&self) -> bool {
            !self.has(Fault::NoOwnerCheck)
        }
        pub(crate) fn cache_keyed_by_tenant(&self) -> bool {
            !self.has(Fault::CacheIgnoresTenant)
        }

        /// Whether decode quarantines a dropped reservation a one-sided prefill may still
        /// write into.
        pub(crate) fn write_quarantined(&self) -> bool {
            !self.has(Fault::NoWriteQuarantine)
        }

        /// The faults of a one-sided link's writer (prefill).
        /// `delay-writes@N` delays the writes of each link's N-th transfer only; any other
        /// `when`, those of every transfer.
        pub fn one_sided_writer(&self) -> transfer::one_sided::WriterFaults {
            let delay = self.rules.iter().find_map(|rule| match rule.fault {
                Fault::DelayWrites(delay) => Some((delay, rule.when)),
                _ => None,
            });
            transfer::one_sided::WriterFaults {
                write_delay: delay.map(|(delay, _)| delay),
                delayed_transfer: match delay {
                    Some((_, When::Nth(n))) => Some(n),
                    _ => None,
                },
                ack_before_quiescence: self.has(Fault::AbortAckEarly),
                rewrite_written: false,
                reported_twice: self
                    .rules
                    .iter()
                    .find_map(|rule| match (rule.fault, rule.when) {
                        (Fault::ReportTwice, When::Nth(n)) => Some(n),
                        (Fault::ReportTwice, _) => Some(0),
                        _ => None,
                    }),
                engine_checksums: self.reshapes_transfers(),
            }
        }

        pub(crate) fn incident(&mut self) -> bool {
            self.fires(|f| f == Fault::Incident).is_some()
        }

        pub(crate) fn answer_delay(&mut self) -> Option<Duration> {
            match self.fires(|f| matches!(f, Fault::StallAck(_))) {
                Some(Fault::StallAck(delay)) => Some(delay),
                _ => None,
            }
        }

        pub(crate) fn step_delay(&mut self) -> Option<Duration> {
            match self.fires(|f| matches!(f, Fault::SlowStep(_))) {
                Some(Fault::SlowStep(delay)) => Some(delay),
                _ => None,
            }
        }

        pub(crate) fn prompt_scores_delay(&mut self) -> Option<Duration> {
            match self.fires(|f| matches!(f, Fault::DelayPromptScores(_))) {
                Some(Fault::DelayPromptScores(delay)) => Some(delay),
                _ => None,
            }
        }

        pub(crate) fn recycle_early(&mut self) -> bool {
            self.fires(|f| f == Fault::RecycleEarly).is_some()
        }

        pub(crate) fn crash_on_page(&mut self, index: usize) -> bool {
            index == 1 && self.fires(|f| f == Fault::CrashOnPage).is_some()
        }

        /// Applies at most one transfer fault to `frames` (pages, then `Done`).
        pub(crate) fn shape_transfer(&mut self, mut frames: Vec<Frame>) -> Outgoing {
            let mut outgoing = Outgoing {
                frames: Vec::new(),
                delay_done: None,
                crash_after: None,
            };
            let fault = self.fires(reshapes_transfer);
            let pages = frames.len() - 1;
            let middle = pages / 2;
            match fault {
                Some(Fault::DropPage) if pages > 0 => {
                    frames.remove(middle);
                }
                Some(Fault::DuplicatePage) if pages > 0 => {
                    let copy = frames[middle].clone();
                    frames.insert(middle, copy);
                }
                Some(Fault::Reorder) => frames[..pages].reverse(),
                Some(Fault::DoneEarly) if pages > 0 => frames.swap(pages - 1, pages),
                Some(Fault::CorruptPage) if pages > 0 => {
                    if let Frame::Page { bytes, .. } = &mut frames[middle] {
                        let at = bytes.len() / 3;
                        bytes[at] ^= 0x10;
                    }
                }
                Some(Fault::ForeignPage) if pages > 0 => {
                    if let Frame::Page { tenant, .. } = &mut frames[middle] {
                        tenant.0 ^= 1;
                    }
                }
                Some(Fault::Truncate) if pages > 0 => {
                    let done = frames.pop().expect("Done is last");
                    frames.truncate(pages / 2);
                    frames.push(done);
                }
                Some(Fault::DelayDone(delay)) => outgoing.delay_done = Some(delay),
                Some(Fault::CrashMidTransfer) => outgoing.crash_after = Some(middle.max(1)),
                _ => {}
            }
            outgoing.frames = frames;
            outgoing
        }
    }

    /// The faults [`FaultPlan::shape_transfer`] plants.
    fn reshapes_transfer(fault: Fault) -> bool {
        matches!(
            fault,
            Fault::DropPage
                | Fault::DuplicatePage
                | Fault::Reorder
                | Fault::DoneEarly
                | Fault::CorruptPage
                | Fault::ForeignPage
                | Fault::Truncate
                | Fault::DelayDone(_)
                | Fault::CrashMidTransfer
        )
    }

    fn parse_fault(text: &str) -> Result<Fault, FaultPlanError> {
        let (name, argument) = match text.split_once('=') {
            Some((name, argument)) => (name, Some(argument)),
            None => (text, None),
        };
        let millis = |argument: Option<&str>| -> Result<Duration, FaultPlanError> {
            let value = argument.ok_or_else(|| {
                FaultPlanError(format!("`{name}` needs a delay in milliseconds: {name}=MS"))
            })?;
            value
                .parse()
                .map(Duration::from_millis)
                .map_err(|_| FaultPlanError(format!("`{name}={value}`: not a number of ms")))
        };
        Ok(match name {
            "drop-page" => Fault::DropPage,
            "duplicate-page" => Fault::DuplicatePage,
            "reorder" => Fault::Reorder,
            "done-early" => Fault::DoneEarly,
            "corrupt-page" => Fault::CorruptPage,
            "foreign-page" => Fault::ForeignPage,
            "truncate" => Fault::Truncate,
            "delay-done" => Fault::DelayDone(millis(argument)?),
            "crash-mid-transfer" => Fault::CrashMidTransfer,
            "incident" => Fault::Incident,
            "stall-ack" => Fault::StallAck(millis(argument)?),
            "slow-step" => Fault::SlowStep(millis(argument)?),
            "delay-prompt-scores" => Fault::DelayPromptScores(millis(argument)?),
            "recycle-early" => Fault::RecycleEarly,
            "crash-on-page" => Fault::CrashOnPage,
            "no-admission" => Fault::NoAdmission,
            "no-preflight" => Fault::NoPreflight,
            "no-transfer-verify" => Fault::NoTransferVerify,
            "no-owner-check" => Fault::NoOwnerCheck,
            "cache-ignores-tenant" => Fault::CacheIgnoresTenant,
            "delay-writes" => Fault::DelayWrites(millis(argument)?),
            "abort-ack-early" => Fault::AbortAckEarly,
            "report-twice" => Fault::ReportTwice,
            "no-write-quarantine" => Fault::NoWriteQuarantine,
            other => {
                return Err(FaultPlanError(format!(
                    "unknown fault `{other}` (see worker/src/faults.rs for the list)"
                )))
            }
        })
    }

    fn parse_role(text: &str) -> Result<transfer::Role, FaultPlanError> {
        match text {
            "prefill" => Ok(transfer::Role::Prefill),
            "decode" => Ok(transfer::Role::Decode),
            "unified" => Ok(transfer::Role::Unified),
            other => Err(FaultPlanError(format!(
                "unknown role `{other}` (prefill, decode or unified)"
            ))),
        }
    }

    fn parse_when(text: &str) -> Result<When, FaultPlanError> {
        if text == "always" {
            return Ok(When::Always);
        }
        if let Some(percent) = text.strip_suffix('%') {
            return percent
                .parse()
                .ok()
                .filter(|p: &f64| (0.0..=100.0).contains(p))
                .map(When::Chance)
                .ok_or_else(|| FaultPlanError(format!("`@{text}`: not a percentage 0..100")));
        }
        text.parse()
            .map(When::Nth)
            .map_err(|_| FaultPlanError(format!("`@{text}`: use always, N or P%")))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn plans_parse_and_bad_ones_say_why() {
            let plan =
                FaultPlan::parse("incident; stall-ack=20@1 ;corrupt-page@50%", 7).expect("parses");
            assert_eq!(plan.rules.len(), 3);
            assert_eq!(
                plan.rules[1].fault,
                Fault::StallAck(Duration::from_millis(20))
            );
            assert_eq!(plan.rules[1].when, When::Nth(1));
            let spec = "prefill:incident;decode:no-transfer-verify;stall-ack=5";
            let decode = FaultPlan::parse_for(spec, 1, Some(transfer::Role::Decode)).expect("ok");
            assert_eq!(decode.rules.len(), 2);
            assert_eq!(decode.rules[0].fault, Fault::NoTransferVerify);
            for bad in ["explode", "stall-ack", "drop-page@x", "drop-page@150%"] {
                let error = FaultPlan::parse(bad, 1).expect_err(bad).to_string();
                assert!(error.starts_with("AIRLOCK_FAULTS"), "{error}");
            }
        }

        #[test]
        fn nth_fires_once_and_chance_is_seeded() {
            let mut plan = FaultPlan::none().with(Fault::RecycleEarly, When::Nth(2));
            let fired: Vec<bool> = (0..5).map(|_| plan.recycle_early()).collect();
            assert_eq!(fired, [false, false, true, false, false]);
            let run = |seed| {
                let mut plan = FaultPlan::parse("recycle-early@30%", seed).expect("parses");
                (0..200).filter(|_| plan.recycle_early()).count()
            };
            assert_eq!(run(5), run(5));
            assert!((30..90).contains(&run(5)), "{}", run(5));
        }
    }
}
