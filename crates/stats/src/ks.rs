//! The two-sample Kolmogorov–Smirnov test: are two samples drawn from one distribution?
//! The canary's timing audit (TEST-MATRIX I07) asks it of time-to-first-token samples.

use crate::order::sorted;

/// The statistic and its p-value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KsTest {
    /// D: the largest distance between the two empirical distribution functions (0 to 1).
    pub statistic: f64,
    /// Two-sided, from the asymptotic Kolmogorov distribution with Stephens' correction for
    /// small samples: `Q((√n_e + 0.12 + 0.11/√n_e) · D)` with `n_e = n·m/(n+m)`, as Numerical
    /// Recipes gives it. Good to a few per cent of p for n_e ≥ 4, which is all an audit needs.
    pub p_value: f64,
}

/// The two-sample KS test of `a` against `b`; both NaN when either sample is empty. Ties,
/// within a sample or across the two, are handled: both distribution functions step past a
/// shared value before they are compared.
pub fn ks_two_sample(a: &[f64], b: &[f64]) -> KsTest {
    if a.is_empty() || b.is_empty() {
        return KsTest {
            statistic: f64::NAN,
            p_value: f64::NAN,
        };
    }
    let (a, b) = (sorted(a), sorted(b));
    let (n, m) = (a.len() as f64, b.len() as f64);
    let (mut i, mut j, mut statistic) = (0, 0, 0.0f64);
    while i < a.len() && j < b.len() {
        let value = if a[i].total_cmp(&b[j]).is_le() {
            a[i]
        } else {
            b[j]
        };
        while i < a.len() && a[i].total_cmp(&value).is_eq() {
            i += 1;
        }
        while j < b.len() && b[j].total_cmp(&value).is_eq() {
            j += 1;
        }
        statistic = statistic.max((i as f64 / n - j as f64 / m).abs());
    }
    let root = (n * m / (n + m)).sqrt();
    KsTest {
        statistic,
        p_value: kolmogorov_survival((root + 0.12 + 0.11 / root) * statistic),
    }
}

/// Q(λ) = P(K > λ) of the Kolmogorov distribution: 1 at 0, falling to 0. Each of its two
/// series converges in a few terms on its side of 1.18, so both are used.
pub fn kolmogorov_survival(lambda: f64) -> f64 {
    if lambda.is_nan() {
        return f64::NAN;
    }
    if lambda <= 0.0 {
        return 1.0;
    }
    let p = if lambda < 1.18 {
        // 1 − √(2π)/λ · Σ exp(−(2k−1)²π²/(8λ²)), k ≥ 1.
        let x = -std::f64::consts::PI.powi(2) / (8.0 * lambda * lambda);
        let sum: f64 = (1..=8)
            .map(|k| f64::from(2 * k - 1))
            .map(|odd| (odd * odd * x).exp())
            .sum();
        1.0 - (2.0 * std::f64::consts::PI).sqrt() / lambda * sum
    } else {
        // 2 Σ (−1)^(k−1) exp(−2k²λ²), k ≥ 1.
        (1..=12)
            .map(|k| {
                let sign = if k % 2 == 1 { 2.0 } else { -2.0 };
                sign * (-2.0 * f64::from(k * k) * lambda * lambda).exp()
            })
            .sum()
    };
    p.clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(got: f64, want: f64, relative: f64) {
        assert!(
            (got - want).abs() <= relative * want.abs(),
            "got {got:e}, want {want:e}"
        );
    }

    #[test]
    fn kolmogorov_survival_matches_scipy_on_both_sides_of_the_switch() {
        // scipy.special.kolmogorov(x), scipy 1.17.
        for (lambda, want) in [
            (0.3, 0.999_990_694_198_665_5),
            (0.5, 0.963_945_243_664_875_1),
            (1.0, 0.269_999_671_677_354_56),
            (1.18, 0.123_453_809_429_765_7),
            (1.5, 0.022_217_962_616_525_127),
            (2.0, 6.709_252_557_796_953e-4),
            (3.0, 3.045_995_948_942_526e-8),
            (5.0, 3.857_499_695_927_835_6e-22),
        ] {
            close(kolmogorov_survival(lambda), want, 1e-9);
        }
        assert_eq!(kolmogorov_survival(0.0), 1.0);
        assert_eq!(kolmogorov_survival(0.1), 1.0);
        assert!(kolmogorov_survival(f64::NAN).is_nan());
    }

    #[test]
    fn two_samples_match_scipy_with_stephens_correction() {
        // D from scipy.stats.ks_2samp; p = scipy.stats.kstwobign.sf((√n_e + 0.12 +
        // 0.11/√n_e)·D).
        let a = [
            0.61, 0.29, 0.06, 0.59, -1.73, -0.74, 0.51, -0.56, 0.39, 1.64, 0.05, -0.06, 0.64,
            -0.82, 0.37, 1.77, 1.09, -1.28, 2.36, 1.31, 1.05, -0.32, -0.4, 1.06, -2.47,
        ];
        let b = [
            2.2, 1.66, 1.38, 0.2, 0.36, 0.0, 0.96, 1.56, 0.44, 1.5, -0.3, 0.66, 2.31, 3.29, -0.27,
            -0.37, 0.38, 0.7, 0.52, -0.11,
        ];
        let test = ks_two_sample(&a, &b);
        close(test.statistic, 0.28, 1e-12);
        close(test.p_value, 0.296_420_947_232_682_86, 1e-9);
        assert_eq!(ks_two_sample(&b, &a), test, "symmetric");

        // Ties within and across the samples.
        let test = ks_two_sample(
            &[1.0, 2.0, 2.0, 3.0, 3.0, 3.0, 4.0],
            &[2.0, 3.0, 3.0, 4.0, 5.0, 5.0, 6.0, 7.0],
        );
        close(test.statistic, 0.5, 1e-12);
        close(test.p_value, 0.216_038_281_284_653_16, 1e-9);
    }

    #[test]
    fn separated_samples_are_significant_and_interleaved_ones_are_not() {
        let low: Vec<f64> = (1..=100).map(f64::from).collect();
        let high: Vec<f64> = (0..100).map(|x| f64::from(x) + 100.5).collect();
        let test = ks_two_sample(&low, &high);
        assert_eq!(test.statistic, 1.0);
        close(test.p_value, 1.550_554_746_685_448_7e-45, 1e-6);

        let even: Vec<f64> = (0..100).map(|x| f64::from(x) * 0.1).collect();
        let odd: Vec<f64> = even.iter().map(|x| x + 0.05).collect();
        let test = ks_two_sample(&even, &odd);
        close(test.statistic, 0.01, 1e-9);
        assert_eq!(test.p_value, 1.0);
        assert_eq!(ks_two_sample(&even, &even).statistic, 0.0);
    }

    #[test]
    fn an_empty_sample_has_no_test() {
        let test = ks_two_sample(&[], &[1.0]);
        assert!(test.statistic.is_nan() && test.p_value.is_nan());
    }
}
