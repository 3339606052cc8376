//! One request's run through the workers, from submit to its end, as a sequence of phases
//! whose variants hold what only that phase has.
//!
//! No 200 leaves before the decode worker reports `Started`, which it sends only after it
//! sealed a verified transfer (I2, I4). A client that goes away drops its [`Run`], and the
//! drop sends an abort to every worker the request touched (I7): the workers end it through
//! the protocol. A run is counted in `airlock_requests_total` exactly once: when it ends, or
//! as `cancelled` when it is dropped before.
//!
//! A try that fails on a worker's transport (a lost link, a failed transfer, a worker that is
//! shutting down) before any of the answer was sent is tried again on other workers, under a
//! fresh request id and so a fresh transfer id; the failed try is aborted on the workers that
//! still hold it. The failure is laid at the worker that caused it (`Cluster`'s breaker).

use crate::cluster::{role_name, TransportFault, WorkerClient};
use crate::error::ApiError;
use crate::metrics::{Counter, RequestOutcome, TransferOutcome};
use crate::openai::{Endpoint, Job};
use crate::responses::{FinishReason, Head, Scored, TokenScore, ToolCall, Usage, WholeChoice};
use crate::server::AppState;
use crate::tenants::TenantPermit;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kv::{Partition, RequestId};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::OwnedSemaphorePermit;
use transfer::{Failure, Finish, Frame, Plan, Role, Submit, TokenLogprob, TransferId};

/// One request in flight. Dropping it before it ended aborts it on every worker it reached.
pub(crate) struct Run {
    state: Arc<AppState>,
    id: RequestId,
    job: Job,
    workers: Vec<Arc<WorkerClient>>,
    rx: UnboundedReceiver<(Role, Frame)>,
    arrived: Instant,
    phase: Phase,
    /// Prompt tokens the computing worker (unified or prefill) took from its prefix cache.
    cached_tokens: u32,
    /// With `prompt_logprobs`: the score of each prompt token but the first, as the
    /// computing worker reports them (`PromptLogprobs`), and how many came.
    prompt_scores: Vec<Option<Scored>>,
    prompt_scored: usize,
    /// Decode's `Finished`, held until every prompt score has come.
    held_finish: Option<(Finish, u32, u32)>,
    /// With `echo`: the prompt is still to be said, first, once its scores have all come;
    /// text frames that arrive before are kept in `early`, in order.
    echo_pending: bool,
    early: VecDeque<(Role, Frame)>,
    /// Tries left after this one.
    retries_left: u32,
    /// Workers an earlier try failed on: picked again only when no other can take it.
    avoid: Vec<Arc<WorkerClient>>,
    /// This request's span (one per choice), in the client's trace when it sent one; the
    /// workers' spans are its children.
    span: otlp::TraceContext,
    started_at: std::time::SystemTime,
    tries: u32,
    /// The error code the run failed with, for its span.
    error_code: Option<&'static str>,
    permit: TenantPermit,
    _slot: OwnedSemaphorePermit,
}

