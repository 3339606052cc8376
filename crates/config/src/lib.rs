//! Deployment arithmetic and checks, with no I/O: how many KV tokens a memory budget buys
//! (`sizing`), whether a worker can hold one request of its context length (I8), and the
//! preflight over a whole deployment (`preflight`).
//!
//! Every number an operator sees about capacity comes from this crate, so the start-up check,
//! `airlock preflight` and the docs cannot disagree.

pub mod preflight;
pub mod sizing;

pub use sizing::{
    parse_bytes, plan_pool, resolve_context, CapacityError, ContextSetting, KvBudget, ModelShape,
    PoolPlan, SizingError, KV_DTYPE, KV_DTYPE_BYTES, WORKING_BYTES,
};
