//! `expf` as glibc computes it on a CPU with FMA (`__expf_fma`, glibc 2.28 and later), in
//! scalar code and eight lanes at a time in AVX2.
//!
//! Softmax and SiLU call `expf` once per value, and glibc's is a function call per value:
//! 4 % of a batch-16 decode step went to it. Computing it in SIMD with the same algorithm
//! and the same fused operations gives the same bits (the test compares every f32 with the
//! system libm), so results do not move. It also makes them independent of the host libm:
//! every backend calls [`expf`] or [`x86::exp8`], never `f32::exp`.
//!
//! The algorithm: x·32/ln2 = k + r with k an integer, |r| ≤ 1/2; e^x = 2^(k/32)·2^(r/32),
//! the first factor from a 32-entry table, the second from a cubic, all in f64, rounded to
//! f32 once at the end.

/// `bits(2^(i/32)) − (i << 47)` for i in 0..32: adding `k << 47` gives `bits(2^(k/32))`.
const TABLE: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];
/// 32/ln 2.
const INV_LN2_N: f64 = f64::from_bits(0x40471547652b82fe);
/// 1.5·2^52: adding it rounds to an integer held in the low mantissa bits.
const SHIFT: f64 = f64::from_bits(0x4338000000000000);
/// The cubic for 2^(r/32): `(C0·r + C1)·r² + (C2·r + 1)`.
const C0: f64 = f64::from_bits(0x3ebc6af84b912394);
const C1: f64 = f64::from_bits(0x3f2ebfce50fac4f3);
const C2: f64 = f64::from_bits(0x3f962e42ff0c52d6);
/// Bits 20..31 of |x| from which the special cases below are checked (|x| ≥ 88, NaN, ∞).
const SPECIAL_TOP: u32 = 0x42b;
/// Above this e^x overflows f32.
const OVERFLOW: f32 = f32::from_bits(0x42b17217);
/// Below this e^x rounds to 0.
const UNDERFLOW: f32 = f32::from_bits(0xc2cff1b4);
/// Below this (and above `UNDERFLOW`) glibc returns the smallest subnormal.
const MAY_UNDERFLOW: f32 = f32::from_bits(0xc2ce8ecf);

/// e^x, bit for bit as glibc's `__expf_fma`.
pub fn expf(x: f32) -> f32 {
    let bits = x.to_bits();
    if (bits >> 20) & 0x7ff >= SPECIAL_TOP {
        if let Some(e) = special(x) {
            return e;
        }
    }
    let xd = x as f64;
    let kd = INV_LN2_N.mul_add(xd, SHIFT);
    let ki = kd.to_bits();
    let kd = kd - SHIFT;
    let r = INV_LN2_N.mul_add(xd, -kd);
    let s = f64::from_bits(TABLE[(ki % 32) as usize].wrapping_add(ki << 47));
    let z = C0.mul_add(r, C1);
    let r2 = r * r;
    let y = r.mul_add(C2, 1.0);
    let y = z.mul_add(r2, y);
    (y * s) as f32
}