enum Phase {
    /// Disaggregated: decode has the request and is reserving its pages. Prefill is told only
    /// once decode has (its `Admitted`), so no page can arrive before there is somewhere
    /// verified to put it.
    Reserving { prefill: PendingPrefill },
    /// Every worker the request needs has it; waiting for decode's (or unified's) `Started`.
    Prefilling,
    /// Decode has sealed the transfer: from here on only decode decides how the request ends
    /// (a prefill that loses its link before reading decode's `Ack` is no failure).
    Streaming { last_token: Option<Instant> },
    /// The workers reported the end, or the router gave up on the request.
    Ended(Ending),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ending {
    /// `Finished`: no worker holds anything for it, nobody needs an abort.
    Finished,
    /// One worker failed it (or the router gave up); the others may still hold pages for it.
    Failed,
}

impl Phase {
    /// Counted in the router's queue-depth gauge (`AppState::waiting`).
    fn is_waiting(&self) -> bool {
        matches!(self, Phase::Reserving { .. } | Phase::Prefilling)
    }
}

/// The prefill worker, the channel its frames go to, and the submit to send it.
type PendingPrefill = (
    Arc<WorkerClient>,
    UnboundedSender<(Role, Frame)>,
    Box<Frame>,
);

/// A step, or a worker's failure not yet turned into the client's error (it may be retried).
enum Advance {
    Step(Step),
    Failed(Role, Failure, String),
}

/// What the request's frames amount to, one at a time.
pub(crate) enum Step {
    Text(Said),
    Finished(FinishReason, Usage),
    Failed(ApiError),
}

/// Text for the client: what the model wrote, or an echoed prompt.
pub(crate) struct Said {
    pub text: String,
    /// The scores of the tokens it came from, when asked for.
    pub scored: Vec<Scored>,
    /// Set exactly for an echoed prompt: its first token, which nothing predicts, so it has no
    /// score.
    pub unscored_first: Option<String>,
}

impl Run {
    /// Sends the request to the workers it needs (decode first when disaggregated).
    pub(crate) fn submit(
        state: Arc<AppState>,
        job: Job,
        permit: TenantPermit,
        slot: OwnedSemaphorePermit,
    ) -> Result<Run, ApiError> {
        let echo_pending = job.echo;
        let span = match job.trace_parent {
            Some(parent) => parent.child(),
            None => otlp::TraceContext::root(),
        };
        let mut run = Run {
            span,
            started_at: std::time::SystemTime::now(),
            tries: 0,
            error_code: None,
            retries_left: state.config.retries,
            state,
            id: RequestId(0),
            job,
            workers: Vec::new(),
            rx: unbounded_channel().1,
            arrived: Instant::now(),
            // Until the first try is sent: nothing to abort, nothing counted.
            phase: Phase::Ended(Ending::Failed),
            cached_tokens: 0,
            prompt_scores: Vec::new(),
            prompt_scored: 0,
            held_finish: None,
            echo_pending,
            early: VecDeque::new(),
            avoid: Vec::new(),
            permit,
            _slot: slot,
        };
        run.dispatch()?;
        Ok(run)
    }

    /// Sends one try of the request under a fresh request id (and so a fresh transfer id),
    /// to workers picked afresh, with everything a try collects reset.
    fn dispatch(&mut self) -> Result<(), ApiError> {
        let state = self.state.clone();
        let job = &self.job;
        let id = RequestId(state.next_request.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = unbounded_channel();
        let tenant = self.permit.tenant().id;
        let prefix_cache = uses_prefix_cache(&state, &self.permit, job)
            .then(|| cache_partition(job.cache_salt.as_deref()));
        let (traced, span) = (
            state.tracer.is_on() || job.trace_parent.is_some(),
            self.span,
        );
        let submit = |plan| {
            Frame::Submit(Submit {
                request: id,
                tenant,
                prompt: job.prompt.clone(),
                max_tokens: job.max_tokens,
                sampling: job.sampling.clone(),
                stop: job.stop.clone(),
                ignore_eos: job.ignore_eos,
                prefix_cache,
                plan,
                trace: traced.then_some(span),
            })
        };
        let no_worker = |role| ApiError::NoWorkers {
            message: format!("no {} worker is available; retry shortly", role_name(role)),
        };
        // A prompt goes to the worker that was sent most of its pages before, while its load
        // allows, so it meets its cached prefix there.
        let prefix = prefix_cache.map(|partition| {
            let page_size = state.cluster.page_size().unwrap_or(16);
            prefix_digests(tenant, partition, &job.prompt, page_size)
        });
        let affinity = prefix.as_deref();
        let cluster = &state.cluster;
        let (workers, phase) = if cluster.has_role(Role::Unified) {
            let worker = cluster
                .pick(Role::Unified, &self.avoid, affinity)
                .ok_or(no_worker(Role::Unified))?;
            if !worker.submit(id, tx, submit(Plan::Unified)) {
                return Err(no_worker(Role::Unified));
            }
            (vec![worker], Phase::Prefilling)
        } else {
            let decode = cluster
                .pick(Role::Decode, &self.avoid, affinity)
                .ok_or(no_worker(Role::Decode))?;
            let prefill = cluster
                .pick(Role::Prefill, &self.avoid, affinity)
                .ok_or(no_worker(Role::Prefill))?;
            let transfer = TransferId(state.transfer_salt | id.0);
            if !decode.submit(id, tx.clone(), submit(Plan::Decode { transfer })) {
                return Err(no_worker(Role::Decode));
            }
            // How many pages decode holds from its own cache is filled in from its
            // `Admitted` (`submit_prefill`).
            let prefill_submit = submit(Plan::Prefill {
                transfer,
                decode_addr: decode.addr.clone(),
                decode_holds_pages: 0,
            });
            let prefill = (prefill, tx, Box::new(prefill_submit));
            (vec![decode], Phase::Reserving { prefill })
        };
        let prompt_scores = match job.sampling.prompt_logprobs {
            true => job.prompt.len() - 1,
            false => 0,
        };
        self.id = id;
        self.rx = rx;
        self.workers = workers;
        self.tries += 1;
        self.cached_tokens = 0;
        self.prompt_scores = vec![None; prompt_scores];
        self.prompt_scored = 0;
        self.held_finish = None;
        self.echo_pending = job.echo;
        self.early.clear();
        self.enter(phase);
        Ok(())
    }

    /// A worker (`role`) failed this try: lays the failure at the worker that caused it, and
    /// when it is one another worker may not have (a transport failure, a worker shutting
    /// down or full) and a try is left, aborts this try and sends the request again.
    /// Whether it was sent again. The caller makes sure nothing of the answer was sent.
    fn retry_after(&mut self, role: Role, failure: Failure) -> bool {
        let Some(culprit) = self.blame(role, failure) else {
            return false;
        };
        if self.retries_left == 0 {
            return false;
        }
        self.retries_left -= 1;
        let reason = TransportFault::of(failure).map_or("overloaded", TransportFault::label);
        self.state.metrics.inc(Counter::Retries { reason });
        tracing::info!(request = self.id.0, worker = %culprit.addr, reason, "trying the request on other workers");
        self.avoid.push(culprit);
        for worker in std::mem::take(&mut self.workers) {
            worker.send(Frame::Abort { request: self.id });
            worker.forget(self.id);
        }
        match self.dispatch() {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(
                    request = self.id.0,
                    error = error.code(),
                    "no other worker to try"
                );
                false
            }
        }
    }

