//! Next-token choice: greedy, or temperature with top-k / top-p / min-p, after the penalties
//! and logit bias, from a seeded generator so a run with the same seed picks the same tokens.

use std::collections::{HashMap, HashSet};

/// How to pick tokens. The logits are first adjusted (repetition, frequency and presence
/// penalties, then the logit bias); then `temperature == 0` takes the argmax, and any other
/// temperature samples from the softmax of the logits over it, among the tokens that
/// `top_k`, `top_p` and `min_p` all keep.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p`; 1.0 keeps all.
    pub top_p: f32,
    /// Keep only tokens at least `min_p` times as likely as the most likely one; 0 keeps all.
    pub min_p: f32,
    /// OpenAI's: subtracted from the logit of every token generated so far.
    pub presence_penalty: f32,
    /// OpenAI's: subtracted from a token's logit once per time it was generated so far.
    pub frequency_penalty: f32,
    /// The CTRL paper's (as Hugging Face and vLLM apply it): a token of the prompt or the
    /// output so far has a positive logit divided by it, a negative one multiplied; 1 is off.
    pub repetition_penalty: f32,
    /// Added to the logits of these token ids (ids past the vocabulary are skipped).
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
}

impl SamplingParams {
    pub fn greedy() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }

    /// Whether a setting looks at the tokens seen so far.
    fn penalizes(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
    }

    /// Whether the logits must be adjusted before the choice.
    fn adjusts_logits(&self) -> bool {
        self.penalizes() || !self.logit_bias.is_empty()
    }
}

/// A sampler with its own random stream and the counts its penalties need.
pub struct Sampler {
    params: SamplingParams,
    rng: stats::SplitMix64,
    /// Times each token was picked; kept only when a penalty reads it.
    generated: HashMap<u32, u32>,
    /// The prompt's tokens; kept only for the repetition penalty.
    prompt: HashSet<u32>,
    /// The adjusted logits, reused from step to step.
    scratch: Vec<f32>,
}

impl Sampler {
    /// A sampler for a request whose prompt is `prompt` (read by the repetition penalty).
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Sampler {
        let rng = stats::SplitMix64::new(params.seed);
        let prompt = if params.repetition_penalty != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        Sampler {
            params,
            rng,
            generated: HashMap::new(),
            prompt,
            scratch: Vec::new(),
        }
    }

    /// Picks the next token from `logits`, and counts it as generated.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        assert!(!logits.is_empty(), "logits cover the vocabulary");
        let token = if self.params.adjusts_logits() {
            let mut adjusted = std::mem::take(&mut self.scratch);
            adjusted.clear();
            adjusted.extend_from_slice(logits);
            self.adjust(&mut adjusted);
            let token = self.choose(&adjusted);
            self.scratch = adjusted;
            token
        } else {
            self.choose(logits)
        };
        if self.params.penalizes() {
            *self.generated.entry(token).or_default() += 1;
        }
        token
    }

    /// Applies the penalties, then the bias.
    fn adjust(&self, logits: &mut [f32]) {
        let repetition = self.params.repetition_penalty;
        if repetition != 1.0 {
            let seen = self.prompt.iter().chain(
                self.generated
                    .keys()
                    .filter(|token| !self.prompt.contains(token)),
            );
            for &token in seen {
                if let Some(logit) = logits.get_mut(token as usize) {
                    *logit = if *logit > 0.0 {
                        *logit / repetition
                    } else {
                        *logit * repetition
                    };
                }
            }
        }
        let (presence, frequency) = (self.params.presence_penalty, self.params.frequency_penalty);
        if presence != 0.0 || frequency != 0.0 {
            for (&token, &count) in &self.generated {
                if let Some(logit) = logits.get_mut(token as usize) {
                    *logit -= presence + frequency * count as f32;
                }
            }
        }
        for &(token, bias) in &self.params.logit_bias {
            if let Some(logit) = logits.get_mut(token as usize) {
                *logit += bias;
            }
        }
    }

    /// Picks from logits already adjusted.
    fn choose(&mut self, logits: &[f32]) -> u32 {
        let temperature = self.params.temperature;
        // Greedy when asked, and when the temperature is too small to divide by.
        if !(temperature.is_finite() && temperature > 1e-6) {
            return argmax(logits);
        }
        let inv_temperature = 1.0 / temperature;
        // A NaN logit is never chosen (it would sort first and poison the weights).
        let mut candidates: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_nan())
            .map(|(id, &l)| (id as u32, l * inv_temperature))
            .collect();
        if candidates.is_empty() {
            return 0;
        }
        let by_logit_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1);
        let top_k = self.params.top_k;
        if top_k > 0 && top_k < candidates.len() {
            candidates.select_nth_unstable_by(top_k - 1, by_logit_desc);
            candidates.truncate(top_k);
        }
        candidates.sort_unstable_by(by_logit_desc);
        let max = candidates[0].1;
        let mut probs: Vec<f64> = candidates
            .iter()
            .map(|c| ((c.1 - max) as f64).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if self.params.top_p < 1.0 {
            let mut cumulative = 0.0;
            let keep = probs
                .iter()
                .position(|p| {
                    cumulative += p;
                    cumulative >= self.params.top_p as f64
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
        }
        if self.params.min_p > 0.0 {
            // Sorted: the first token is the most likely, and it always stays.
            let floor = probs[0] * self.params.min_p as f64;
            let keep = probs.iter().position(|&p| p < floor).unwrap_or(probs.len());
            probs.truncate(keep.max(1));
        }
        let kept: f64 = probs.iter().sum();
        let mut target = self.rng.unit() * kept;
        for (candidate, p) in candidates.iter().zip(&probs) {
            target -= p;
            if target < 0.0 {
                return candidate.0;
            }
        }
        candidates[probs.len() - 1].0
    }
}

/// `token`'s log-probability under `logits` (their log-softmax, summed in f64), and the `top`
/// most likely tokens' (most likely first; ties by lower id). NaN logits count as impossible.
pub fn logprobs(logits: &[f32], token: u32, top: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits
        .iter()
        .copied()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| ((l - max) as f64).exp())
        .sum();
    let log_total = max as f64 + sum.ln();
    let logprob = |id: u32| match logits.get(id as usize) {
        Some(&l) if !l.is_nan() => (l as f64 - log_total) as f32,
        _ => f32::NEG_INFINITY,
    };
    let mut ids: Vec<u32> = (0..logits.len() as u32)
        .filter(|&id| !logits[id as usize].is_nan())
        .collect();
    let likelier = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let top = top.min(ids.len());
    if top > 0 && top < ids.len() {
        ids.select_nth_unstable_by(top - 1, likelier);
    }
    ids.truncate(top);
    ids.sort_unstable_by(likelier);
    let top = ids.into_iter().map(|id| (id, logprob(id))).collect();
    (logprob(token), top)
}

