//! Byte-pair merging of one pre-tokenized word.
//!
//! Same algorithm as llama.cpp's `llm_tokenizer_bpe_session`: start from one
//! symbol per byte, then repeatedly apply the lowest-ranked merge among
//! adjacent pairs, leftmost first on ties, until no pair has a merge. Pairs
//! are looked up by token id in a hash map, and a binary heap holds candidate
//! pairs, so a word of `n` bytes costs `O(n log n)`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Marks a byte whose byte-level character is missing from the vocabulary:
/// it never merges and is dropped from the output (as llama.cpp drops it).
pub(crate) const NO_TOKEN: u32 = u32::MAX;

/// A multiplicative hash for `(u32, u32)` keys; the keys come from the model
/// file, not from users, so a DoS-resistant hash buys nothing here.
#[derive(Default)]
pub(crate) struct PairHasher(u64);

impl Hasher for PairHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// Merge rules: `(left id, right id)` to `(rank, merged id)`.
#[derive(Debug, Clone, Default)]
pub(crate) struct Merges {
    map: HashMap<u64, (u32, u32), BuildHasherDefault<PairHasher>>,
}

fn key(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

impl Merges {
    /// Adds a rule unless the pair already has one (the first, lowest rank
    /// wins, as in llama.cpp).
    pub(crate) fn insert(&mut self, left: u32, right: u32, rank: u32, merged: u32) {
        self.map.entry(key(left, right)).or_insert((rank, merged));
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    fn get(&self, left: u32, right: u32) -> Option<(u32, u32)> {
        self.map.get(&key(left, right)).copied()
    }
}

/// Scratch space reused across the words of one `encode` call.
#[derive(Default)]
pub(crate) struct Session {
    ids: Vec<u32>,
    next: Vec<usize>,
    prev: Vec<usize>,
    alive: Vec<bool>,
    /// `(rank, left position, left id, right id)`, smallest first.
    heap: BinaryHeap<Reverse<(u32, usize, u32, u32)>>,
}

const NONE: usize = usize::MAX;

impl Session {
    /// Merges `symbols` (one token id per byte of the word) and appends the
    /// resulting ids to `out`.
    pub(crate) fn merge(&mut self, symbols: &[u32], merges: &Merges, out: &mut Vec<u32>) {
        if symbols.len() < 2 {
            out.extend(symbols.iter().copied().filter(|&id| id != NO_TOKEN));
            return;
        }
        let n = symbols.len();
        self.ids.clear();
        self.ids.extend_from_slice(symbols);
        self.next.clear();
        self.next
            .extend((1..=n).map(|i| if i < n { i } else { NONE }));
        self.prev.clear();
        self.prev
            .extend((0..n).map(|i| i.checked_sub(1).unwrap_or(NONE)));
        self.alive.clear();
        self.alive.resize(n, true);
        self.heap.clear();
        for left in 0..n - 1 {
            self.push_pair(left, merges);
        }

        while let Some(Reverse((_, left, left_id, right_id))) = self.heap.pop() {
            let right = self.next[left];
            // Skip pairs made stale by an earlier merge.
            if !self.alive[left]
                || right == NONE
                || self.ids[left] != left_id
                || self.ids[right] != right_id
            {
                continue;
            }
            let Some((_, merged)) = merges.get(left_id, right_id) else {
                continue;
            };
            self.ids[left] = merged;
            self.alive[right] = false;
            let after = self.next[right];
            self.next[left] = after;
            if after != NONE {
                self.prev[after] = left;
            }
            let before = self.prev[left];
            if before != NONE {
                self.push_pair(before, merges);
            }
            self.push_pair(left, merges);
        }

        let mut pos = 0;
        while pos != NONE {
            if self.ids[pos] != NO_TOKEN {
                out.push(self.ids[pos]);
            }
            pos = self.next[pos];
        }
    }

    /// Queues the pair starting at `left` if it has a merge rule.
    fn push_pair(&mut self, left: usize, merges: &Merges) {
        let right = self.next[left];
        if right == NONE {
            return;
        }
        let (l, r) = (self.ids[left], self.ids[right]);
        if let Some((rank, _)) = merges.get(l, r) {
            self.heap.push(Reverse((rank, left, l, r)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Vocabulary: a=0 b=1 c=2 ab=3 bc=4 abc=5.
    fn merges(rules: &[(u32, u32, u32)]) -> Merges {
        let mut m = Merges::default();
        for (rank, &(l, r, merged)) in rules.iter().enumerate() {
            m.insert(l, r, rank as u32, merged);
        }
        m
    }

    fn run(symbols: &[u32], m: &Merges) -> Vec<u32> {
        let mut out = Vec::new();
        Session::default().merge(symbols, m, &mut out);
        out
    }

    #[test]
    fn lowest_rank_first() {
        let m = merges(&[(1, 2, 4), (0, 1, 3), (0, 4, 5)]);
        // "abc": bc (rank 0) before ab (rank 1), then a+bc.
        assert_eq!(run(&[0, 1, 2], &m), [5]);
        let m = merges(&[(0, 1, 3), (1, 2, 4)]);
        assert_eq!(run(&[0, 1, 2], &m), [3, 2]);
    }

    #[test]
    fn leftmost_on_ties() {
        // "aaa" with a+a=ab(3): the left pair merges first.
        let m = merges(&[(0, 0, 3)]);
        assert_eq!(run(&[0, 0, 0], &m), [3, 0]);
        assert_eq!(run(&[0, 0, 0, 0], &m), [3, 3]);
    }

    #[test]
    fn missing_bytes_are_dropped_and_never_merge() {
        let m = merges(&[(0, 1, 3)]);
        assert_eq!(run(&[0, NO_TOKEN, 1], &m), [0, 1]);
        assert_eq!(run(&[NO_TOKEN], &m), Vec::<u32>::new());
        assert_eq!(run(&[], &m), Vec::<u32>::new());
    }

    #[test]
    fn first_rule_for_a_pair_wins() {
        let mut m = Merges::default();
        m.insert(0, 1, 0, 3);
        m.insert(0, 1, 1, 5);
        assert_eq!(m.len(), 1);
        assert_eq!(run(&[0, 1], &m), [3]);
    }
}