    /// Lays `failure`, reported by the worker of `role`, at the worker that caused it, and
    /// names that worker for a retry to avoid; `None` when no worker is at fault (the
    /// client's request, a queue timeout). A transport fault is counted against the
    /// reporter itself when its link broke (the cluster counted that already) or when it
    /// works alone, else against its peer in the transfer (a decode worker reports what its
    /// prefill sent or failed to send, a prefill what its decode refused or could not take).
    /// A full or draining worker (`Overloaded`) is avoided, not counted.
    fn blame(&self, role: Role, failure: Failure) -> Option<Arc<WorkerClient>> {
        let reporter = self.worker(role)?;
        let Some(fault) = TransportFault::of(failure) else {
            return (failure == Failure::Overloaded).then_some(reporter);
        };
        if !reporter.is_up() {
            return Some(reporter);
        }
        let culprit = self
            .workers
            .iter()
            .find(|w| !Arc::ptr_eq(w, &reporter))
            .unwrap_or(&reporter)
            .clone();
        culprit.failed(fault);
        Some(culprit)
    }

    /// The worker of `role` this try runs on.
    fn worker(&self, role: Role) -> Option<Arc<WorkerClient>> {
        self.workers.iter().find(|w| w.role == role).cloned()
    }

    pub(crate) fn include_usage(&self) -> bool {
        self.job.include_usage
    }

    /// The choice this run answers.
    pub(crate) fn index(&self) -> u32 {
        self.job.index
    }

    /// Whether this run is its prompt's first choice (the one its prompt is counted for).
    pub(crate) fn first_of_prompt(&self) -> bool {
        self.job.index.is_multiple_of(self.job.best_of.max(1))
    }

    pub(crate) fn has_ended(&self) -> bool {
        matches!(self.phase, Phase::Ended(_))
    }

    /// What every answer of this request shares.
    pub(crate) fn head(&self) -> Head {
        let prefix = match self.job.endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
        };
        Head {
            endpoint: self.job.endpoint,
            id: format!("{prefix}-{:016x}", self.state.transfer_salt | self.id.0),
            model: self.state.config.model_id.clone(),
            logprobs: self.job.show_logprobs,
        }
    }

