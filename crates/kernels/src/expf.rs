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

/// `es[i]` = [`special`]`(xs[i])` where that has a result: the SIMD paths' rare lanes, patched
/// after the main path ran on every lane.
fn replace_special(xs: &[f32], es: &mut [f32]) {
    for (e, &x) in es.iter_mut().zip(xs) {
        if let Some(special) = special(x) {
            *e = special;
        }
    }
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
        replace_special(&xs, &mut es);
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

    /// `x[i] = expf(x[i] − shift)`.
    ///
    /// # Safety
    /// The CPU must support avx2 and fma.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp_shifted(x: &mut [f32], shift: f32) {
        let shift = _mm256_set1_ps(shift);
        for chunk in x.chunks_mut(8) {
            let e = exp8(_mm256_sub_ps(load(chunk), shift));
            store(e, chunk);
        }
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

/// Sixteen lanes at a time in AVX-512, for the VNNI backend: the same operations on eight
/// f64 lanes per register, with the table read by two in-register permutes instead of the
/// AVX2 version's gathers: SwiGLU 1.08–1.16 → 0.69–0.74 ns per value (`examples/silu_speed`).
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_op_in_unsafe_fn)]
pub(crate) mod x86_512 {
    use super::*;
    use std::arch::x86_64::*;

    /// `expf` of eight lanes widened to f64 (without the special cases), as f64.
    #[inline(always)]
    unsafe fn exp8_wide(xd: __m512d, table: &[__m512i; 4]) -> __m256 {
        let inv_ln2_n = _mm512_set1_pd(INV_LN2_N);
        let shift = _mm512_set1_pd(SHIFT);
        let kd = _mm512_fmadd_pd(inv_ln2_n, xd, shift);
        let ki = _mm512_castpd_si512(kd);
        let kd = _mm512_sub_pd(kd, shift);
        let r = _mm512_fmsub_pd(inv_ln2_n, xd, kd);
        // Entry `ki % 32`: the low four bits pick one of 16 entries from each half of the
        // table, bit 4 picks the half.
        let low_half = _mm512_permutex2var_epi64(table[0], ki, table[1]);
        let high_half = _mm512_permutex2var_epi64(table[2], ki, table[3]);
        let upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
        let t = _mm512_mask_blend_epi64(upper, low_half, high_half);
        let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
        let z = _mm512_fmadd_pd(_mm512_set1_pd(C0), r, _mm512_set1_pd(C1));
        let r2 = _mm512_mul_pd(r, r);
        let y = _mm512_fmadd_pd(r, _mm512_set1_pd(C2), _mm512_set1_pd(1.0));
        let y = _mm512_fmadd_pd(z, r2, y);
        _mm512_cvtpd_ps(_mm512_mul_pd(y, s))
    }

    /// The table as four registers of eight entries.
    #[inline(always)]
    unsafe fn table() -> [__m512i; 4] {
        let p = TABLE.as_ptr() as *const __m512i;
        [
            _mm512_loadu_si512(p),
            _mm512_loadu_si512(p.add(1)),
            _mm512_loadu_si512(p.add(2)),
            _mm512_loadu_si512(p.add(3)),
        ]
    }

