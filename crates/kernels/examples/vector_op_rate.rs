//! How many 512-bit operations a core retires per nanosecond: `cargo run --release -p kernels
//! --example vector_op_rate`. It times 8 independent chains of FMAs (register operands, then
//! a broadcast memory operand, as the attention kernels' inner loops have), and FMAs beside as
//! many adds. Attention at long prompts is a count of such operations, so this is the ceiling
//! its per-position cost is read against (BENCHMARKS.md, issue 24, "where the one-thread time
//! at 8,192 tokens goes"). On the 2-core AMD EPYC VM (2026-12-07): 3.67 FMAs a ns with either
//! operand, 5.7–5.8 operations a ns with an add beside each FMA.

#[cfg(target_arch = "x86_64")]
fn main() {
    if !std::arch::is_x86_feature_detected!("avx512f") {
        println!("skipped: this CPU has no AVX-512 (avx512f)");
        return;
    }
    const STEPS: usize = 50_000_000;
    let q: Vec<f32> = (0..64).map(|i| i as f32 * 1e-9).collect();
    for (name, ops_per_step, run) in [
        (
            "FMA, register operands",
            8,
            x86::fma as unsafe fn(usize, &[f32]) -> f32,
        ),
        ("FMA, broadcast memory operand", 8, x86::fma_broadcast),
        ("FMA and add side by side", 16, x86::fma_and_add),
    ] {
        let mut best = f64::MAX;
        let mut keep = 0.0;
        for _ in 0..5 {
            let started = std::time::Instant::now();
            // SAFETY: the CPU has avx512f (checked above), all these functions need.
            keep += unsafe { run(STEPS, &q) };
            best = best.min(started.elapsed().as_secs_f64());
        }
        let rate = (STEPS * ops_per_step) as f64 / best / 1e9;
        println!("{name}: {rate:.2} 512-bit operations a ns (checksum {keep:.1})");
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("skipped: AVX-512 is an x86-64 extension");
}

// Each function's body is intrinsics on registers and on `q`'s first 16 values; the safety
// contract is the function's (the CPU has avx512f), so the bodies are not split into
// per-line unsafe blocks.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_op_in_unsafe_fn)]
mod x86 {
    use std::arch::x86_64::*;

    const CHAINS: usize = 8;

    /// Eight FMA chains, `steps` links each.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma(steps: usize, _q: &[f32]) -> f32 {
        let (m, c) = (_mm512_set1_ps(1.000_000_1), _mm512_set1_ps(1e-9));
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..steps {
            for a in acc.iter_mut() {
                *a = _mm512_fmadd_ps(*a, m, c);
            }
        }
        acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
    }

    /// Eight FMA chains, each link multiplying a broadcast of one of `q`'s values.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_broadcast(steps: usize, q: &[f32]) -> f32 {
        assert!(q.len() >= CHAINS, "values to broadcast");
        let k = _mm512_set1_ps(1.000_000_1);
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..steps {
            // `black_box` keeps the loads in the loop, as the kernels' are.
            let q = std::hint::black_box(q.as_ptr());
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(_mm512_set1_ps(*q.add(i)), k, *a);
            }
        }
        acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
    }

    /// Eight FMA chains and eight add chains, interleaved.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_and_add(steps: usize, _q: &[f32]) -> f32 {
        let (m, c) = (_mm512_set1_ps(1.000_000_1), _mm512_set1_ps(1e-9));
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        let mut sums = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..steps {
            for (a, s) in acc.iter_mut().zip(sums.iter_mut()) {
                *a = _mm512_fmadd_ps(*a, m, c);
                *s = _mm512_add_ps(*s, c);
            }
        }
        acc.iter()
            .chain(&sums)
            .map(|&a| _mm512_reduce_add_ps(a))
            .sum()
    }
}