    /// Waits until decode has sealed a verified transfer (or unified has prefilled): only
    /// then may a 200 go out.
    pub(crate) async fn wait_started(&mut self) -> Result<(), ApiError> {
        let mut deadline = tokio::time::Instant::now() + self.state.config.start_timeout;
        loop {
            let (role, frame) = match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(received)) => received,
                Ok(None) => return Err(self.fail(ApiError::Internal)),
                Err(_) => {
                    let message = format!(
                        "no answer from the workers within {:?}; retry later",
                        self.state.config.start_timeout
                    );
                    return Err(self.fail(ApiError::Timeout { message }));
                }
            };
            match frame {
                Frame::Admitted { cached_pages, .. } if role == Role::Decode => {
                    self.observe_queue();
                    if !self.submit_prefill(cached_pages)
                        && !self.retry_after(Role::Prefill, Failure::PeerUnavailable)
                    {
                        return Err(self.fail(ApiError::NoWorkers {
                            message: "the prefill worker went away; retry".into(),
                        }));
                    }
                }
                Frame::Admitted { cached_tokens, .. } => {
                    if role == Role::Unified {
                        self.observe_queue();
                    }
                    self.cached_tokens = cached_tokens
                }
                Frame::PromptLogprobs {
                    first, logprobs, ..
                } => self.note_prompt_scores(first, logprobs),
                Frame::Started { .. } => {
                    for worker in &self.workers {
                        worker.succeeded();
                    }
                    let sealed = matches!(self.phase, Phase::Prefilling) && self.workers.len() == 2;
                    self.enter(Phase::Streaming { last_token: None });
                    if sealed {
                        self.state.metrics.inc(Counter::Transfers {
                            outcome: TransferOutcome::Ok,
                            reason: "sealed",
                        });
                    }
                    return Ok(());
                }
                Frame::Failed {
                    failure, message, ..
                } => {
                    let error = ApiError::from_failure(failure, message);
                    self.count_transfer_failure(&error);
                    if self.retry_after(role, failure) {
                        deadline = tokio::time::Instant::now() + self.state.config.start_timeout;
                        continue;
                    }
                    return Err(self.fail(error));
                }
                _ => {}
            }
        }
    }

    /// How long the request waited for its pages: from arrival to the reserving worker's
    /// `Admitted`.
    fn observe_queue(&self) {
        let waited = self.arrived.elapsed().as_secs_f64();
        self.state.metrics.observe_queue(waited);
    }

    /// Decode has reserved the pages, the first `decode_holds_pages` from its own cache: now
    /// prefill may start sending the others. Whether prefill has it (`false`: its link is
    /// gone, the try has failed on it).
    fn submit_prefill(&mut self, decode_holds_pages: u32) -> bool {
        match std::mem::replace(&mut self.phase, Phase::Prefilling) {
            Phase::Reserving {
                prefill: (prefill, tx, mut submit),
            } => {
                if let Frame::Submit(Submit {
                    plan:
                        Plan::Prefill {
                            decode_holds_pages: holds,
                            ..
                        },
                    ..
                }) = submit.as_mut()
                {
                    *holds = decode_holds_pages;
                }
                // In the try's workers either way: a retry names it as the one that failed.
                self.workers.push(prefill.clone());
                prefill.submit(self.id, tx, *submit)
            }
            // A repeated or unified `Admitted`: nothing more to send.
            other => {
                self.phase = other;
                true
            }
        }
    }

    fn count_transfer_failure(&self, error: &ApiError) {
        if self.workers.len() == 2
            && matches!(
                error,
                ApiError::TransferFailed { .. } | ApiError::Timeout { .. }
            )
        {
            self.state.metrics.inc(Counter::Transfers {
                outcome: TransferOutcome::Failed,
                reason: error.code(),
            });
        }
    }

    /// Moves to `next`, in the queue-depth gauge while waiting for `Started` (a retry waits
    /// again).
    fn enter(&mut self, next: Phase) {
        match (self.phase.is_waiting(), next.is_waiting()) {
            (true, false) => self.state.waiting.fetch_sub(1, Ordering::Relaxed),
            (false, true) => self.state.waiting.fetch_add(1, Ordering::Relaxed),
            _ => 0,
        };
        self.phase = next;
    }

    /// Ends the run with `error`, counted once; the drop aborts it on the other workers.
    fn fail(&mut self, error: ApiError) -> ApiError {
        self.error_code = Some(error.code());
        self.state.metrics.inc(Counter::Requests {
            outcome: RequestOutcome::Error,
            reason: error.reason(),
        });
        self.enter(Phase::Ended(Ending::Failed));
        error
    }

    /// The next thing the client should hear.
    pub(crate) async fn next(&mut self) -> Step {
        match self.advance().await {
            Advance::Step(step) => step,
            Advance::Failed(role, failure, message) => {
                self.blame(role, failure);
                Step::Failed(self.fail(ApiError::from_failure(failure, message)))
            }
        }
    }

    /// The next step, or a worker's failure for the caller to retry or answer with.
    async fn advance(&mut self) -> Advance {
        let step = |step| Advance::Step(step);
        loop {
            if self.echo_pending && self.prompt_scored == self.prompt_scores.len() {
                self.echo_pending = false;
                return step(Step::Text(self.echo()));
            }
            if let Some(finished) = self.finish_when_scored() {
                return step(finished);
            }
            let early = match self.echo_pending {
                true => None,
                false => self.early.pop_front(),
            };
            let received = if early.is_some() {
                early
            } else if self.held_finish.is_some() {
                // Decode has finished; prompt scores are still on their way from prefill.
                let wait = self.state.config.start_timeout;
                match tokio::time::timeout(wait, self.rx.recv()).await {
                    Ok(received) => received,
                    Err(_) => return step(Step::Failed(self.fail(ApiError::Internal))),
                }
            } else {
                self.rx.recv().await
            };
            let Some((role, frame)) = received else {
                return step(Step::Failed(self.fail(ApiError::Internal)));
            };
            if let (Role::Prefill, Frame::Admitted { cached_tokens, .. }) = (role, &frame) {
                self.cached_tokens = *cached_tokens;
            }
            if let Frame::PromptLogprobs {
                first, logprobs, ..
            } = frame
            {
                self.note_prompt_scores(first, logprobs);
                continue;
            }
            if role == Role::Prefill && matches!(self.phase, Phase::Streaming { .. }) {
                continue;
            }
            if self.echo_pending && matches!(frame, Frame::Text { .. }) {
                self.early.push_back((role, frame));
                continue;
            }
            match frame {
                // `max_tokens: 0` with `echo`: the one token generated is not shown.
                Frame::Text { .. } if self.job.hide_completion => {}
                Frame::Text { text, logprobs, .. } => {
                    if let Phase::Streaming { last_token } = &mut self.phase {
                        let now = Instant::now();
                        match last_token.replace(now) {
                            None => self
                                .state
                                .metrics
                                .observe_ttft((now - self.arrived).as_secs_f64()),
                            Some(last) => {
                                self.state.metrics.observe_itl((now - last).as_secs_f64())
                            }
                        }
                    }
                    let scored = logprobs.into_iter().map(|e| self.scored(e)).collect();
                    return step(Step::Text(Said {
                        text,
                        scored,
                        unscored_first: None,
                    }));
                }
                Frame::Finished {
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    ..
                } => self.held_finish = Some((finish, prompt_tokens, completion_tokens)),
                Frame::Failed {
                    failure, message, ..
                } => return Advance::Failed(role, failure, message),
                _ => {}
            }
        }
    }

    /// The request's end, once decode has finished it, every prompt score has come and the
    /// answer held back behind the echo has gone out (decode may finish before prefill's
    /// scores arrive: its text then waits in `early`).
    fn finish_when_scored(&mut self) -> Option<Step> {
        let (finish, prompt_tokens, completion_tokens) = self.held_finish?;
        if self.prompt_scored < self.prompt_scores.len() || !self.early.is_empty() {
            return None;
        }
        self.held_finish = None;
        let (finish, completion_tokens) = match self.job.hide_completion {
            true => (FinishReason::Length, 0),
            false => (FinishReason::from(finish), completion_tokens),
        };
        self.state.metrics.inc(Counter::Requests {
            outcome: RequestOutcome::Ok,
            reason: finish.label(),
        });
        self.state.metrics.request_finished(
            u64::from(prompt_tokens),
            u64::from(completion_tokens),
            u64::from(self.cached_tokens),
            self.arrived.elapsed().as_secs_f64(),
        );
        self.enter(Phase::Ended(Ending::Finished));
        let usage = Usage::new(prompt_tokens, completion_tokens, self.cached_tokens);
        Some(Step::Finished(finish, usage))
    }

    /// The echoed prompt: its text, and its tokens' scores when asked for.
    fn echo(&mut self) -> Said {
        let tokenizer = &self.state.tokenizer;
        let scored = std::mem::take(&mut self.prompt_scores)
            .into_iter()
            .flatten()
            .collect();
        let first = self.job.prompt[0];
        Said {
            text: tokenizer.decode(&self.job.prompt),
            scored,
            unscored_first: Some(TokenScore::new(tokenizer, first, 0.0).token),
        }
    }

    /// A worker's token score as the client reads it.
    fn scored(&self, entry: TokenLogprob) -> Scored {
        let tokenizer = &self.state.tokenizer;
        let score = |token, logprob| TokenScore::new(tokenizer, token, logprob);
        Scored {
            chosen: score(entry.token, entry.logprob),
            top: entry.top.into_iter().map(|(t, l)| score(t, l)).collect(),
        }
    }

    /// Prompt scores from position `first` (1 is the second prompt token); any outside the
    /// prompt, or already had, are dropped.
    fn note_prompt_scores(&mut self, first: u32, logprobs: Vec<TokenLogprob>) {
        let Some(base) = (first as usize).checked_sub(1) else {
            return;
        };
        for (i, entry) in logprobs.into_iter().enumerate() {
            if matches!(self.prompt_scores.get(base + i), Some(None)) {
                self.prompt_scores[base + i] = Some(self.scored(entry));
                self.prompt_scored += 1;
            }
        }
    }

    /// Non-streaming: this choice's whole text, finish and usage, or the error.
    async fn collect(mut self) -> Result<Collected, ApiError> {
        let mut text = String::new();
        let mut scores = Vec::new();
        let mut unscored_first = None;
        let (mut generated_logprob, mut generated) = (0.0, 0);
        loop {
            let step = match self.advance().await {
                Advance::Step(step) => step,
                Advance::Failed(role, failure, message) => {
                    if !self.retry_after(role, failure) {
                        return Err(self.fail(ApiError::from_failure(failure, message)));
                    }
                    // Nothing was sent yet: another try starts the answer afresh.
                    self.wait_started().await?;
                    text.clear();
                    scores.clear();
                    unscored_first = None;
                    (generated_logprob, generated) = (0.0, 0);
                    continue;
                }
            };
            match step {
                Step::Text(said) => {
                    if said.unscored_first.is_none() {
                        generated_logprob += said
                            .scored
                            .iter()
                            .map(|s| f64::from(s.chosen.logprob))
                            .sum::<f64>();
                        generated += said.scored.len();
                    }
                    text.push_str(&said.text);
                    scores.extend(said.scored);
                    unscored_first = unscored_first.or(said.unscored_first);
                }
                Step::Failed(error) => return Err(error),
                Step::Finished(mut finish, usage) => {
                    let tool_calls = self.tool_calls(&text, finish);
                    if tool_calls.is_some() {
                        finish = FinishReason::ToolCalls;
                    }
                    if !self.job.show_logprobs {
                        scores.clear();
                    }
                    return Ok(Collected {
                        first_of_prompt: self.first_of_prompt(),
                        mean_logprob: generated_logprob / generated.max(1) as f64,
                        usage,
                        choice: WholeChoice {
                            index: self.index(),
                            text,
                            finish,
                            scores,
                            unscored_first,
                            tool_calls,
                        },
                    });
                }
            }
        }
    }
}

