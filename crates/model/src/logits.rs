//! What a forward step returns: next-token logits, one row per step that asked for them.

use std::ops::Index;

/// Next-token logits of the steps that asked for them, in step order: `len()` rows of
/// `vocab_size` values in one buffer. The output projection writes them in place; a `Vec` per
/// row cost a copy of every row into fresh memory, 3 % of a batch-16 decode step.
#[derive(Clone, Debug, PartialEq)]
pub struct Logits {
    values: Vec<f32>,
    vocab_size: usize,
}

impl Logits {
    /// Rows of `vocab_size` values, one after another.
    ///
    /// Panics if `values` is not a whole number of rows or `vocab_size` is 0.
    pub fn from_values(values: Vec<f32>, vocab_size: usize) -> Logits {
        assert!(vocab_size > 0, "a vocabulary");
        assert!(
            values.len().is_multiple_of(vocab_size),
            "whole rows of {vocab_size} logits"
        );
        Logits { values, vocab_size }
    }

    /// No rows (a step where no sequence asked for logits).
    pub fn none(vocab_size: usize) -> Logits {
        Logits::from_values(Vec::new(), vocab_size)
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.values.len() / self.vocab_size
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Row `index`, if there is one.
    pub fn get(&self, index: usize) -> Option<&[f32]> {
        self.rows().nth(index)
    }

    /// The last row, if any.
    pub fn last(&self) -> Option<&[f32]> {
        self.rows().next_back()
    }

    /// Moves rows `at..` into a `Logits` of their own, leaving rows `..at` here (a merged
    /// pass hands each caller its rows; the earliest part keeps the allocation).
    ///
    /// Panics if `at` is past the last row.
    pub(crate) fn split_off_rows(&mut self, at: usize) -> Logits {
        assert!(at <= self.len(), "row {at} of {} logit rows", self.len());
        let tail = self.values.split_off(at * self.vocab_size);
        Logits::from_values(tail, self.vocab_size)
    }

    /// The rows in order.
    pub fn rows(&self) -> std::slice::ChunksExact<'_, f32> {
        self.values.chunks_exact(self.vocab_size)
    }
}

impl Index<usize> for Logits {
    type Output = [f32];

    /// Row `index`; panics past the last row.
    fn index(&self, index: usize) -> &[f32] {
        assert!(
            index < self.len(),
            "row {index} of {} logit rows",
            self.len()
        );
        &self.values[index * self.vocab_size..][..self.vocab_size]
    }
}

impl<'a> IntoIterator for &'a Logits {
    type Item = &'a [f32];
    type IntoIter = std::slice::ChunksExact<'a, f32>;

    fn into_iter(self) -> Self::IntoIter {
        self.rows()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_come_back_in_order_and_bounds_are_checked() {
        let logits = Logits::from_values(vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 3);
        assert_eq!((logits.len(), logits.vocab_size()), (2, 3));
        assert_eq!(&logits[1], &[3.0, 4.0, 5.0]);
        assert_eq!(logits.get(0), Some(&[0.0, 1.0, 2.0][..]));
        assert_eq!(logits.get(2), None);
        assert_eq!(logits.last(), Some(&[3.0, 4.0, 5.0][..]));
        assert_eq!(logits.rows().count(), 2);
        let past_the_end = std::panic::catch_unwind(|| logits[2].len());
        assert!(past_the_end.is_err());
        assert!(Logits::none(3).is_empty() && Logits::none(3).last().is_none());
    }

    #[test]
    #[should_panic(expected = "whole rows")]
    fn a_partial_row_is_refused() {
        Logits::from_values(vec![0.0; 4], 3);
    }
}
