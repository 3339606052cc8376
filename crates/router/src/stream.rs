//! The SSE relay of a started request: one `data:` event per piece of text, each choice's
//! finish, the usage when asked for, then `[DONE]` once every choice has finished. A request
//! with several choices (`n`, or several prompts) interleaves their events, each carrying its
//! choice's `index`. Headers are out by then, so a failure is an `error` event and no `[DONE]`
//! (I2); the other choices are then aborted. A request with tools holds each choice's text
//! until its end, which shows whether the answer is text or a tool call.

use crate::responses::{FinishReason, Head, Piece, Usage};
use crate::run::{Run, Step};
use crate::tools::ToolUse;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, BoxStream, SelectAll, Stream, StreamExt};
use serde::Serialize;
use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;

/// A step of one choice: its index, whether it is its prompt's first, and the step.
type ChoiceStep = (u32, bool, Step);

struct StreamState {
    /// Every choice's steps, as they come; dropping it aborts the choices still running.
    steps: SelectAll<BoxStream<'static, ChoiceStep>>,
    head: Head,
    include_usage: bool,
    /// Choices not finished yet, and the usage of those that have.
    running: usize,
    usages: Vec<(bool, Usage)>,
    /// Events decided and not yet sent.
    queued: VecDeque<SseEvent>,
    /// `[DONE]` or an error is queued: nothing follows.
    over: bool,
    /// Characters of text sent so far, per choice (completions' `text_offset`).
    sent_chars: HashMap<u32, usize>,
    /// With tools: how the runs' answers are read as calls, and each choice's text, held
    /// until its end shows whether it is a call.
    held: Option<(ToolUse, HashMap<u32, String>)>,
}

pub(crate) fn response(runs: Vec<Run>) -> Response {
    let Some(first) = runs.first() else {
        return crate::error::ApiError::Internal.into_response();
    };
    let head = first.head();
    let include_usage = first.include_usage();
    let held = first.tool_use().map(|tools| (tools, HashMap::new()));
    let queued = runs
        .iter()
        .map(|run| data(&head.chunk(run.index(), Piece::Opening)))
        .collect();
    let state = StreamState {
        running: runs.len(),
        steps: stream::select_all(runs.into_iter().map(steps)),
        head,
        include_usage,
        usages: Vec::new(),
        queued,
        over: false,
        sent_chars: HashMap::new(),
        held,
    };
    Sse::new(events(state)).into_response()
}

/// One run's steps until it ends; then the run is dropped, ended (no abort).
fn steps(run: Run) -> BoxStream<'static, ChoiceStep> {
    let (index, first_of_prompt) = (run.index(), run.first_of_prompt());
    stream::unfold(run, |mut run| async move {
        if run.has_ended() {
            return None;
        }
        let step = run.next().await;
        Some((step, run))
    })
    .map(move |step| (index, first_of_prompt, step))
    .boxed()
}

fn data(chunk: &impl Serialize) -> SseEvent {
    let json = serde_json::to_string(chunk).expect("a chunk always serializes");
    SseEvent::default().data(json)
}

fn events(state: StreamState) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    stream::unfold(state, |mut state| async move {
        loop {
            if let Some(event) = state.queued.pop_front() {
                return Some((Ok(event), state));
            }
            if state.over {
                // Dropping the state drops the runs: those still running are aborted.
                return None;
            }
            let (index, first_of_prompt, step) = state.steps.next().await?;
            match step {
                Step::Text(said) if state.held.is_some() => {
                    let (_, held) = state.held.as_mut().expect("checked");
                    held.entry(index).or_default().push_str(&said.text);
                }
                Step::Text(said) => {
                    let offset = state.sent_chars.entry(index).or_default();
                    let piece = Piece::Text {
                        text: &said.text,
                        unscored_first: said.unscored_first.as_deref(),
                        scored: &said.scored,
                        offset: *offset,
                    };
                    *offset += said.text.chars().count();
                    state
                        .queued
                        .push_back(data(&state.head.chunk(index, piece)));
                }
                Step::Finished(mut finish, usage) => {
                    if let Some((tools, held)) = state.held.as_mut() {
                        let text = held.remove(&index).unwrap_or_default();
                        let piece = match &tools.calls(&text, finish) {
                            Some(calls) => {
                                finish = FinishReason::ToolCalls;
                                state.head.chunk(index, Piece::ToolCalls(calls))
                            }
                            None => {
                                let piece = Piece::Text {
                                    text: &text,
                                    unscored_first: None,
                                    scored: &[],
                                    offset: 0,
                                };
                                state.head.chunk(index, piece)
                            }
                        };
                        state.queued.push_back(data(&piece));
                    }
                    let last = state.head.chunk(index, Piece::Finish(finish));
                    state.queued.push_back(data(&last));
                    state.usages.push((first_of_prompt, usage));
                    state.running -= 1;
                    if state.running == 0 {
                        if state.include_usage {
                            let usage = Usage::total(state.usages.drain(..));
                            let usage = state.head.chunk(0, Piece::Usage(usage));
                            state.queued.push_back(data(&usage));
                        }
                        state.queued.push_back(SseEvent::default().data("[DONE]"));
                        state.over = true;
                    }
                }
                Step::Failed(error) => {
                    let event = SseEvent::default().event("error").data(error.to_json());
                    state.queued.push_back(event);
                    state.over = true;
                }
            }
        }
    })
}