/// The first index of the largest logit.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<usize> = None;
    for (i, &l) in logits.iter().enumerate() {
        if !l.is_nan() && best.is_none_or(|b| l > logits[b]) {
            best = Some(i);
        }
    }
    best.unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
            ..SamplingParams::greedy()
        }
    }

    fn sampler(params: SamplingParams) -> Sampler {
        Sampler::new(params, &[])
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut sampler = sampler(SamplingParams::greedy());
        assert_eq!(sampler.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_different_seed_differs() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let draw = |seed| {
            let mut s = sampler(params(1.0, 0, 1.0, seed));
            (0..50).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_cuts_the_tail() {
        let logits = [0.0, 5.0, 4.9, -3.0];
        let mut s = sampler(params(1.0, 1, 1.0, 3));
        assert!((0..20).all(|_| s.sample(&logits) == 1));
        // Token 3 holds ~0.02 % of the mass: top_p 0.9 must never pick it, nor token 0.
        let mut s = sampler(params(1.0, 0, 0.9, 3));
        assert!((0..500).all(|_| matches!(s.sample(&logits), 1 | 2)));
    }

    #[test]
    fn tiny_temperature_and_nan_logits_still_pick_the_best_token() {
        let logits = [1.0, 3.0, f32::NAN, 2.0];
        assert_eq!(argmax(&logits), 1);
        for temperature in [1e-40, 1e-7, f32::NAN, f32::INFINITY] {
            let mut s = sampler(params(temperature, 0, 1.0, 5));
            assert_eq!(s.sample(&logits), 1, "temperature {temperature}");
        }
        let mut s = sampler(params(0.5, 0, 1.0, 5));
        assert!(
            (0..200).all(|_| s.sample(&logits) != 2),
            "NaN is never sampled"
        );
    }

    #[test]
    fn temperature_sampling_follows_the_distribution() {
        let logits = [0.0, 2f32.ln()]; // p = 1/3, 2/3
        let mut s = sampler(params(1.0, 0, 1.0, 11));
        let ones = (0..3000).filter(|_| s.sample(&logits) == 1).count();
        assert!((1850..2150).contains(&ones), "got {ones} of 3000");
    }

    #[test]
    fn min_p_drops_tokens_far_below_the_best() {
        // p ≈ 0.49, 0.49, 0.018: min_p 0.1 keeps the first two only; 0 keeps all three.
        let logits = [5.0, 5.0, 1.7];
        let draw = |min_p| {
            let mut s = sampler(SamplingParams {
                min_p,
                ..params(1.0, 0, 1.0, 9)
            });
            (0..2000).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert!(!draw(0.1).contains(&2));
        assert!(draw(0.0).contains(&2));
        // min_p 1 keeps only the best (and any token tied with it).
        let mut s = sampler(SamplingParams {
            min_p: 1.0,
            ..params(1.0, 0, 1.0, 9)
        });
        assert!((0..200).all(|_| s.sample(&[4.0, 5.0, 4.9]) == 1));
        assert!(!draw(1.0).contains(&2));
    }

    #[test]
    fn logit_bias_steers_greedy_and_sampled_choices() {
        let logits = [1.0, 3.0, 2.0];
        let mut s = sampler(SamplingParams {
            logit_bias: vec![(1, -100.0), (7, 50.0)], // id 7 is past the vocabulary
            ..SamplingParams::greedy()
        });
        assert_eq!(s.sample(&logits), 2, "the biased-out best is skipped");
        let mut s = sampler(SamplingParams {
            logit_bias: vec![(1, -100.0)],
            ..params(1.5, 0, 1.0, 4)
        });
        assert!((0..500).all(|_| s.sample(&logits) != 1));
        let mut s = sampler(SamplingParams {
            logit_bias: vec![(0, 100.0)],
            ..params(1.0, 0, 1.0, 4)
        });
        assert!((0..100).all(|_| s.sample(&logits) == 0));
    }

    #[test]
    fn presence_and_frequency_penalties_count_generated_tokens() {
        // Greedy on flat logits would repeat token 0 forever; a presence penalty moves on to
        // a fresh token each step, and a negative one keeps repeating.
        let logits = [1.0, 0.9, 0.8, 0.7];
        let run = |presence, frequency| {
            let mut s = sampler(SamplingParams {
                presence_penalty: presence,
                frequency_penalty: frequency,
                ..SamplingParams::greedy()
            });
            (0..4).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(0.0, 0.0), [0, 0, 0, 0]);
        assert_eq!(run(1.0, 0.0), [0, 1, 2, 3]);
        assert_eq!(run(-1.0, 0.0), [0, 0, 0, 0]);
        // The frequency penalty grows with the count: 0 (1.0); 1 (0.9 beats 0's 0.85); 0 again
        // (0.85 beats 0.8 and 1's 0.75); then 2 (0.8 beats 0's 0.7).
        assert_eq!(run(0.0, 0.15), [0, 1, 0, 2]);
    }

    #[test]
    fn repetition_penalty_covers_the_prompt_and_the_output() {
        let logits = [2.0, 1.9, -1.0, 1.8];
        let params = SamplingParams {
            repetition_penalty: 1.2,
            ..SamplingParams::greedy()
        };
        // Token 0 is in the prompt: 2.0 / 1.2 < 1.9, so 1 wins, then 3 (1.9/1.2 < 1.8).
        let mut s = Sampler::new(params.clone(), &[0, 2]);
        assert_eq!([s.sample(&logits), s.sample(&logits)], [1, 3]);
        // Negative logits are multiplied (pushed further down), not divided.
        let mut s = Sampler::new(params, &[2]);
        let mut adjusted = logits.to_vec();
        s.adjust(&mut adjusted);
        assert_eq!(adjusted[2], -1.2);
        assert_eq!(s.sample(&logits), 0);
    }

    #[test]
    fn logprobs_are_the_log_softmax_and_the_top_tokens_in_order() {
        let logits = [0.0, 2f32.ln(), f32::NAN, 2f32.ln()]; // p = 1/5, 2/5, -, 2/5
        let (chosen, top) = logprobs(&logits, 0, 2);
        assert!((chosen - 0.2f32.ln()).abs() < 1e-6, "{chosen}");
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3]);
        assert!(
            top.iter().all(|t| (t.1 - 0.4f32.ln()).abs() < 1e-6),
            "{top:?}"
        );
        let (nan, all) = logprobs(&logits, 2, 10);
        assert_eq!(nan, f32::NEG_INFINITY);
        assert_eq!(all.len(), 3, "NaN is never a top token");
        let (_, none) = logprobs(&logits, 1, 0);
        assert!(none.is_empty());
        // Large logits: no overflow, the probabilities still sum to 1.
        let big: Vec<f32> = (0..1000).map(|i| 1e4 + i as f32 * 0.01).collect();
        let (_, every) = logprobs(&big, 0, 1000);
        let total: f64 = every.iter().map(|t| (t.1 as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-4, "{total}");
    }
}
