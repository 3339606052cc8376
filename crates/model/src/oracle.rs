//! The oracle: a tiny deterministic stand-in for the model, behind the same [`Forward`]
//! interface and the same checked road to K/V, whose output says exactly what it read.
//!
//! Each step writes, into the K and V slots of every position it runs, a record of who wrote
//! it (tenant), where (position), what (token) and in which phase (prompt chunk or decode
//! step), sealed with a check word. Each logits step then reads every slot of its sequence
//! and answers:
//! - when every slot is this tenant's own, at its own position, intact: the prompt echoed, one
//!   token per decode step (step `d` emits the token in slot `d`);
//! - otherwise: the tokens of the foreign, stale, corrupt or unwritten slots, in turn.
//!
//! So a test that knows its prompt knows the whole answer ([`OracleModel::expected`]), and any
//! read of a page that is not the request's own changes the output, exactly, with no
//! statistics; a foreign slot's token is echoed, so another tenant's marker shows in the text.

use crate::forward::{checked_views, mark_steps_written, Forward, LogitRows, SeqStep};
use crate::{Logits, Result};
use half::f16;
use kv::{KvKind, KvLayout, PagePool, PageView, TenantId};

/// Words per K (and per V) slot: the record below.
const HEAD_DIM: usize = 8;
const MAGIC: u16 = 0xA11C;
/// Logit of every token the oracle does not choose: any sampler picks the chosen one.
const UNCHOSEN: f32 = -1.0e9;

/// Whether a slot was written by a prompt chunk or by a decode (logits) step.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Prompt = 1,
    Decode = 2,
}

/// The oracle model; see the module docs.
#[derive(Clone, Debug)]
pub struct OracleModel {
    vocab_size: usize,
    context_length: usize,
}

/// What one slot holds, as the reader sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    own: bool,
    token: u32,
    decode: bool,
}

impl OracleModel {
    pub fn new(vocab_size: usize, context_length: usize) -> OracleModel {
        OracleModel {
            vocab_size,
            context_length,
        }
    }

    /// The tokens the oracle answers a request with when it reads only its own, intact KV:
    /// the prompt echoed from its start (then its own answer), `max_tokens` long, cut before
    /// the first `eos` (unless `ignore_eos`).
    pub fn expected(prompt: &[u32], max_tokens: usize, eos: u32, ignore_eos: bool) -> Vec<u32> {
        let mut sequence = prompt.to_vec();
        let mut answer = Vec::new();
        for step in 0..max_tokens {
            let token = sequence[step];
            if token == eos && !ignore_eos {
                break;
            }
            answer.push(token);
            sequence.push(token);
        }
        answer
    }

    fn record(tenant: TenantId, position: usize, token: u32, phase: Phase) -> [u16; HEAD_DIM] {
        let mut words = [
            MAGIC,
            tenant.0 as u16,
            (tenant.0 >> 16) as u16,
            position as u16,
            token as u16,
            (token >> 16) as u16,
            phase as u16,
            0,
        ];
        words[7] = check_word(&words[..7]);
        words
    }

    fn write(view: &mut PageView, position: usize, words: &[u16; HEAD_DIM]) {
        let page_size = view.layout().page_size_tokens;
        let (page, slot) = (position / page_size, position % page_size);
        let range = slot * HEAD_DIM..(slot + 1) * HEAD_DIM;
        // Keys dimension-major, values slot-major: the real model's page layout, which the
        // engine's blanking of unwritten slots follows.
        let keys = view.head_mut(page, 0, KvKind::Key, 0);
        for (d, &word) in words.iter().enumerate() {
            keys[kernels::key_index(page_size, slot, d)] = f16::from_bits(word);
        }
        let value = &mut view.head_mut(page, 0, KvKind::Value, 0)[range];
        for (dst, &word) in value.iter_mut().zip(words) {
            *dst = f16::from_bits(!word);
        }
    }

