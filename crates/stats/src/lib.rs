//! The few numeric helpers every tool and test of the workspace needs, in one place so they
//! share one contract:
//!
//! - [`median`], [`percentile`] and [`mean_and_ci95`] over `f64` samples (benchmarks, the
//!   canary's latency report). None of them sorts its input in place or panics on an empty one.
//! - [`ks_two_sample`], the two-sample Kolmogorov–Smirnov test (the canary's timing audit),
//!   and [`kolmogorov_survival`], the distribution its p-value comes from.
//! - [`SplitMix64`], the one seeded pseudo-random generator: the sampler's draws, the canary's
//!   markers and prompt mix, the bench's prompts, fault plans and test data. It is not
//!   cryptographic; nothing secret may come from it.

mod ks;
mod order;
mod rng;

pub use ks::{kolmogorov_survival, ks_two_sample, KsTest};
pub use order::{mean_and_ci95, median, percentile};
pub use rng::SplitMix64;
