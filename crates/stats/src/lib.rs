//! The few numeric helpers every tool and test of the workspace needs, in one place so they
//! share one contract:
//!
//! - [`median`], [`percentile`] and [`mean_and_ci95`] over `f64` samples (benchmarks, the
//!   canary's latency report). None of them sorts its input in place or panics on an empty one.
//! - [`SplitMix64`], the one seeded pseudo-random generator: the sampler's draws, the canary's
//!   markers and prompt mix, the bench's prompts, fault plans and test data. It is not
//!   cryptographic; nothing secret may come from it.

mod order;
mod rng;

pub use order::{mean_and_ci95, median, percentile};
pub use rng::SplitMix64;