    fn read(view: &PageView, position: usize, reader: TenantId) -> Slot {
        let page_size = view.layout().page_size_tokens;
        let (page, slot) = (position / page_size, position % page_size);
        let range = slot * HEAD_DIM..(slot + 1) * HEAD_DIM;
        let keys = view.head(page, 0, KvKind::Key, 0);
        let key: Vec<u16> = (0..HEAD_DIM)
            .map(|d| keys[kernels::key_index(page_size, slot, d)].to_bits())
            .collect();
        let value_matches = view.head(page, 0, KvKind::Value, 0)[range]
            .iter()
            .zip(&key)
            .all(|(v, k)| v.to_bits() == !k);
        let tenant = u64::from(key[1]) | (u64::from(key[2]) << 16);
        let token = u32::from(key[4]) | (u32::from(key[5]) << 16);
        let own = key[0] == MAGIC
            && key[7] == check_word(&key[..7])
            && value_matches
            && tenant == reader.0 & 0xFFFF_FFFF
            && usize::from(key[3]) == position & 0xFFFF;
        Slot {
            own,
            token,
            decode: key[6] == Phase::Decode as u16,
        }
    }

    /// The answer to one logits step that has `slots` to read (see the module docs).
    fn choose(&self, slots: &[Slot]) -> u32 {
        let decode_steps = slots.iter().filter(|s| s.own && s.decode).count();
        let step = decode_steps.saturating_sub(1);
        let foreign: Vec<&Slot> = slots.iter().filter(|s| !s.own).collect();
        let token = if foreign.is_empty() {
            slots[step].token
        } else {
            foreign[step % foreign.len()].token
        };
        // A garbage word pair can name a token past the vocabulary; fold it in.
        token % self.vocab_size as u32
    }
}

impl Forward for OracleModel {
    fn forward(&self, pool: &mut PagePool, steps: &[SeqStep]) -> Result<Logits> {
        if steps.is_empty() {
            return Ok(Logits::none(self.vocab_size));
        }
        let layout = self.kv_layout(pool.layout().page_size_tokens);
        let mut views = checked_views(pool, steps, self.vocab_size, self.context_length, layout)?;
        let mut logits = Vec::new();
        for (step, view) in steps.iter().zip(views.iter_mut()) {
            let tenant = view.owner().tenant;
            let phase = match step.logits {
                LogitRows::Last => Phase::Decode,
                LogitRows::None | LogitRows::Every => Phase::Prompt,
            };
            for (i, &token) in step.tokens.iter().enumerate() {
                let position = step.start_pos + i;
                Self::write(
                    view,
                    position,
                    &Self::record(tenant, position, token, phase),
                );
            }
            if step.logits == LogitRows::Every {
                // Prompt rows name the token each row read: enough to count them.
                for &token in step.tokens {
                    let row = logits.len();
                    logits.resize(row + self.vocab_size, UNCHOSEN);
                    logits[row + (token as usize % self.vocab_size)] = 0.0;
                }
            }
            if step.logits == LogitRows::Last {
                let end = step.start_pos + step.tokens.len();
                let slots: Vec<Slot> = (0..end).map(|p| Self::read(view, p, tenant)).collect();
                let row = logits.len();
                logits.resize(row + self.vocab_size, UNCHOSEN);
                logits[row + self.choose(&slots) as usize] = 0.0;
            }
        }
        mark_steps_written(steps, &mut views);
        Ok(Logits::from_values(logits, self.vocab_size))
    }

    fn kv_layout(&self, page_size_tokens: usize) -> KvLayout {
        KvLayout {
            layer_count: 1,
            kv_head_count: 1,
            head_dim: HEAD_DIM,
            page_size_tokens,
        }
    }

    fn weight_bytes(&self) -> usize {
        0
    }
}

