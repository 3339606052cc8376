//! What the checker judges in the prefix-cache model.

use kv::PageState;
use stateright::{Model, Property};

use super::worker::{Held, Worker};
use super::{
    event, Content, DecodePhase, PrefillPhase, PrefixSpec, PrefixState, RouterPhase, Tokens,
};

impl PrefixSpec {
    /// The live tables on each worker: (request, its tenant, its pages).
    fn tables<'s>(&self, state: &'s PrefixState) -> [Vec<(u8, u8, &'s Held)>; 2] {
        let mut prefill = Vec::new();
        let mut decode = Vec::new();
        for (r, entry) in state.requests.iter().enumerate() {
            let tenant = self.requests[r].tenant;
            if let PrefillPhase::Sent { held } = &entry.prefill {
                prefill.push((r as u8, tenant, held));
            }
            if let Some(held) = entry.decode.held() {
                decode.push((r as u8, tenant, held));
            }
        }
        [prefill, decode]
    }

    /// S3 on both workers.
    fn accounted(&self, state: &PrefixState) -> bool {
        let [prefill, decode] = self.tables(state);
        pages_accounted(&state.prefill, &prefill) && pages_accounted(&state.decode, &decode)
    }

    fn quiescent(state: &PrefixState) -> bool {
        state.net.is_empty()
            && state.requests.iter().all(|r| {
                matches!(r.router, RouterPhase::Idle | RouterPhase::Ended)
                    && r.decode == DecodePhase::Idle
                    && r.prefill == PrefillPhase::Idle
            })
    }

    /// No action is enabled: where a bounded run ends, and where liveness is judged.
    fn terminal(&self, state: &PrefixState) -> bool {
        if !state.net.is_empty() {
            return false;
        }
        let mut actions = Vec::new();
        self.actions(state, &mut actions);
        actions.is_empty()
    }

    /// Every pair of distinct requests.
    fn pairs(&self) -> impl Iterator<Item = (super::PrefixRequest, super::PrefixRequest)> + '_ {
        self.requests
            .iter()
            .enumerate()
            .flat_map(move |(i, &a)| self.requests[i + 1..].iter().map(move |&b| (a, b)))
    }

    /// Every property the checker judges, in the order it reports them.
    pub(super) fn property_list(&self) -> Vec<Property<Self>> {
        let mut properties = PrefixSpec::safety();
        properties.extend(PrefixSpec::liveness());
        properties.extend(self.reachability());
        properties
    }

    fn safety() -> Vec<Property<Self>> {
        vec![
            Property::always(
                "S1/I10 a request reads only its own pages and cached pages of its tenant",
                |_, s: &PrefixState| !s.ghost.read_foreign_page,
            ),
            Property::always(
                "S1 a request reads only its own tokens' KV, computed for its tenant",
                |_, s: &PrefixState| !s.ghost.read_foreign_kv,
            ),
            Property::always(
                "S1/I4 a request reads only written, uncorrupted KV",
                |_, s: &PrefixState| !s.ghost.read_corrupt,
            ),
            Property::always(
                "S2 a transfer is sealed only when every page decode reads is its own KV",
                |_, s: &PrefixState| !s.ghost.bad_commit,
            ),
            Property::always(
                "S3 a page is free, one request's, or cached with refcount = holders of its tenant",
                |m: &PrefixSpec, s: &PrefixState| m.accounted(s),
            ),
            Property::always(
                "S9/I10 a lookup returns only pages of the request's tenant",
                |_, s: &PrefixState| !s.ghost.lookup_foreign,
            ),
            Property::always(
                "S9/I12 every cached page holds the KV its key names",
                |_, s: &PrefixState| cache_true(&s.prefill) && cache_true(&s.decode),
            ),
            Property::always("no write lands in a shared page", |_, s: &PrefixState| {
                !s.ghost.wrote_shared
            }),
            Property::always(
                "S6 200 headers only after a verified commit",
                |_, s: &PrefixState| {
                    s.requests.iter().all(|r| {
                        r.router != RouterPhase::Streaming
                            || matches!(r.decode, DecodePhase::Decoding { .. })
                    })
                },
            ),
            Property::always(
                "S11/I6 at most one answer per request, and one once it ended",
                |_, s: &PrefixState| {
                    s.requests
                        .iter()
                        .all(|r| r.responses == u8::from(r.router == RouterPhase::Ended))
                },
            ),
            Property::always(
                "the engine's expectations hold (its tables verify and release)",
                |_, s: &PrefixState| !s.ghost.engine_panic,
            ),
        ]
    }

    /// Judged at terminal states: every path terminates. An unheld cached page may always be
    /// evicted, so a terminal state has empty caches, unless a refcount leaked.
    fn liveness() -> Vec<Property<Self>> {
        vec![
            Property::always(
                "L1 at every terminal state each request has ended with exactly one answer",
                |m: &PrefixSpec, s: &PrefixState| {
                    !m.terminal(s)
                        || s.requests
                            .iter()
                            .all(|r| r.router == RouterPhase::Ended && r.responses == 1)
                },
            ),
            Property::always(
                "L2 at every terminal state both pools are whole and nothing is held or cached",
                |m: &PrefixSpec, s: &PrefixState| {
                    !m.terminal(s)
                        || (PrefixSpec::quiescent(s)
                            && [&s.prefill, &s.decode].iter().all(|w| {
                                w.cache.is_empty() && w.pool.pages_free() == w.pool.headers().len()
                            }))
                },
            ),
        ]
    }

    /// Anti-vacuity: what the configuration makes possible does happen.
    fn reachability(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::sometimes(
                "R1 a request is answered from its own KV",
                |_, s: &PrefixState| s.events & event::COMPLETED != 0,
            ),
            Property::sometimes("a cached page is evicted", |_, s: &PrefixState| {
                s.events & event::EVICTED != 0
            }),
        ];
        let shares = |same_tenant: bool| {
            self.pairs().any(|(a, b)| {
                (a.tenant == b.tenant) == same_tenant
                    && a.prompt == b.prompt
                    && a.pages.min(b.pages) > 1
            })
        };
        if shares(true) {
            properties.push(Property::sometimes(
                "prefill reuses a cached page of the request's tenant",
                |_, s: &PrefixState| s.events & event::PREFILL_REUSED != 0,
            ));
            properties.push(Property::sometimes(
                "decode reuses cached pages, receives only the rest, and answers from them",
                |_, s: &PrefixState| s.events & event::DELTA_ANSWERED != 0,
            ));
            properties.push(Property::sometimes(
                "a cached page is held by two requests at once",
                |_, s: &PrefixState| s.events & event::SHARED_BY_TWO != 0,
            ));
        }
        if self.pairs().any(|(a, b)| {
            a.tenant == b.tenant
                && a.prompt == b.prompt
                && a.pages.min(b.pages) > 1
                && a.pages != b.pages
        }) {
            properties.push(Property::sometimes(
                "a request reuses a shorter cached prefix and publishes the pages after it",
                |_, s: &PrefixState| s.events & event::CHAIN_EXTENDED != 0,
            ));
        }
        if shares(false) {
            properties.push(Property::sometimes(
                "R7 a lookup passes over another tenant's cached copy of the same prefix",
                |_, s: &PrefixState| s.events & event::OTHER_TENANT_PASSED_OVER != 0,
            ));
        }
        if self.faults.corruptions > 0 {
            properties.push(Property::sometimes(
                "R5 a corruption is caught by the checksum",
                |_, s: &PrefixState| s.events & event::CORRUPTION_CAUGHT != 0,
            ));
        }
        if self.faults.misclaims > 0 {
            properties.push(Property::sometimes(
                "a Done that misstates decode's reuse is refused",
                |_, s: &PrefixState| s.events & event::MISCLAIM_REFUSED != 0,
            ));
        }
        properties
    }
}