/// One choice of a non-streamed answer.
struct Collected {
    first_of_prompt: bool,
    /// The mean log-probability of the tokens the model generated (`best_of` ranks by it).
    mean_logprob: f64,
    usage: Usage,
    choice: WholeChoice,
}

/// A choice that passed admission: its job, tenant permit and in-flight slot.
pub(crate) type Admitted = (Job, TenantPermit, OwnedSemaphorePermit);

/// A request's runs, one per choice: those submitted, and those held back.
pub(crate) struct Runs {
    state: Arc<AppState>,
    submitted: Vec<Run>,
    /// Choices of a prompt after its first, when the prefix cache can serve them: they are
    /// submitted once the first has started, when its prompt pages are in the cache of every
    /// worker it used, so each computes only the prompt's last page instead of all of it.
    held: Vec<Admitted>,
}

impl Runs {
    pub(crate) fn submit(state: &Arc<AppState>, admitted: Vec<Admitted>) -> Result<Runs, ApiError> {
        let share = admitted.len() > 1
            && admitted
                .iter()
                .all(|(job, permit, _)| uses_prefix_cache(state, permit, job));
        let mut runs = Runs {
            state: state.clone(),
            submitted: Vec::with_capacity(admitted.len()),
            held: Vec::new(),
        };
        for (job, permit, slot) in admitted {
            if share && !job.index.is_multiple_of(job.best_of.max(1)) {
                runs.held.push((job, permit, slot));
            } else {
                runs.submitted
                    .push(Run::submit(state.clone(), job, permit, slot)?);
            }
        }
        Ok(runs)
    }

