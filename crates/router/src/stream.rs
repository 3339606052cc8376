//! The SSE relay of a started run: one `data:` event per piece of text, the finish, the
//! usage when asked for, then `[DONE]`. Headers are out by then, so a failure is an `error`
//! event and no `[DONE]` (I2).

use crate::responses::{Head, Piece};
use crate::run::{Run, Step};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use serde::Serialize;
use std::collections::VecDeque;
use std::convert::Infallible;

struct StreamState {
    run: Run,
    head: Head,
    /// Events decided and not yet sent.
    queued: VecDeque<SseEvent>,
}

pub(crate) fn response(run: Run) -> Response {
    let head = run.head();
    let opening = data(&head.chunk(Piece::Opening));
    let state = StreamState {
        run,
        head,
        queued: VecDeque::from([opening]),
    };
    Sse::new(events(state)).into_response()
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
            if state.run.has_ended() {
                // Dropping the state here drops the run, which has ended: no abort.
                return None;
            }
            match state.run.next().await {
                Step::Text(text) => {
                    let piece = state.head.chunk(Piece::Text(&text));
                    state.queued.push_back(data(&piece));
                }
                Step::Finished(finish, usage) => {
                    let last = state.head.chunk(Piece::Finish(finish));
                    state.queued.push_back(data(&last));
                    if state.run.include_usage() {
                        let usage = state.head.chunk(Piece::Usage(usage));
                        state.queued.push_back(data(&usage));
                    }
                    state.queued.push_back(SseEvent::default().data("[DONE]"));
                }
                Step::Failed(error) => {
                    let event = SseEvent::default().event("error").data(error.to_json());
                    state.queued.push_back(event);
                }
            }
        }
    })
}
