//! Admission: a submit is checked before it is queued (I3), and queued requests get their
//! pages in arrival order, starting with the full prompt pages this worker has cached for the
//! request's tenant and partition (I10), and evicting unreferenced cached pages when short.

use super::send::{Checksummer, Stream};
use super::{failed, Engine, LinkId, Phase, Request, Stage};
use kv::{CachedPrefix, Owner, PageState, RequestId};
use std::time::Instant;
use transfer::{Failure, Frame, Inbound, Plan, Role, Submit, TransferId};

impl Engine {
    /// Admission (I3), re-checked here whatever the router decided: a request that can never
    /// fit is refused before any page is allocated.
    pub(super) fn submit(&mut self, link: LinkId, submit: Submit, peer: Option<LinkId>) {
        let key = (link, submit.request);
        if let Err((failure, message)) = self.admissible(&submit) {
            self.send(link, failed(submit.request, failure, message));
            return;
        }
        let transfer_taken = plan_transfer(&submit.plan).is_some_and(|t| {
            self.inbound.contains_key(&t)
                || self.outbound.contains_key(&t)
                || self
                    .requests
                    .values()
                    .any(|r| plan_transfer(&r.submit.plan) == Some(t))
        });
        if self.requests.contains_key(&key) || transfer_taken {
            let message = format!(
                "request {} (or its transfer) is already running",
                submit.request.0
            );
            self.send(link, failed(submit.request, Failure::BadRequest, message));
            return;
        }
        if self.is_draining() {
            let message = format!(
                "worker {} is shutting down; retry on another worker",
                self.config.name
            );
            self.send(link, failed(submit.request, Failure::Overloaded, message));
            return;
        }
        if self.queue.len() >= self.config.queue_max {
            let message = format!(
                "worker {} has {} requests waiting for KV pages; retry later",
                self.config.name,
                self.queue.len()
            );
            self.send(link, failed(submit.request, Failure::Overloaded, message));
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let owner = Owner {
            tenant: submit.tenant,
            request: RequestId(seq),
        };
        self.requests.insert(
            key,
            Request {
                submit,
                owner,
                arrived: Instant::now(),
                received_at: std::time::SystemTime::now(),
                seq,
                peer,
                reported: false,
                cached_tokens: 0,
                phase: Phase::Queued,
            },
        );
        self.queue.push_back(key);
        self.admit_queued();
    }

    /// Who computes the checksum of a transfer to `peer`: its link's writer where it hashes,
    /// but the engine under fault plans that reshape transfers, so that their planted
    /// corruption is hashed as the uncorrupted page.
    fn checksummer(&self, peer: Option<LinkId>) -> Checksummer {
        let link = peer.and_then(|peer| self.links.get(&peer));
        match link {
            _ if self.config.faults.reshapes_transfers() => Checksummer::Engine,
            Some(link) if link.one_sided => Checksummer::OneSidedWriter,
            Some(link) => match &link.sender_hashes {
                Some(hashes) => Checksummer::FramedWriter(hashes.clone()),
                None => Checksummer::Engine,
            },
            None => Checksummer::Engine,
        }
    }

    fn admissible(&self, submit: &Submit) -> Result<(), (Failure, String)> {
        let prompt_tokens = submit.prompt.len();
        if prompt_tokens == 0 {
            return Err((Failure::BadRequest, "the prompt is empty".into()));
        }
        let vocab = self.tokenizer.vocab_size();
        if let Some(&token) = submit.prompt.iter().find(|&&t| t as usize >= vocab) {
            let message = format!("prompt token {token} is outside the vocabulary of {vocab}");
            return Err((Failure::BadRequest, message));
        }
        if submit.max_tokens == 0 {
            return Err((Failure::BadRequest, "max_tokens must be at least 1".into()));
        }
        let plan_ok = matches!(
            (&submit.plan, self.config.role),
            (Plan::Unified, Role::Unified)
                | (Plan::Prefill { .. }, Role::Prefill)
                | (Plan::Decode { .. }, Role::Decode)
        );
        if !plan_ok {
            let message = format!("a {:?} worker cannot run this plan", self.config.role);
            return Err((Failure::BadRequest, message));
        }
        let max_tokens = submit.max_tokens as usize;
        let total = prompt_tokens + max_tokens;
        let context_length = self.config.context_length;
        if total > context_length {
            let message = format!(
                "this request needs {total} tokens ({prompt_tokens} in the prompt + \
                 {max_tokens} max_tokens), over the context length of {context_length}; \
                 shorten the prompt or lower max_tokens"
            );
            return Err((Failure::ContextLengthExceeded, message));
        }
        let needed = tokens_needed(submit);
        let capacity = self.pool.capacity_tokens();
        if needed > capacity && self.config.faults.admission_checked() {
            let message = format!(
                "this request needs {needed} tokens of KV on worker {}, whose whole pool \
                 holds {capacity}; shorten the prompt or lower max_tokens",
                self.config.name
            );
            return Err((Failure::PoolTooSmall, message));
        }
        Ok(())
    }

    /// Gives pages to queued requests in arrival order; the first that does not fit waits
    /// (and so do those behind it: a big request is not starved by small ones).
    pub(super) fn admit_queued(&mut self) {
        while let Some(&key) = self.queue.front() {
            let request = self
                .requests
                .get_mut(&key)
                .expect("queued keys are live requests: end() unqueues");
            let mut needed = tokens_needed(&request.submit);
            let is_prefill = matches!(request.submit.plan, Plan::Prefill { .. });
            let placeholder =
                is_prefill && needed > self.pool.capacity_tokens() && self.config.faults.incident();
            if placeholder {
                // The incident, planted: the prompt can never fit, so run a one-token
                // placeholder and let `Done` claim the whole prompt.
                needed = 1;
            }
            // A request that wants its prompt's log-probabilities computes every token.
            let scores_prompt = request.submit.sampling.prompt_logprobs;
            let prefix = match request.submit.prefix_cache {
                Some(partition) if !placeholder && !scores_prompt => {
                    let prompt = &request.submit.prompt;
                    let kv_tokens = &prompt[..prompt.len() - 1];
                    let owner = request.owner;
                    self.cache
                        .lookup(owner.tenant, partition, kv_tokens, &self.pool)
                }
                _ => CachedPrefix::none(request.owner.tenant),
            };
            let Some(table) = self.allocate(key, &prefix, needed) else {
                return;
            };
            self.queue.pop_front();
            let peer = self.requests.get(&key).and_then(|request| request.peer);
            let checksummer = self.checksummer(peer);
            let request = self
                .requests
                .get_mut(&key)
                .expect("queued keys are live requests: end() unqueues");
            if placeholder {
                tracing::warn!("fault injection: incident placeholder for a prompt over the pool");
            }
            let cached_tokens = table.shared_pages() * self.pool.layout().page_size_tokens;
            request.cached_tokens = cached_tokens;
            let prompt_tokens = request.submit.prompt.len();
            let stage = match request.submit.plan {
                Plan::Unified | Plan::Prefill { .. } => Stage::Prefilling {
                    done: cached_tokens,
                    target: if placeholder {
                        1.min(prompt_tokens - 1)
                    } else {
                        prompt_tokens - 1
                    },
                    placeholder,
                    stream: Stream::open(
                        &request.submit,
                        request.peer,
                        self.pool.layout(),
                        self.config.faults.reshapes_transfers(),
                        checksummer,
                    ),
                },
                Plan::Decode { transfer } => {
                    self.pool
                        .set_state(&table, PageState::Receiving)
                        .expect("fresh pages go Writing -> Receiving");
                    self.inbound.insert(transfer, key);
                    let layout = self.pool.layout();
                    let inbound = Inbound::new(
                        transfer,
                        request.submit.request,
                        request.submit.tenant,
                        (prompt_tokens - 1) as u32,
                        layout.page_size_tokens as u32,
                        layout.page_bytes(),
                        table.shared_pages() as u32,
                    );
                    // The pages the transfer fills are lent to its reservation: the link's
                    // reader writes them, and nothing else can until it is closed or dropped.
                    let leases = self
                        .pool
                        .lend_for_receive(
                            &table,
                            inbound.held_pages() as usize..inbound.page_count() as usize,
                        )
                        .expect("a fresh reservation's own pages lend");
                    self.grants.open(inbound, leases);
                    Stage::Receiving {
                        transfer,
                        since: Instant::now(),
                    }
                }
            };
            let nothing_to_prefill =
                matches!(stage, Stage::Prefilling { done, target, .. } if done == target);
            let cached_pages = table.shared_pages() as u32;
            request.phase = Phase::Admitted { table, stage };
            self.send(
                key.0,
                Frame::Admitted {
                    request: key.1,
                    cached_tokens: cached_tokens as u32,
                    cached_pages,
                },
            );
            if nothing_to_prefill {
                self.prefilled(key);
            }
        }
    }
}

/// KV tokens this worker holds for the request.
fn tokens_needed(submit: &Submit) -> usize {
    match submit.plan {
        Plan::Prefill { .. } => submit.prompt.len() - 1,
        Plan::Unified | Plan::Decode { .. } => submit.prompt.len() + submit.max_tokens as usize,
    }
}

fn plan_transfer(plan: &Plan) -> Option<TransferId> {
    match plan {
        Plan::Prefill { transfer, .. } | Plan::Decode { transfer } => Some(*transfer),
        Plan::Unified => None,
    }
}