    /// Every run started (I2 for each): the held ones are submitted once the others have.
    async fn started(mut self) -> Result<Vec<Run>, ApiError> {
        for run in &mut self.submitted {
            run.wait_started().await?;
        }
        let first_held = self.submitted.len();
        for (job, permit, slot) in std::mem::take(&mut self.held) {
            let run = Run::submit(self.state.clone(), job, permit, slot).inspect_err(|error| {
                self.state.metrics.inc(Counter::Requests {
                    outcome: RequestOutcome::Error,
                    reason: error.reason(),
                })
            })?;
            self.submitted.push(run);
        }
        for run in &mut self.submitted[first_held..] {
            run.wait_started().await?;
        }
        self.submitted.sort_by_key(Run::index);
        Ok(self.submitted)
    }
}

/// Whether a run may read and fill the prefix cache: the server and the tenant allow it, and
/// it does not need every prompt token's score (those need every token computed).
fn uses_prefix_cache(state: &AppState, permit: &TenantPermit, job: &Job) -> bool {
    state.config.prefix_cache && permit.tenant().prefix_cache && !job.sampling.prompt_logprobs
}

/// The client's answer to a request of one run per choice: a stream or the whole answer,
/// once every run has started (I2 for each). An error before that is the request's error
/// status; dropping the other runs aborts them.
pub(crate) async fn answer(runs: Runs) -> Result<Response, ApiError> {
    let runs = runs.started().await?;
    if runs.first().is_some_and(|run| run.job.stream) {
        return Ok(crate::stream::response(runs));
    }
    let head = runs.first().map(Run::head).ok_or(ApiError::Internal)?;
    // The first error (nothing was sent yet, so it gets its own status) drops the others.
    let (n, best_of) = runs
        .first()
        .map_or((1, 1), |run| (run.job.n, run.job.best_of));
    let choices = futures_util::future::try_join_all(runs.into_iter().map(Run::collect)).await?;
    // Every sampled completion is counted, shown or not.
    let usage = Usage::total(choices.iter().map(|c| (c.first_of_prompt, c.usage)));
    let choices = best_choices(choices, n, best_of);
    Ok(Json(head.whole(choices, usage)).into_response())
}

