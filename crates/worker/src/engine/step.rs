//! The batched forward step: one token for every decoding request plus prompt chunks for
//! prefilling ones, then sampling, and the end of a prefill or a decode.

use super::constrain::{constrained_sample, Masks};
use super::{Constrained, DecodeState, Engine, Key, Phase, Request, Stage};
use kv::RequestId;
use model::{LogitRows, Logits, SamplingParams, SeqStep};
use transfer::{Failure, Finish, Frame, Plan, Submit, TokenLogprob, MAX_TEXT_LOGPROBS};

impl Engine {
    pub(super) fn step(&mut self) {
        // The decoding requests this step runs, oldest first.
        let mut decoding: Vec<(u64, Key)> = self
            .requests
            .iter()
            .filter(|(_, request)| {
                matches!(
                    request.phase,
                    Phase::Admitted {
                        stage: Stage::Decoding(_),
                        ..
                    }
                )
            })
            .map(|(key, request)| (request.seq, *key))
            .collect();
        decoding.sort_unstable_by_key(|row| row.0);
        decoding.truncate(self.config.max_batch);
        let decoding: Vec<Key> = decoding.into_iter().map(|row| row.1).collect();
        let mut masking = self.take_grammars(&decoding);
        let Engine {
            config,
            model,
            pool,
            requests,
            ..
        } = self;
        let mut steps: Vec<SeqStep> = Vec::with_capacity(decoding.len());
        for key in &decoding {
            if let Some(Request {
                phase:
                    Phase::Admitted {
                        table,
                        stage: Stage::Decoding(state),
                    },
                ..
            }) = requests.get(key)
            {
                steps.push(SeqStep {
                    table,
                    tokens: std::slice::from_ref(&state.next_input),
                    start_pos: state.position,
                    logits: model::LogitRows::Last,
                });
            }
        }
        // (seq, key, table, submit, done, target) for each prefilling request.
        let mut prefilling = Vec::new();
        for (key, request) in requests.iter() {
            if let Phase::Admitted {
                table,
                stage: Stage::Prefilling { done, target, .. },
            } = &request.phase
            {
                let submit = &request.submit;
                prefilling.push((request.seq, *key, table, submit, *done, *target));
            }
        }
        if decoding.is_empty() && prefilling.is_empty() {
            return;
        }
        prefilling.sort_unstable_by_key(|row| row.0);
        let mut budget = config.step_tokens.saturating_sub(decoding.len()).max(1);
        // (key, token count, prompt log-probabilities' top count) for each prefill row.
        let mut chunks: Vec<(Key, usize, Option<u8>)> = Vec::new();
        for &(_, key, table, submit, done, target) in &prefilling {
            if budget == 0 {
                break;
            }
            let count = (target - done).min(budget);
            budget -= count;
            let sampling = &submit.sampling;
            let scored = sampling.logprobs.filter(|_| sampling.prompt_logprobs);
            chunks.push((key, count, scored));
            steps.push(SeqStep {
                table,
                tokens: &submit.prompt[done..done + count],
                start_pos: done,
                logits: match scored {
                    Some(_) => LogitRows::Every,
                    None => LogitRows::None,
                },
            });
        }
        if let Some(delay) = config.faults.step_delay() {
            std::thread::sleep(delay);
        }
        // The constrained requests' masks are computed while the model computes the logits.
        let (result, masks) = std::thread::scope(|scope| {
            let masker = (!masking.is_empty()).then(|| scope.spawn(|| masking.compute()));
            let result = model.forward(pool, &steps);
            let masks = masker.map(|masker| masker.join().unwrap_or_default());
            (result, masks.unwrap_or_default())
        });
        let mut masks = self.masked(masking, masks);
        let logits = match result {
            Ok(logits) => logits,
            Err(error) => {
                let keys = decoding.iter().copied().chain(chunks.iter().map(|c| c.0));
                self.step_failed(&error, keys.collect());
                return;
            }
        };
        for (&key, logits) in decoding.iter().zip(&logits) {
            self.sampled(key, logits, &mut masks);
        }
        // The prompt rows' logits follow the decoding rows', in chunk order.
        let mut row = decoding.len();
        for &(key, count, scored) in &chunks {
            if let Some(top) = scored {
                self.prompt_scored(key, &logits, row, count, top);
                row += count;
            }
        }
        for &(key, count, _) in &chunks {
            let Some(Request {
                phase:
                    Phase::Admitted {
                        stage: Stage::Prefilling { done, target, .. },
                        ..
                    },
                ..
            }) = self.requests.get_mut(&key)
            else {
                continue;
            };
            *done += count;
            self.prefilled_tokens += count as u64;
            if *done == *target {
                self.prefilled(key);
            } else {
                self.stream_pages(key);
            }
        }
    }