/// A check word over a record, so a flipped bit anywhere in it is seen.
fn check_word(words: &[u16]) -> u16 {
    let mut hash: u32 = 0x811C_9DC5;
    for &word in words {
        hash = (hash ^ u32::from(word)).wrapping_mul(0x0100_0193);
    }
    (hash ^ (hash >> 16)) as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv::{Owner, PoolConfig, PoolSize, RequestId};

    fn pool(tokens: usize) -> PagePool {
        PagePool::new(PoolConfig {
            layout: OracleModel::new(100, 64).kv_layout(4),
            size: PoolSize::Tokens(tokens),
            scrub_on_free: false,
        })
        .expect("pool")
    }

    fn owner(tenant: u64, request: u64) -> Owner {
        Owner {
            tenant: TenantId(tenant),
            request: RequestId(request),
        }
    }

    /// Prefill `prompt[..n-1]`, then decode `max_tokens` steps, as the engine does.
    fn run(
        model: &OracleModel,
        pool: &mut PagePool,
        table: &kv::PageTable,
        prompt: &[u32],
        max_tokens: usize,
    ) -> Vec<u32> {
        let n = prompt.len();
        model
            .forward(
                pool,
                &[SeqStep {
                    table,
                    tokens: &prompt[..n - 1],
                    start_pos: 0,
                    logits: crate::LogitRows::None,
                }],
            )
            .expect("prefill");
        let mut input = prompt[n - 1];
        let mut out = Vec::new();
        for i in 0..max_tokens {
            let logits = model
                .forward(
                    pool,
                    &[SeqStep {
                        table,
                        tokens: std::slice::from_ref(&input),
                        start_pos: n - 1 + i,
                        logits: crate::LogitRows::Last,
                    }],
                )
                .expect("decode");
            input = crate::sampling::argmax(&logits[0]);
            out.push(input);
        }
        out
    }

    #[test]
    fn own_kv_echoes_the_prompt_and_matches_expected() {
        let model = OracleModel::new(100, 64);
        let mut pool = pool(32);
        let prompt = [5, 6, 7, 8, 9, 10];
        let table = pool.allocate(owner(1, 1), 16).expect("pages");
        let out = run(&model, &mut pool, &table, &prompt, 8);
        assert_eq!(out, OracleModel::expected(&prompt, 8, 99, false));
        assert_eq!(&out[..6], &prompt);
        assert_eq!(&out[6..], &prompt[..2]);
    }

    #[test]
    fn expected_stops_at_eos() {
        assert_eq!(OracleModel::expected(&[4, 2, 9], 5, 2, false), vec![4]);
        assert_eq!(OracleModel::expected(&[4, 2, 9], 3, 2, true), vec![4, 2, 9]);
    }

    #[test]
    fn another_tenants_stale_kv_is_echoed_not_hidden() {
        let model = OracleModel::new(100, 64);
        let mut pool = pool(8);
        // Tenant 1 writes its prompt, then frees the pages (not scrubbed).
        let victim = pool.allocate(owner(1, 1), 8).expect("pages");
        run(&model, &mut pool, &victim, &[40, 41, 42, 43, 44], 1);
        pool.release(victim).expect("release");
        // Tenant 2 gets the same pages and reads slots it never wrote, as a reader that
        // trusted a lying transfer would: mark them written without writing.
        let reader = pool.allocate(owner(2, 2), 8).expect("pages");
        pool.verify_batch(&[&reader]).expect("own pages")[0].mark_written(4);
        let logits = model
            .forward(
                &mut pool,
                &[SeqStep {
                    table: &reader,
                    tokens: &[7],
                    start_pos: 4,
                    logits: crate::LogitRows::Last,
                }],
            )
            .expect("step");
        assert_eq!(crate::sampling::argmax(&logits[0]), 40, "victim's token");
    }

    #[test]
    fn a_flipped_bit_in_kv_changes_the_answer() {
        let model = OracleModel::new(100, 64);
        let prompt = [11, 12, 13, 14, 15];
        let expected = OracleModel::expected(&prompt, 1, 99, false);
        for word in 0..HEAD_DIM * 2 {
            let mut pool = pool(8);
            let table = pool.allocate(owner(3, 1), 8).expect("pages");
            model
                .forward(
                    &mut pool,
                    &[SeqStep {
                        table: &table,
                        tokens: &prompt[..4],
                        start_pos: 0,
                        logits: crate::LogitRows::None,
                    }],
                )
                .expect("prefill");
            {
                let mut views = pool.verify_batch(&[&table]).expect("own");
                let kind = if word < HEAD_DIM {
                    KvKind::Key
                } else {
                    KvKind::Value
                };
                // Slot 2 of page 0: flip one bit of one word.
                let page_size = views[0].layout().page_size_tokens;
                let head = views[0].head_mut(0, 0, kind, 0);
                let at = match kind {
                    KvKind::Key => kernels::key_index(page_size, 2, word),
                    KvKind::Value => 2 * HEAD_DIM + word % HEAD_DIM,
                };
                head[at] = f16::from_bits(head[at].to_bits() ^ 0x0100);
            }
            let logits = model
                .forward(
                    &mut pool,
                    &[SeqStep {
                        table: &table,
                        tokens: &prompt[4..],
                        start_pos: 4,
                        logits: crate::LogitRows::Last,
                    }],
                )
                .expect("step");
            let got = crate::sampling::argmax(&logits[0]);
            assert_ne!(got, expected[0], "word {word}: a flipped bit went unseen");
        }
    }
}