/// The `n` best of each prompt's `best_of` runs (all of them, in order, when there are only
/// `n`), by mean token log-probability, numbered as choices.
fn best_choices(choices: Vec<Collected>, n: u32, best_of: u32) -> Vec<WholeChoice> {
    if best_of <= n {
        return choices.into_iter().map(|c| c.choice).collect();
    }
    let mut best = Vec::with_capacity(choices.len());
    let mut choices = choices.into_iter().peekable();
    while choices.peek().is_some() {
        let mut runs: Vec<Collected> = choices.by_ref().take(best_of as usize).collect();
        // Stable: of equal scores the earlier run wins.
        runs.sort_by(|a, b| b.mean_logprob.total_cmp(&a.mean_logprob));
        for run in runs.into_iter().take(n as usize) {
            let mut choice = run.choice;
            choice.index = best.len() as u32;
            best.push(choice);
        }
    }
    best
}

impl Run {
    /// The calls a finished answer makes, when the request has tools and the answer is one.
    pub(crate) fn tool_calls(&self, text: &str, finish: FinishReason) -> Option<Vec<ToolCall>> {
        self.job.tools.as_ref()?.calls(text, finish)
    }

    /// How the answer's tool calls are read, when the request has tools (a stream then holds
    /// its text until the end).
    pub(crate) fn tool_use(&self) -> Option<crate::tools::ToolUse> {
        self.job.tools.clone()
    }
}

