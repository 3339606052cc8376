//! KV pool sizing: from a budget (tokens, bytes, or a fraction of the machine's memory minus
//! weights and working buffers) and the model's shape to pages and tokens; and the start-up
//! check (I8) that one request of the configured context length fits.

use std::fmt;

/// The KV cache element type and page layout; every worker of a deployment must use the same
/// (the handshake refuses a peer that differs). f16, with each head's keys dimension-major
/// within a page ("kdm", `kernels::key_index`); before 2026-12-06 they were slot-major, as
/// values still are, and the name was "f16".
pub const KV_DTYPE: &str = "f16-kdm";
pub const KV_DTYPE_BYTES: u64 = 2;

/// What sizing needs to know about the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelShape {
    pub layer_count: u64,
    pub kv_head_count: u64,
    pub head_dim: u64,
    /// The longest context the model itself supports.
    pub context_length_max: u64,
}

/// How much KV memory a worker gets.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvBudget {
    Tokens(u64),
    Bytes(u64),
    /// `fraction` of `available_bytes`, minus the weights and working buffers.
    Fraction {
        fraction: f64,
        available_bytes: u64,
        weight_bytes: u64,
        working_bytes: u64,
    },
}

/// A pool's size, in every unit an operator asks about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolPlan {
    pub page_size_tokens: u64,
    pub bytes_per_token: u64,
    pub page_bytes: u64,
    pub page_count: u64,
    pub capacity_tokens: u64,
    pub kv_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SizingError {
    #[error("page size must be at least 1 token")]
    ZeroPageSize,
    #[error("the model shape has a zero dimension")]
    ZeroShape,
    #[error("--kv-memory-fraction must be in (0, 1], not {0}")]
    BadFraction(f64),
    #[error(
        "{fraction} of the {available_mib} MiB available leaves nothing for KV after \
         {weight_mib} MiB of weights and {working_mib} MiB of working buffers; raise the \
         fraction or give --kv-memory / --kv-tokens"
    )]
    NothingLeft {
        fraction: f64,
        available_mib: u64,
        weight_mib: u64,
        working_mib: u64,
    },
    #[error(
        "a KV budget of {budget} holds no whole page ({page_bytes} bytes, {page_size_tokens} \
         tokens); give at least one page"
    )]
    NoWholePage {
        budget: String,
        page_bytes: u64,
        page_size_tokens: u64,
    },
}

/// I8: a worker whose pool cannot hold one request of its context length.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct CapacityError {
    pub context_length: u64,
    pub capacity_tokens: u64,
    pub kv_bytes: u64,
    pub bytes_per_token: u64,
}

impl fmt::Display for CapacityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let needed_mib = (self.context_length * self.bytes_per_token).div_ceil(1 << 20);
        write!(
            f,
            "the KV pool holds {} tokens ({} MiB) but the context length is {} tokens: one \
             request of the full context could never fit. Fix: give more KV memory \
             (--kv-memory {needed_mib}MiB or --kv-tokens {}), or lower --context-length to \
             {} or less (--context-length auto does that)",
            self.capacity_tokens,
            self.kv_bytes >> 20,
            self.context_length,
            self.context_length,
            self.capacity_tokens,
        )
    }
}

/// The context length setting: a number, or as much as the pool holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContextSetting {
    Auto,
    Tokens(u64),
}

impl ModelShape {
    /// K and V, every layer, every KV head.
    pub fn bytes_per_token(&self) -> u64 {
        self.layer_count * 2 * self.kv_head_count * self.head_dim * KV_DTYPE_BYTES
    }
}