    /// `expf` of each lane, bit for bit as [`expf`].
    ///
    /// # Safety
    /// The CPU must support avx512f, and MXCSR must round to nearest (Rust's default).
    #[cfg(test)]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn exp16(x: __m512) -> __m512 {
        exp16_with(x, &table())
    }

    #[inline(always)]
    unsafe fn exp16_with(x: __m512, table: &[__m512i; 4]) -> __m512 {
        let bits = _mm512_castps_si512(x);
        let low = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_castsi512_si256(bits)));
        let high = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_extracti64x4_epi64::<1>(bits)));
        let e = _mm512_castpd_si512(_mm512_insertf64x4::<1>(
            _mm512_castpd256_pd512(_mm256_castps_pd(exp8_wide(low, table))),
            _mm256_castps_pd(exp8_wide(high, table)),
        ));
        let top = _mm512_and_si512(_mm512_srli_epi32::<20>(bits), _mm512_set1_epi32(0x7ff));
        let special_lanes = _mm512_cmpgt_epi32_mask(top, _mm512_set1_epi32(SPECIAL_TOP as i32 - 1));
        if special_lanes == 0 {
            return _mm512_castsi512_ps(e);
        }
        let (mut xs, mut es) = ([0f32; 16], [0f32; 16]);
        _mm512_storeu_ps(xs.as_mut_ptr(), x);
        _mm512_storeu_si512(es.as_mut_ptr() as *mut __m512i, e);
        replace_special(&xs, &mut es);
        _mm512_loadu_ps(es.as_ptr())
    }

    /// Mask of the first `n` (at most 16) lanes.
    #[inline(always)]
    pub(crate) fn first_lanes(n: usize) -> __mmask16 {
        ((1u32 << n) - 1) as __mmask16
    }

    /// `x[i] = expf(x[i] − shift)`.
    ///
    /// # Safety
    /// The CPU must support avx512f.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn exp_shifted(x: &mut [f32], shift: f32) {
        let table = table();
        let shift = _mm512_set1_ps(shift);
        for chunk in x.chunks_mut(16) {
            // Masked loads and stores touch only the chunk's lanes.
            let lanes = first_lanes(chunk.len());
            let v = _mm512_maskz_loadu_ps(lanes, chunk.as_ptr());
            let e = exp16_with(_mm512_sub_ps(v, shift), &table);
            _mm512_mask_storeu_ps(chunk.as_mut_ptr(), lanes, e);
        }
    }

    /// `x[i] = expf(x[i] − max)`, and the f64 sums of the results in 16 lanes: lane l adds
    /// the values at indices ≡ l (mod 16), in index order (`ops::attention_softmax_rows`).
    ///
    /// `max` is the largest value of `x` (leaving NaNs aside), so each x[i] − max is at most 0
    /// or NaN, and the special cases (|x| ≥ 88) are the lanes at or below −88: one compare
    /// finds them. Each half of 8 goes from its f64 evaluation to its store and its sums
    /// without being joined into one register. Softmax at long prompts runs at the rate of
    /// its vector operations, and this takes 4 of every 43 out.
    ///
    /// # Safety
    /// The CPU must support avx512f and avx512vl.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub(crate) unsafe fn exp_shifted_lane_sums(x: &mut [f32], max: f32) -> [f64; 16] {
        let table = table();
        let shift = _mm512_set1_ps(max);
        let special_at_or_below = _mm512_set1_ps(-f32::from_bits(SPECIAL_TOP << 20));
        let (mut low, mut high) = (_mm512_setzero_pd(), _mm512_setzero_pd());
        for chunk in x.chunks_mut(16) {
            let lanes = first_lanes(chunk.len());
            let (low_lanes, high_lanes) = (lanes as __mmask8, (lanes >> 8) as __mmask8);
            // Masked loads and stores touch only the chunk's lanes (the upper half's address
            // is not dereferenced when the chunk has no lanes there).
            let at = chunk.as_mut_ptr();
            let at_high = at.wrapping_add(8);
            let v = _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, at), shift);
            let v_high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
            let mut e_low = exp8_wide(_mm512_cvtps_pd(_mm512_castps512_ps256(v)), &table);
            let mut e_high = exp8_wide(_mm512_cvtps_pd(v_high), &table);
            let special = _mm512_mask_cmp_ps_mask::<_CMP_NGT_UQ>(lanes, v, special_at_or_below);
            if special != 0 {
                (e_low, e_high) = with_special_lanes(v, e_low, e_high);
            }
            _mm256_mask_storeu_ps(at, low_lanes, e_low);
            _mm256_mask_storeu_ps(at_high, high_lanes, e_high);
            low = _mm512_mask_add_pd(low, low_lanes, low, _mm512_cvtps_pd(e_low));
            high = _mm512_mask_add_pd(high, high_lanes, high, _mm512_cvtps_pd(e_high));
        }
        let mut sums = [0f64; 16];
        _mm512_storeu_pd(sums.as_mut_ptr(), low);
        _mm512_storeu_pd(sums.as_mut_ptr().add(8), high);
        sums
    }

    /// The halves `e_low`, `e_high` of e^v, each lane replaced by [`special`]'s result where
    /// it has one (the rare path: it goes through memory). Lanes past the chunk may be
    /// replaced too; they are neither stored nor summed.
    #[inline(never)]
    #[target_feature(enable = "avx512f,avx512vl")]
    unsafe fn with_special_lanes(v: __m512, e_low: __m256, e_high: __m256) -> (__m256, __m256) {
        let (mut xs, mut es) = ([0f32; 16], [0f32; 16]);
        _mm512_storeu_ps(xs.as_mut_ptr(), v);
        _mm256_storeu_ps(es.as_mut_ptr(), e_low);
        _mm256_storeu_ps(es.as_mut_ptr().add(8), e_high);
        replace_special(&xs, &mut es);
        (
            _mm256_loadu_ps(es.as_ptr()),
            _mm256_loadu_ps(es.as_ptr().add(8)),
        )
    }

    /// `gate[i] = gate[i] / (1 + expf(−gate[i])) · up[i]`, the scalar SwiGLU's operations.
    ///
    /// # Safety
    /// The CPU must support avx512f; `up` is at least as long as `gate`.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
        assert!(up.len() >= gate.len(), "an up value for each gate value");
        let table = table();
        let one = _mm512_set1_ps(1.0);
        let sign = _mm512_set1_epi32(i32::MIN);
        for (gate, up) in gate.chunks_mut(16).zip(up.chunks(16)) {
            let lanes = first_lanes(gate.len());
            let g = _mm512_maskz_loadu_ps(lanes, gate.as_ptr());
            let minus_g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign));
            let e = exp16_with(minus_g, &table);
            let silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
            let u = _mm512_maskz_loadu_ps(lanes, up.as_ptr());
            _mm512_mask_storeu_ps(gate.as_mut_ptr(), lanes, _mm512_mul_ps(silu, u));
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

    /// Every f32 bit pattern through `exp8` (and `exp16` where the CPU has AVX-512), against
    /// the scalar `expf` (every 61st register, as its `mul_add`s are library calls in a build
    /// without FMA) and, where the system libm is glibc on an FMA CPU (`__expf_fma`), against
    /// `f32::exp` everywhere.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_and_scalar_equal_glibc_on_every_f32() {
        use std::arch::x86_64::*;
        if !crate::backend::has_avx2() {
            eprintln!("skipped: this CPU has no AVX2/FMA, so no exp8 to compare");
            return;
        }
        let against_libm = cfg!(target_env = "gnu");
        let with_avx512 = crate::backend::has_avx512_vnni();
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
                            let (mut es, mut wide) = ([0f32; 8], [0f32; 16]);
                            // SAFETY: the CPU has avx2 and fma (checked above), and avx512f
                            // where `exp16` runs.
                            unsafe {
                                let e = x86::exp8(_mm256_loadu_ps(xs.as_ptr()));
                                _mm256_storeu_ps(es.as_mut_ptr(), e);
                                if with_avx512 {
                                    // This register's values in both halves.
                                    let twice: [f32; 16] = std::array::from_fn(|i| xs[i % 8]);
                                    let e = x86_512::exp16(_mm512_loadu_ps(twice.as_ptr()));
                                    _mm512_storeu_ps(wide.as_mut_ptr(), e);
                                }
                            }
                            let wide_differs = with_avx512
                                && (es.iter().chain(&es).zip(&wide))
                                    .any(|(a, b)| a.to_bits() != b.to_bits());
                            if wide_differs {
                                if bad < 5 {
                                    eprintln!("exp16 {wide:?} vs exp8 {es:?} for {xs:?}");
                                }
                                bad += 1;
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