impl Run {
    /// The request's span, as it ends.
    fn record_span(&self) {
        let tracer = &self.state.tracer;
        if !tracer.is_on() {
            return;
        }
        let error = match self.phase {
            Phase::Ended(Ending::Finished) => None,
            Phase::Ended(Ending::Failed) => Some(self.error_code.unwrap_or("failed").to_string()),
            _ => Some("cancelled".to_string()),
        };
        let path = match self.job.endpoint {
            Endpoint::Chat => "POST /v1/chat/completions",
            Endpoint::Completions => "POST /v1/completions",
        };
        let workers: Vec<&str> = self.workers.iter().map(|w| w.addr.as_str()).collect();
        let int = |n: u64| otlp::Value::Int(n as i64);
        tracer.record(otlp::Span {
            context: self.span,
            parent: self.job.trace_parent.map(|parent| parent.span_id),
            name: path.to_string(),
            kind: otlp::SpanKind::Server,
            start: self.started_at,
            end: std::time::SystemTime::now(),
            attributes: vec![
                ("airlock.request_id", int(self.id.0)),
                ("airlock.tenant", int(self.permit.tenant().id.0)),
                ("airlock.choice", int(u64::from(self.job.index))),
                ("airlock.prompt_tokens", int(self.job.prompt.len() as u64)),
                ("airlock.max_tokens", int(u64::from(self.job.max_tokens))),
                ("airlock.cached_tokens", int(u64::from(self.cached_tokens))),
                ("airlock.tries", int(u64::from(self.tries))),
                ("airlock.workers", otlp::Value::Str(workers.join(","))),
            ],
            error,
        });
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        self.record_span();
        if self.phase.is_waiting() {
            self.state.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        match self.phase {
            Phase::Ended(Ending::Finished) => {
                for worker in &self.workers {
                    worker.forget(self.id);
                }
                return;
            }
            Phase::Ended(Ending::Failed) => {}
            Phase::Reserving { .. } | Phase::Prefilling | Phase::Streaming { .. } => {
                // The client is gone (or we gave up) before the end: abort through the
                // protocol. The workers release their pages once it is safe; nothing here
                // touches them.
                tracing::debug!(request = self.id.0, "aborting request");
                self.state.metrics.inc(Counter::Requests {
                    outcome: RequestOutcome::Cancelled,
                    reason: "client_gone",
                });
            }
        }
        for worker in &self.workers {
            worker.send(Frame::Abort { request: self.id });
            worker.forget(self.id);
        }
    }
}

/// The chained digests of a prompt's full pages, as `Cluster::pick` matches them against
/// what it sent each worker: page i's digest covers the tenant, the cache partition and every
/// token up to the end of page i, as a worker's prefix cache keys its pages. The tenant is in
/// every digest, so one tenant's prompts never steer another's.
fn prefix_digests(
    tenant: kv::TenantId,
    partition: Partition,
    prompt: &[u32],
    page_size: usize,
) -> Vec<u64> {
    let mut digest =
        xxhash_rust::xxh3::xxh3_64(&[tenant.0.to_le_bytes(), partition.0.to_le_bytes()].concat());
    prompt
        .chunks_exact(page_size.max(1))
        .map(|page| {
            let bytes: Vec<u8> = page.iter().flat_map(|t| t.to_le_bytes()).collect();
            digest = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, digest);
            digest
        })
        .collect()
}

/// The prefix-cache partition of a request within its tenant: one for requests without a
/// salt, one per salt. The tenant is not in it: workers key the cache by the tenant of the
/// request's pool owner, so no salt can reach another tenant's pages (I10).
fn cache_partition(salt: Option<&str>) -> Partition {
    match salt {
        None => Partition(0),
        // Domain-separated so that no salt hashes to the salt-less partition by design.
        Some(salt) => Partition(xxhash_rust::xxh3::xxh3_64_with_seed(salt.as_bytes(), 1) | 1),
    }
}