/// How many pages (and tokens) `budget` buys for a model of `shape` at `page_size_tokens`.
pub fn plan_pool(
    shape: &ModelShape,
    page_size_tokens: u64,
    budget: KvBudget,
) -> Result<PoolPlan, SizingError> {
    if page_size_tokens == 0 {
        return Err(SizingError::ZeroPageSize);
    }
    if shape.layer_count == 0 || shape.kv_head_count == 0 || shape.head_dim == 0 {
        return Err(SizingError::ZeroShape);
    }
    let bytes_per_token = shape.bytes_per_token();
    let page_bytes = bytes_per_token * page_size_tokens;
    let page_count = match budget {
        KvBudget::Tokens(tokens) => tokens / page_size_tokens,
        KvBudget::Bytes(bytes) => bytes / page_bytes,
        KvBudget::Fraction {
            fraction,
            available_bytes,
            weight_bytes,
            working_bytes,
        } => {
            if !(fraction > 0.0 && fraction <= 1.0) {
                return Err(SizingError::BadFraction(fraction));
            }
            let share = (available_bytes as f64 * fraction) as u64;
            let left = share
                .checked_sub(weight_bytes + working_bytes)
                .filter(|&left| left > 0)
                .ok_or(SizingError::NothingLeft {
                    fraction,
                    available_mib: available_bytes >> 20,
                    weight_mib: weight_bytes >> 20,
                    working_mib: working_bytes >> 20,
                })?;
            left / page_bytes
        }
    };
    if page_count == 0 {
        return Err(SizingError::NoWholePage {
            budget: format!("{budget:?}"),
            page_bytes,
            page_size_tokens,
        });
    }
    Ok(PoolPlan {
        page_size_tokens,
        bytes_per_token,
        page_bytes,
        page_count,
        capacity_tokens: page_count * page_size_tokens,
        kv_bytes: page_count * page_bytes,
    })
}

/// The context length a worker runs with, checked against its pool (I8) and the model.
/// `Auto` takes the smaller of the model's context and the pool's capacity.
pub fn resolve_context(
    plan: &PoolPlan,
    shape: &ModelShape,
    setting: ContextSetting,
) -> Result<u64, CapacityError> {
    let context_length = match setting {
        ContextSetting::Auto => shape.context_length_max.min(plan.capacity_tokens),
        ContextSetting::Tokens(tokens) => tokens,
    };
    if context_length > plan.capacity_tokens {
        return Err(CapacityError {
            context_length,
            capacity_tokens: plan.capacity_tokens,
            kv_bytes: plan.kv_bytes,
            bytes_per_token: plan.bytes_per_token,
        });
    }
    Ok(context_length)
}

/// Working memory a worker is taken to need beyond weights and KV (a step's activations and
/// logits, the runtime) when its pool is sized from a memory fraction. One value for `serve`
/// and `preflight`: were they to differ, preflight would pass a node that serve refuses.
pub const WORKING_BYTES: u64 = 128 << 20;

