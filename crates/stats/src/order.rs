//! Order statistics of samples.

/// The median: the middle value, or the mean of the two middle values of an even count; NaN
/// when there is none. NaNs sort last (`f64::total_cmp`).
pub fn median(values: &[f64]) -> f64 {
    let sorted = sorted(values);
    let mid = sorted.len() / 2;
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[mid],
        _ => (sorted[mid - 1] + sorted[mid]) / 2.0,
    }
}

/// The `p`th percentile (0–100, clamped) by nearest rank on the sorted samples: a value that
/// was measured, never one interpolated between two; NaN when there is none.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    let sorted = sorted(values);
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p.clamp(0.0, 100.0) / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank]
}

/// The mean and the half-width of its two-sided 95 % confidence interval (Student's t); the
/// half-width is NaN with fewer than two samples, and both are NaN with none.
pub fn mean_and_ci95(values: &[f64]) -> (f64, f64) {
    /// t(0.975, df) for df = 1..=30; beyond, the normal 1.96.
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if values.len() < 2 {
        return (mean, f64::NAN);
    }
    let variance = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    let t = T.get(values.len() - 2).copied().unwrap_or(1.96);
    (mean, t * (variance / n).sqrt())
}

/// A sorted copy (NaNs last, by `total_cmp`).
pub(crate) fn sorted(values: &[f64]) -> Vec<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_no_samples() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn percentiles_are_measured_values_by_nearest_rank() {
        let values: Vec<f64> = (1..=101).rev().map(f64::from).collect();
        assert_eq!(percentile(&values, 0.0), 1.0);
        assert_eq!(percentile(&values, 50.0), 51.0);
        assert_eq!(percentile(&values, 99.0), 100.0);
        assert_eq!(percentile(&values, 250.0), 101.0);
        assert_eq!(percentile(&[1.0, 2.0], 50.0), 2.0, "rank 0.5 rounds up");
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn the_input_is_left_in_its_order() {
        let values = [3.0, 1.0, 2.0];
        median(&values);
        percentile(&values, 90.0);
        assert_eq!(values, [3.0, 1.0, 2.0]);
    }

    #[test]
    fn confidence_interval_uses_students_t() {
        let (mean, half) = mean_and_ci95(&[1.0, 3.0]);
        assert_eq!(mean, 2.0);
        // s = sqrt(2), n = 2, t(1) = 12.706: 12.706 · sqrt(2)/sqrt(2).
        assert!((half - 12.706).abs() < 1e-9, "{half}");
        // Values 1..=5: mean 3, sample sd 1.5811, se 0.7071, t(4) = 2.776, half 1.963.
        let (mean, half) = mean_and_ci95(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        assert!((mean - 3.0).abs() < 1e-12);
        assert!((half - 1.963).abs() < 1e-3, "{half}");
        let (mean, half) = mean_and_ci95(&[5.0]);
        assert_eq!(mean, 5.0);
        assert!(half.is_nan());
        let many: Vec<f64> = (0..100).map(|i| f64::from(i % 2)).collect();
        let (_, half) = mean_and_ci95(&many);
        let s = (25.0f64 / 99.0).sqrt();
        assert!((half - 1.96 * s / 10.0).abs() < 1e-9, "{half}");
    }
}