/// The result for |x| ≥ 88, NaN and ∞ where it is not the main path's.
fn special(x: f32) -> Option<f32> {
    if x == f32::NEG_INFINITY {
        Some(0.0)
    } else if !x.is_finite() {
        Some(x + x)
    } else if x > OVERFLOW {
        Some(f32::INFINITY)
    } else if x < UNDERFLOW {
        Some(0.0)
    } else if x < MAY_UNDERFLOW {
        Some(f32::from_bits(1))
    } else {
        None
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_op_in_unsafe_fn)]
pub(crate) mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// `expf` of four lanes, widened to f64, without the special cases. Safety: as `exp8`
    /// (only ever inlined into it).
    #[inline(always)]
    unsafe fn exp4(x: __m128) -> __m128 {
        let xd = _mm256_cvtps_pd(x);
        let inv_ln2_n = _mm256_set1_pd(INV_LN2_N);
        let shift = _mm256_set1_pd(SHIFT);
        let kd = _mm256_fmadd_pd(inv_ln2_n, xd, shift);
        let ki = _mm256_castpd_si256(kd);
        let kd = _mm256_sub_pd(kd, shift);
        let r = _mm256_fmsub_pd(inv_ln2_n, xd, kd);
        let index = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        // SAFETY: every index is below 32, the table's length.
        let t = _mm256_i64gather_epi64::<8>(TABLE.as_ptr() as *const i64, index);
        let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
        let z = _mm256_fmadd_pd(_mm256_set1_pd(C0), r, _mm256_set1_pd(C1));
        let r2 = _mm256_mul_pd(r, r);
        let y = _mm256_fmadd_pd(r, _mm256_set1_pd(C2), _mm256_set1_pd(1.0));
        let y = _mm256_fmadd_pd(z, r2, y);
        _mm256_cvtpd_ps(_mm256_mul_pd(y, s))
    }

    /// `expf` of each lane, bit for bit as [`expf`].
    ///
    /// # Safety
    /// The CPU must support avx2 and fma, and MXCSR must round to nearest (Rust's default).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp8(x: __m256) -> __m256 {
        let e = _mm256_set_m128(
            exp4(_mm256_extractf128_ps::<1>(x)),
            exp4(_mm256_castps256_ps128(x)),
        );
        let top = _mm256_and_si256(
            _mm256_srli_epi32::<20>(_mm256_castps_si256(x)),
            _mm256_set1_epi32(0x7ff),
        );
        let special_lanes = _mm256_cmpgt_epi32(top, _mm256_set1_epi32(SPECIAL_TOP as i32 - 1));
        if _mm256_testz_si256(special_lanes, special_lanes) != 0 {
            return e;
        }
        let (mut xs, mut es) = ([0f32; 8], [0f32; 8]);
        _mm256_storeu_ps(xs.as_mut_ptr(), x);
        _mm256_storeu_ps(es.as_mut_ptr(), e);
        for (e, &x) in es.iter_mut().zip(&xs) {
            if let Some(special) = special(x) {
                *e = special;
            }
        }
        _mm256_loadu_ps(es.as_ptr())
    }

    /// Up to 8 values of `x` as a register, the lanes past its end 0.
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn load(x: &[f32]) -> __m256 {
        if x.len() == 8 {
            return _mm256_loadu_ps(x.as_ptr());
        }
        let mut lanes = [0f32; 8];
        lanes[..x.len()].copy_from_slice(x);
        _mm256_loadu_ps(lanes.as_ptr())
    }

    /// Stores the first `out.len()` (at most 8) lanes of `v`.
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn store(v: __m256, out: &mut [f32]) {
        if out.len() == 8 {
            _mm256_storeu_ps(out.as_mut_ptr(), v);
            return;
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), v);
        let n = out.len();
        out.copy_from_slice(&lanes[..n]);
    }

    /// `x[i] = expf(x[i] − shift)`; returns Σ x[i] summed in f64 in index order, as the
    /// scalar softmax does.
    ///
    /// # Safety
    /// The CPU must support avx2 and fma.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp_shifted_sum(x: &mut [f32], shift: f32) -> f64 {
        let shift = _mm256_set1_ps(shift);
        let mut sum = 0f64;
        for chunk in x.chunks_mut(8) {
            let e = exp8(_mm256_sub_ps(load(chunk), shift));
            store(e, chunk);
            for &v in chunk.iter() {
                sum += v as f64;
            }
        }
        sum
    }

    /// `gate[i] = gate[i] / (1 + expf(−gate[i])) · up[i]`, the scalar SwiGLU's operations.
    ///
    /// # Safety
    /// The CPU must support avx2 and fma; `up` is at least as long as `gate`.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
        let one = _mm256_set1_ps(1.0);
        let sign = _mm256_set1_ps(-0.0);
        for (gate, up) in gate.chunks_mut(8).zip(up.chunks(8)) {
            let g = load(gate);
            let e = exp8(_mm256_xor_ps(g, sign));
            let silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
            store(_mm256_mul_ps(silu, load(up)), gate);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_holds_powers_of_two() {
        for (i, &entry) in TABLE.iter().enumerate() {
            let exact = f64::from_bits(entry.wrapping_add((i as u64) << 47));
            let want = (i as f64 / 32.0).exp2();
            assert!(
                (exact - want).abs() <= f64::EPSILON,
                "entry {i}: {exact} vs {want}"
            );
        }
    }

    /// Every f32 bit pattern through `exp8`, against the scalar `expf` (every 61st register,
    /// as its `mul_add`s are library calls in a build without FMA) and, where the system
    /// libm is glibc on an FMA CPU (`__expf_fma`), against `f32::exp` everywhere.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_and_scalar_equal_glibc_on_every_f32() {
        use std::arch::x86_64::*;
        if !crate::backend::has_avx2() {
            eprintln!("skipped: this CPU has no AVX2/FMA, so no exp8 to compare");
            return;
        }
        let against_libm = cfg!(target_env = "gnu");
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
        let registers = 1u64 << 29;
        let per_thread = registers.div_ceil(threads);
        let mismatches: u64 = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    scope.spawn(move || {
                        let mut bad = 0u64;
                        let end = ((t + 1) * per_thread).min(registers);
                        for register in t * per_thread..end {
                            let xs: [f32; 8] = std::array::from_fn(|i| {
                                f32::from_bits((register * 8) as u32 + i as u32)
                            });
                            let mut es = [0f32; 8];
                            // SAFETY: the CPU has avx2 and fma (checked above).
                            unsafe {
                                let e = x86::exp8(_mm256_loadu_ps(xs.as_ptr()));
                                _mm256_storeu_ps(es.as_mut_ptr(), e);
                            }
                            for (&x, &e) in xs.iter().zip(&es) {
                                let libm_differs = against_libm && x.exp().to_bits() != e.to_bits();
                                let scalar_differs =
                                    register % 61 == 0 && expf(x).to_bits() != e.to_bits();
                                if libm_differs || scalar_differs {
                                    if bad < 5 {
                                        eprintln!(
                                            "x = {x:e} ({:#x}): exp8 {e:e}, expf {:e}, libm {:e}",
                                            x.to_bits(),
                                            expf(x),
                                            x.exp()
                                        );
                                    }
                                    bad += 1;
                                }
                            }
                        }
                        bad
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).sum()
        });
        assert_eq!(mismatches, 0, "f32 values whose e^x differs");
    }

    #[test]
    fn special_cases_follow_glibc() {
        assert_eq!(expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(expf(f32::INFINITY), f32::INFINITY);
        assert!(expf(f32::NAN).is_nan());
        assert_eq!(expf(100.0), f32::INFINITY);
        assert_eq!(expf(-110.0), 0.0);
        assert_eq!(expf(-103.5), f32::from_bits(1));
        assert_eq!(expf(0.0), 1.0);
        assert_eq!(expf(1.0), std::f32::consts::E);
    }
}