/// Parses a byte count: `123`, `512KiB`, `512MiB`, `2GiB`, `2G`, `1.5GB` (K/M/G are 1024-based).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| c.is_ascii_alphabetic())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("'{text}' is not a size like 512MiB or 2GiB"))?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown size unit '{other}' in '{text}'")),
    };
    if !(number >= 0.0 && number.is_finite()) {
        return Err(format!("'{text}' is not a size"));
    }
    Ok((number * scale as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M: 30 layers, 3 KV heads of 64.
    const SMOLLM2: ModelShape = ModelShape {
        layer_count: 30,
        kv_head_count: 3,
        head_dim: 64,
        context_length_max: 8192,
    };

    #[test]
    fn smollm2_costs_23040_bytes_per_token() {
        // 30 layers × (K + V) × 3 heads × 64 dims × 2 bytes.
        assert_eq!(SMOLLM2.bytes_per_token(), 23_040);
    }

    #[test]
    fn a_byte_budget_buys_whole_pages() {
        // 512 MiB / (23,040 × 16 = 368,640 bytes a page) = 1,456.35 -> 1,456 pages.
        let plan = plan_pool(&SMOLLM2, 16, KvBudget::Bytes(512 << 20)).unwrap();
        assert_eq!(plan.page_bytes, 368_640);
        assert_eq!(plan.page_count, 1_456);
        assert_eq!(plan.capacity_tokens, 23_296);
        assert_eq!(plan.kv_bytes, 536_739_840);
    }

    #[test]
    fn a_token_budget_rounds_down_to_pages() {
        let plan = plan_pool(&SMOLLM2, 16, KvBudget::Tokens(8_200)).unwrap();
        assert_eq!((plan.page_count, plan.capacity_tokens), (512, 8_192));
    }

    #[test]
    fn a_fraction_subtracts_weights_and_working_buffers() {
        // Half of 4 GiB = 2,048 MiB, minus 100 MiB weights and 164 MiB buffers = 1,784 MiB
        // = 1,870,659,584 bytes / 368,640 = 5,074.5 -> 5,074 pages, 81,184 tokens.
        let budget = KvBudget::Fraction {
            fraction: 0.5,
            available_bytes: 4 << 30,
            weight_bytes: 100 << 20,
            working_bytes: 164 << 20,
        };
        let plan = plan_pool(&SMOLLM2, 16, budget).unwrap();
        assert_eq!(plan.page_count, 5_074);
        assert_eq!(plan.capacity_tokens, 81_184);

        let starved = KvBudget::Fraction {
            fraction: 0.01,
            available_bytes: 4 << 30,
            weight_bytes: 100 << 20,
            working_bytes: 164 << 20,
        };
        assert!(matches!(
            plan_pool(&SMOLLM2, 16, starved),
            Err(SizingError::NothingLeft { .. })
        ));
    }

    #[test]
    fn budgets_below_one_page_and_bad_inputs_are_errors() {
        assert!(matches!(
            plan_pool(&SMOLLM2, 16, KvBudget::Bytes(368_639)),
            Err(SizingError::NoWholePage { .. })
        ));
        assert_eq!(
            plan_pool(&SMOLLM2, 0, KvBudget::Tokens(16)),
            Err(SizingError::ZeroPageSize)
        );
        let fraction = KvBudget::Fraction {
            fraction: 1.5,
            available_bytes: 1 << 30,
            weight_bytes: 0,
            working_bytes: 0,
        };
        assert_eq!(
            plan_pool(&SMOLLM2, 16, fraction),
            Err(SizingError::BadFraction(1.5))
        );
    }

    #[test]
    fn the_incidents_deployment_is_refused() {
        // The incident: a 1,048,576-token context over a 681,280-token prefill pool.
        let shape = ModelShape {
            context_length_max: 1 << 20,
            ..SMOLLM2
        };
        let plan = plan_pool(&shape, 16, KvBudget::Tokens(681_280)).unwrap();
        let error = resolve_context(&plan, &shape, ContextSetting::Tokens(1_048_576)).unwrap_err();
        assert_eq!(
            (error.context_length, error.capacity_tokens),
            (1_048_576, 681_280)
        );
        let message = error.to_string();
        for needle in ["681280", "1048576", "--kv-memory", "--context-length"] {
            assert!(message.contains(needle), "{message}");
        }
    }

    #[test]
    fn the_incident_scaled_to_this_model_is_refused_and_auto_fits() {
        // Same ratio on SmolLM2's 8,192 context: 8,192 × 681,280 / 1,048,576 = 5,322 tokens,
        // 332 pages of 16 = 5,312 tokens.
        let plan = plan_pool(&SMOLLM2, 16, KvBudget::Tokens(5_322)).unwrap();
        assert_eq!(plan.capacity_tokens, 5_312);
        let error = resolve_context(&plan, &SMOLLM2, ContextSetting::Tokens(8_192)).unwrap_err();
        assert_eq!(error.capacity_tokens, 5_312);
        assert_eq!(
            resolve_context(&plan, &SMOLLM2, ContextSetting::Auto),
            Ok(5_312)
        );
        let roomy = plan_pool(&SMOLLM2, 16, KvBudget::Tokens(1 << 20)).unwrap();
        assert_eq!(
            resolve_context(&roomy, &SMOLLM2, ContextSetting::Auto),
            Ok(8_192)
        );
        assert_eq!(
            resolve_context(&roomy, &SMOLLM2, ContextSetting::Tokens(8_192)),
            Ok(8_192)
        );
    }

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_bytes("123"), Ok(123));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5 GiB"), Ok(3 << 29));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("5XB").is_err());
        assert!(parse_bytes("-1M").is_err());
    }
}
