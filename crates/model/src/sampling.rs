//! Next-token choice: greedy, or temperature with top-k / top-p, from a seeded generator so a
//! run with the same seed picks the same tokens.

/// How to pick tokens. `temperature == 0` is greedy (argmax), ignoring the rest.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p`; 1.0 keeps all.
    pub top_p: f32,
    pub seed: u64,
}

impl SamplingParams {
    pub fn greedy() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// A sampler with its own random stream.
pub struct Sampler {
    params: SamplingParams,
    rng: stats::SplitMix64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = stats::SplitMix64::new(params.seed);
        Sampler { params, rng }
    }

    /// Picks the next token from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        assert!(!logits.is_empty(), "logits cover the vocabulary");
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
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut sampler = Sampler::new(SamplingParams::greedy());
        assert_eq!(sampler.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_different_seed_differs() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let draw = |seed| {
            let mut s = Sampler::new(params(1.0, 0, 1.0, seed));
            (0..50).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_cuts_the_tail() {
        let logits = [0.0, 5.0, 4.9, -3.0];
        let mut s = Sampler::new(params(1.0, 1, 1.0, 3));
        assert!((0..20).all(|_| s.sample(&logits) == 1));
        // Token 3 holds ~0.02 % of the mass: top_p 0.9 must never pick it, nor token 0.
        let mut s = Sampler::new(params(1.0, 0, 0.9, 3));
        assert!((0..500).all(|_| matches!(s.sample(&logits), 1 | 2)));
    }

    #[test]
    fn tiny_temperature_and_nan_logits_still_pick_the_best_token() {
        let logits = [1.0, 3.0, f32::NAN, 2.0];
        assert_eq!(argmax(&logits), 1);
        for temperature in [1e-40, 1e-7, f32::NAN, f32::INFINITY] {
            let mut s = Sampler::new(params(temperature, 0, 1.0, 5));
            assert_eq!(s.sample(&logits), 1, "temperature {temperature}");
        }
        let mut s = Sampler::new(params(0.5, 0, 1.0, 5));
        assert!(
            (0..200).all(|_| s.sample(&logits) != 2),
            "NaN is never sampled"
        );
    }

    #[test]
    fn temperature_sampling_follows_the_distribution() {
        let logits = [0.0, 2f32.ln()]; // p = 1/3, 2/3
        let mut s = Sampler::new(params(1.0, 0, 1.0, 11));
        let ones = (0..3000).filter(|_| s.sample(&logits) == 1).count();
        assert!((1850..2150).contains(&ones), "got {ones} of 3000");
    }
}