/// S3 on one worker: the pool's own bookkeeping agrees; every cached page is sealed,
/// allocated to the request that computed it at the generation the entry names, in no table's
/// own pages, and held by exactly `refcount` live tables, all of the entry's tenant; every
/// other allocated page is the own page of exactly one live table, the one its header names;
/// every reference in a table names a cached page or one of its own.
fn pages_accounted(worker: &Worker, tables: &[(u8, u8, &Held)]) -> bool {
    if !worker.pool.consistent() {
        return false;
    }
    let owns = |held: &Held, page: u8, generation: u8| held.private.contains(&(page, generation));
    let mut cached_pages: Vec<u8> = worker.cache.iter().map(|e| e.page).collect();
    cached_pages.sort_unstable();
    if cached_pages.windows(2).any(|w| w[0] == w[1]) {
        return false;
    }
    let entries_ok = worker.cache.iter().all(|e| {
        let header = worker.pool.header(e.page);
        let holders: Vec<_> = tables
            .iter()
            .filter(|(_, _, held)| held.holds_shared(e.page, e.generation))
            .collect();
        header.owner == Some(e.owner)
            && header.generation == e.generation
            && header.state == PageState::Sealed
            && holders.len() == e.refcount as usize
            && holders
                .iter()
                .all(|&&(_, tenant, _)| tenant == e.key.tenant)
            && !tables
                .iter()
                .any(|(_, _, held)| owns(held, e.page, e.generation))
    });
    let pages_ok = worker
        .pool
        .headers()
        .iter()
        .enumerate()
        .filter(|&(page, h)| h.owner.is_some() && !cached_pages.contains(&(page as u8)))
        .all(|(page, h)| {
            let page = page as u8;
            let mut owners = tables
                .iter()
                .filter(|(_, _, held)| owns(held, page, h.generation));
            let only = owners.next().is_some_and(|&(r, _, _)| h.owner == Some(r));
            only && owners.next().is_none()
        });
    let tables_ok = tables.iter().all(|&(r, _, held)| {
        held.shared
            .iter()
            .all(|s| worker.entry(s.page, s.generation).is_some())
            && held.private.iter().all(|&(page, generation)| {
                let header = worker.pool.header(page);
                header.owner == Some(r) && header.generation == generation
            })
    });
    entries_ok && pages_ok && tables_ok
}

/// I12: a cached page holds exactly the KV of the tokens its key names, computed for the key's
/// tenant; nothing corrupt, unwritten or foreign.
fn cache_true(worker: &Worker) -> bool {
    worker.cache.iter().all(|e| {
        worker.content[e.page as usize]
            == Content::Kv {
                tokens: Tokens::Prefix {
                    prompt: e.key.prompt,
                    index: e.key.index,
                },
                tenant: e.key.tenant,
            }
    })
}