    /// A step refused to run: a page check failed (a bug in this worker, or a fault planted
    /// in a test; counted and exported) or the model refused the batch. The checks run before
    /// any K/V is touched, so nothing was written; the exception is `MergedPassFailed` (a
    /// pass this step shared with another engine's panicked midway), which may have written
    /// K/V past what the pages are marked to hold, slots no later step reads before writing
    /// them again (`UnwrittenPositions`). The requests whose own pages no longer
    /// verify fail; the others run again next step. If none can be singled out, all fail:
    /// none is answered from what the step might have read.
    fn step_failed(&mut self, error: &model::Error, keys: Vec<Key>) {
        if matches!(error, model::Error::Kv(_)) {
            self.ownership_failures += 1;
        }
        tracing::error!(%error, "forward step refused; failing the requests it concerns");
        let unverified: Vec<Key> = keys
            .iter()
            .copied()
            .filter(|key| match self.requests.get(key).map(|r| &r.phase) {
                Some(Phase::Admitted { table, .. }) => self.pool.verify_batch(&[table]).is_err(),
                _ => true,
            })
            .collect();
        let failing = if unverified.is_empty() {
            keys
        } else {
            unverified
        };
        for key in failing {
            self.end(
                key,
                Err((Failure::Internal, "the worker refused a step".into())),
            );
        }
    }

    /// The prompt is in KV: its full pages go to the prefix cache, then unified requests
    /// start decoding and prefill ones send their pages.
    pub(super) fn prefilled(&mut self, key: Key) {
        self.publish_prompt(key);
        let Some(request) = self.requests.get_mut(&key) else {
            return;
        };
        match request.submit.plan {
            Plan::Unified => {
                if let Phase::Admitted { stage, .. } = &mut request.phase {
                    *stage = Stage::Decoding(DecodeState::new(&request.submit));
                }
                self.send(key.0, Frame::Started { request: key.1 });
            }
            Plan::Prefill { transfer, .. } => self.send_pages(key, transfer),
            Plan::Decode { .. } => unreachable!("decode plans receive, they never prefill"),
        }
    }

    /// Sends the log-probabilities of the prompt tokens a chunk's `count` logit rows (from
    /// `first_row`) predict: the chunk's row for prompt position p scores token p + 1.
    fn prompt_scored(
        &mut self,
        key: Key,
        logits: &Logits,
        first_row: usize,
        count: usize,
        top: u8,
    ) {
        let Some(Request {
            submit,
            phase:
                Phase::Admitted {
                    stage: Stage::Prefilling { done, .. },
                    ..
                },
            ..
        }) = self.requests.get(&key)
        else {
            return;
        };
        // `done` has not moved past this chunk yet.
        let start = *done;
        let entries = (0..count)
            .map(|i| {
                let token = submit.prompt[start + i + 1];
                let (logprob, top) = model::logprobs(&logits[first_row + i], token, top.into());
                TokenLogprob {
                    token,
                    logprob,
                    top,
                }
            })
            .collect::<Vec<_>>();
        for (n, part) in entries.chunks(MAX_TEXT_LOGPROBS).enumerate() {
            let frame = Frame::PromptLogprobs {
                request: key.1,
                first: (start + 1 + n * MAX_TEXT_LOGPROBS) as u32,
                logprobs: part.to_vec(),
            };
            let delay = self.config.faults.prompt_scores_delay();
            self.send_after(key.0, frame, delay);
        }
    }

    fn sampled(&mut self, key: Key, logits: &[f32], masks: &mut Masks) {
        let eos = self.tokenizer.eos_id();
        let Some(Request {
            submit,
            phase:
                Phase::Admitted {
                    stage: Stage::Decoding(state),
                    ..
                },
            ..
        }) = self.requests.get_mut(&key)
        else {
            return;
        };
        let token = match constrained_sample(state, logits, masks.remove(&key)) {
            Ok(token) => token,
            Err(error) => {
                let message = format!("structured output failed: {error}");
                self.end(key, Err((Failure::BadRequest, message)));
                return;
            }
        };
        let (shown, finish) = if token == eos && !submit.ignore_eos {
            (String::new(), Some(Finish::Stop))
        } else {
            if let Some(top) = submit.sampling.logprobs {
                let (logprob, top) = model::logprobs(logits, token, top.into());
                state.logprobs.push(TokenLogprob {
                    token,
                    logprob,
                    top,
                });
            }
            let token_bytes = self.tokenizer.token_bytes(token);
            state.push(token, token_bytes, submit.max_tokens as usize)
        };
        // The log-probabilities go with the next text shown, or with the end.
        let shown = (!shown.is_empty()).then(|| (shown, std::mem::take(&mut state.logprobs)));
        let finished = finish.map(|finish| {
            let tail = (state.flush(), std::mem::take(&mut state.logprobs));
            let frame = Frame::Finished {
                request: key.1,
                finish,
                prompt_tokens: submit.prompt.len() as u32,
                completion_tokens: state.generated.len() as u32,
            };
            (tail, frame)
        });
        if let Some((text, logprobs)) = shown {
            self.send(key.0, text_frame(key.1, text, logprobs));
        }
        if let Some(((tail, logprobs), frame)) = finished {
            if !tail.is_empty() || !logprobs.is_empty() {
                self.send(key.0, text_frame(key.1, tail, logprobs));
            }
            self.end(key, Ok(frame));
        }
    }
}

impl DecodeState {
    /// The state a request starts decoding in: its first step feeds the prompt's last token.
    pub(super) fn new(submit: &Submit) -> DecodeState {
        let requested = &submit.sampling;
        let sampling = SamplingParams {
            temperature: requested.temperature,
            top_k: requested.top_k as usize,
            top_p: requested.top_p,
            min_p: requested.min_p,
            presence_penalty: requested.presence_penalty,
            frequency_penalty: requested.frequency_penalty,
            repetition_penalty: requested.repetition_penalty,
            logit_bias: requested.logit_bias.clone(),
            seed: requested.seed,
        };
        let prompt_tokens = submit.prompt.len();
        DecodeState {
            sampler: Box::new(model::Sampler::new(sampling, &submit.prompt)),
            stops: model::StopMatcher::new(&submit.stop),
            pending_bytes: Vec::new(),
            generated: Vec::new(),
            logprobs: Vec::new(),
            constraint: match &requested.constraint {
                Some(shape) => Constrained::Pending(shape.clone()),
                None => Constrained::Free,
            },
            next_input: submit.prompt[prompt_tokens - 1],
            position: prompt_tokens - 1,
        }
    }

    /// Takes a sampled token (not an end): the text it completes that may be shown, and how
    /// the request finishes if this token ends it.
    fn push(
        &mut self,
        token: u32,
        token_bytes: &[u8],
        max_tokens: usize,
    ) -> (String, Option<Finish>) {
        self.generated.push(token);
        self.pending_bytes.extend_from_slice(token_bytes);
        let text = model::take_complete_utf8(&mut self.pending_bytes);
        let (shown, stopped) = self.stops.push(&text);
        self.next_input = token;
        self.position += 1;
        let finish = if stopped {
            Some(Finish::Stop)
        } else if self.generated.len() == max_tokens {
            Some(Finish::Length)
        } else {
            None
        };
        (shown, finish)
    }

    /// The text held back at the end: bytes of an incomplete character, and a tail that
    /// could still have begun a stop string.
    fn flush(&mut self) -> String {
        let mut tail = String::new();
        if !self.pending_bytes.is_empty() {
            let rest = String::from_utf8_lossy(&self.pending_bytes).into_owned();
            self.pending_bytes.clear();
            tail.push_str(&self.stops.push(&rest).0);
        }
        tail.push_str(&self.stops.finish());
        tail
    }
}

fn text_frame(request: RequestId, text: String, logprobs: Vec<TokenLogprob>) -> Frame {
    Frame::Text {
        request,
        text,
        logprobs,
    }
}
