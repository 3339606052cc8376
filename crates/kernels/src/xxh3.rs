//! XXH3-64 of long inputs (over 240 bytes) under a caller's secret, with AVX2 where the CPU
//! has it: the transfer checksum hashes every KV page on both sides of a transfer, at the
//! speed the transfer itself should run.
//!
//! Why here: `xxhash-rust` chooses its SIMD at compile time, and the workspace builds for
//! baseline x86-64, so its XXH3 runs on SSE2: on the 2-core Intel VM of 2026-12-06 this kernel
//! hashed a 368,640-byte page about 2.2 times as fast (in cache, under load). This is the same function, chosen at run time like every
//! other kernel here, and tested bit-equal to `xxhash_rust::xxh3::xxh3_64_with_secret`
//! (the scalar path too).

/// Bytes of the secret: XXH3's default size, so one block is 16 stripes.
pub const XXH3_SECRET_BYTES: usize = 192;
/// Inputs this long or shorter take XXH3's short-input paths, which are not here.
pub const XXH3_SHORT_MAX: usize = 240;

const STRIPE: usize = 64;
const SECRET_CONSUME: usize = 8;
const STRIPES_PER_BLOCK: usize = (XXH3_SECRET_BYTES - STRIPE) / SECRET_CONSUME;
const BLOCK: usize = STRIPE * STRIPES_PER_BLOCK;
const LAST_ACC_START: usize = 7;
const MERGE_ACCS_START: usize = 11;

const P32_1: u64 = 0x9E37_79B1;
const P32_2: u64 = 0x85EB_CA77;
const P32_3: u64 = 0xC2B2_AE3D;
const P64_1: u64 = 0x9E37_79B1_85EB_CA87;
const P64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P64_3: u64 = 0x1656_67B1_9E37_79F9;
const P64_4: u64 = 0x85EB_CA77_C2B2_AE63;
const P64_5: u64 = 0x27D4_EB2F_1656_67C5;
const INIT_ACC: [u64; 8] = [P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1];

/// XXH3-64 of `input` (longer than [`XXH3_SHORT_MAX`] bytes) under `secret`. Panics on a
/// shorter input: that is a bug in the caller.
pub fn xxh3_64_long(input: &[u8], secret: &[u8; XXH3_SECRET_BYTES]) -> u64 {
    assert!(input.len() > XXH3_SHORT_MAX, "long inputs only");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { avx2::xxh3_64_long(input, secret) };
    }
    xxh3_64_long_scalar(input, secret)
}

/// Copies `input` to `destination` and returns [`xxh3_64_long`] of it, reading `input` once:
/// the one-sided writer's copy of a page into a peer's pool, which also yields the page's hash
/// for the transfer checksum. With AVX2 the stores are non-temporal where `destination` and the
/// length allow (the page is for another core to read) and fenced before returning.
///
/// # Safety
/// `destination` must be valid for writes of `input.len()` bytes that do not overlap `input`.
pub unsafe fn xxh3_64_long_copy(
    input: &[u8],
    destination: *mut u8,
    secret: &[u8; XXH3_SECRET_BYTES],
) -> u64 {
    assert!(input.len() > XXH3_SHORT_MAX, "long inputs only");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above; the rest is the caller's contract.
        return unsafe { avx2::xxh3_64_long_copy(input, destination, secret) };
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(input.as_ptr(), destination, input.len()) };
    xxh3_64_long_scalar(input, secret)
}

/// The portable path of [`xxh3_64_long`], public so tests can hold the fast one to it.
pub fn xxh3_64_long_scalar(input: &[u8], secret: &[u8; XXH3_SECRET_BYTES]) -> u64 {
    assert!(input.len() > XXH3_SHORT_MAX, "long inputs only");
    let mut acc = INIT_ACC;
    let len = input.len();
    let blocks = (len - 1) / BLOCK;
    for block in 0..blocks {
        let start = block * BLOCK;
        for stripe in 0..STRIPES_PER_BLOCK {
            let at = start + stripe * STRIPE;
            accumulate(
                &mut acc,
                &input[at..at + STRIPE],
                &secret[stripe * SECRET_CONSUME..],
            );
        }
        scramble(&mut acc, &secret[XXH3_SECRET_BYTES - STRIPE..]);
    }
    let stripes = ((len - 1) - blocks * BLOCK) / STRIPE;
    for stripe in 0..stripes {
        let at = blocks * BLOCK + stripe * STRIPE;
        accumulate(
            &mut acc,
            &input[at..at + STRIPE],
            &secret[stripe * SECRET_CONSUME..],
        );
    }
    let last = XXH3_SECRET_BYTES - STRIPE - LAST_ACC_START;
    accumulate(&mut acc, &input[len - STRIPE..], &secret[last..]);
    merge(&acc, secret, len)
}

fn read64(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

fn accumulate(acc: &mut [u64; 8], stripe: &[u8], secret: &[u8]) {
    for lane in 0..8 {
        let data = read64(stripe, 8 * lane);
        let keyed = data ^ read64(secret, 8 * lane);
        acc[lane ^ 1] = acc[lane ^ 1].wrapping_add(data);
        acc[lane] = acc[lane].wrapping_add((keyed & 0xFFFF_FFFF) * (keyed >> 32));
    }
}

fn scramble(acc: &mut [u64; 8], secret: &[u8]) {
    for (lane, value) in acc.iter_mut().enumerate() {
        let mut mixed = *value ^ (*value >> 47);
        mixed ^= read64(secret, 8 * lane);
        *value = mixed.wrapping_mul(P32_1);
    }
}

fn merge(acc: &[u64; 8], secret: &[u8], len: usize) -> u64 {
    let mut result = (len as u64).wrapping_mul(P64_1);
    for pair in 0..4 {
        let at = MERGE_ACCS_START + 16 * pair;
        let low = acc[2 * pair] ^ read64(secret, at);
        let high = acc[2 * pair + 1] ^ read64(secret, at + 8);
        let product = u128::from(low) * u128::from(high);
        result = result.wrapping_add(product as u64 ^ (product >> 64) as u64);
    }
    result ^= result >> 37;
    result = result.wrapping_mul(0x1656_6791_9E37_79F9);
    result ^ (result >> 32)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn xxh3_64_long(input: &[u8], secret: &[u8; XXH3_SECRET_BYTES]) -> u64 {
        let len = input.len();
        let mut acc = [_mm256_setzero_si256(); 2];
        // SAFETY (all loads and stores below): every pointer is derived from a slice and read
        // or written 32 bytes at offsets that the scalar path's slicing proves in bounds
        // (the same arithmetic: stripes of 64 within `input`, secret offsets at most
        // `XXH3_SECRET_BYTES - 64`); unaligned loads and stores take any address.
        unsafe {
            for (half, lanes) in acc.iter_mut().enumerate() {
                *lanes = _mm256_loadu_si256(INIT_ACC.as_ptr().add(4 * half).cast());
            }
            let blocks = (len - 1) / BLOCK;
            let base = input.as_ptr();
            let key = secret.as_ptr();
            for block in 0..blocks {
                for stripe in 0..STRIPES_PER_BLOCK {
                    let at = block * BLOCK + stripe * STRIPE;
                    accumulate(&mut acc, base.add(at), key.add(stripe * SECRET_CONSUME));
                }
                scramble(&mut acc, key.add(XXH3_SECRET_BYTES - STRIPE));
            }
            let stripes = ((len - 1) - blocks * BLOCK) / STRIPE;
            for stripe in 0..stripes {
                let at = blocks * BLOCK + stripe * STRIPE;
                accumulate(&mut acc, base.add(at), key.add(stripe * SECRET_CONSUME));
            }
            let last = XXH3_SECRET_BYTES - STRIPE - LAST_ACC_START;
            accumulate(&mut acc, base.add(len - STRIPE), key.add(last));
            let mut out = [0u64; 8];
            for (half, lanes) in acc.iter().enumerate() {
                _mm256_storeu_si256(out.as_mut_ptr().add(4 * half).cast(), *lanes);
            }
            merge(&out, secret, len)
        }
    }

    /// [`super::xxh3_64_long_copy`]: the same stripes as [`xxh3_64_long`], each stored to
    /// `destination` as it is loaded (the last, overlapping stripe stores bytes already stored,
    /// with the same values).
    ///
    /// # Safety
    /// AVX2; `destination` valid for writes of `input.len()` bytes apart from `input`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn xxh3_64_long_copy(
        input: &[u8],
        destination: *mut u8,
        secret: &[u8; XXH3_SECRET_BYTES],
    ) -> u64 {
        let len = input.len();
        // Streaming stores need 32-byte aligned addresses: every stripe's when `destination`
        // is aligned and the length a multiple of 32 (the last stripe starts at `len - 64`).
        let stream = (destination as usize).is_multiple_of(32) && len.is_multiple_of(32);
        let mut acc = [_mm256_setzero_si256(); 2];
        // SAFETY (all loads and stores below): the offsets are those of `xxh3_64_long`, in
        // bounds of `input` and, as `destination` is as long, of it; unaligned loads and
        // stores take any address, streaming ones only when `stream` (see above).
        unsafe {
            for (half, lanes) in acc.iter_mut().enumerate() {
                *lanes = _mm256_loadu_si256(INIT_ACC.as_ptr().add(4 * half).cast());
            }
            let blocks = (len - 1) / BLOCK;
            let (from, to, key) = (input.as_ptr(), destination, secret.as_ptr());
            for block in 0..blocks {
                for stripe in 0..STRIPES_PER_BLOCK {
                    let at = block * BLOCK + stripe * STRIPE;
                    let key = key.add(stripe * SECRET_CONSUME);
                    accumulate_copy(&mut acc, from.add(at), to.add(at), key, stream);
                }
                scramble(&mut acc, key.add(XXH3_SECRET_BYTES - STRIPE));
            }
            let stripes = ((len - 1) - blocks * BLOCK) / STRIPE;
            for stripe in 0..stripes {
                let at = blocks * BLOCK + stripe * STRIPE;
                let key = key.add(stripe * SECRET_CONSUME);
                accumulate_copy(&mut acc, from.add(at), to.add(at), key, stream);
            }
            let (at, last) = (len - STRIPE, XXH3_SECRET_BYTES - STRIPE - LAST_ACC_START);
            accumulate_copy(&mut acc, from.add(at), to.add(at), key.add(last), stream);
            // Streaming stores are weakly ordered: fence them before whatever this thread
            // does next (the write's report) can be seen.
            _mm_sfence();
            let mut out = [0u64; 8];
            for (half, lanes) in acc.iter().enumerate() {
                _mm256_storeu_si256(out.as_mut_ptr().add(4 * half).cast(), *lanes);
            }
            merge(&out, secret, len)
        }
    }

    /// [`accumulate`], storing the stripe to `destination` too.
    ///
    /// # Safety
    /// AVX2; `stripe` readable and `destination` writable for 64 bytes, `secret` readable for
    /// 64; `destination` 32-byte aligned if `stream`.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn accumulate_copy(
        acc: &mut [__m256i; 2],
        stripe: *const u8,
        destination: *mut u8,
        secret: *const u8,
        stream: bool,
    ) {
        for half in 0..2 {
            // SAFETY: the caller's bounds; 32 bytes at offset 0 or 32 of 64.
            unsafe {
                let data = _mm256_loadu_si256(stripe.add(32 * half).cast());
                let to = destination.add(32 * half).cast::<__m256i>();
                if stream {
                    _mm256_stream_si256(to, data);
                } else {
                    _mm256_storeu_si256(to, data);
                }
            }
        }
        // SAFETY: the caller's bounds.
        unsafe { accumulate(acc, stripe, secret) }
    }

    /// # Safety
    /// AVX2; `stripe` points at 64 readable bytes and `secret` at 64.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn accumulate(acc: &mut [__m256i; 2], stripe: *const u8, secret: *const u8) {
        for (half, lanes) in acc.iter_mut().enumerate() {
            // SAFETY: the caller's bounds; 32 bytes at offset 0 or 32 of 64.
            let (data, key) = unsafe {
                (
                    _mm256_loadu_si256(stripe.add(32 * half).cast()),
                    _mm256_loadu_si256(secret.add(32 * half).cast()),
                )
            };
            let keyed = _mm256_xor_si256(data, key);
            // Low × high 32 bits of each keyed lane.
            let product = _mm256_mul_epu32(keyed, _mm256_srli_epi64(keyed, 32));
            // Each lane also takes its neighbour's data (lane i ^ 1 of the 128-bit pair).
            let swapped = _mm256_shuffle_epi32(data, 0b01_00_11_10);
            *lanes = _mm256_add_epi64(product, _mm256_add_epi64(*lanes, swapped));
        }
    }

    /// # Safety
    /// AVX2; `secret` points at 64 readable bytes.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn scramble(acc: &mut [__m256i; 2], secret: *const u8) {
        let prime = _mm256_set1_epi32(P32_1 as i32);
        for (half, lanes) in acc.iter_mut().enumerate() {
            // SAFETY: the caller's bounds; 32 bytes at offset 0 or 32 of 64.
            let key = unsafe { _mm256_loadu_si256(secret.add(32 * half).cast()) };
            let mixed = _mm256_xor_si256(*lanes, _mm256_srli_epi64(*lanes, 47));
            let keyed = _mm256_xor_si256(mixed, key);
            // keyed × P32_1 mod 2^64, from two 32 × 32 products.
            let low = _mm256_mul_epu32(keyed, prime);
            let high = _mm256_mul_epu32(_mm256_srli_epi64(keyed, 32), prime);
            *lanes = _mm256_add_epi64(low, _mm256_slli_epi64(high, 32));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xxhash_rust::xxh3::xxh3_64_with_secret;

    fn secret() -> [u8; XXH3_SECRET_BYTES] {
        let mut rng = stats::SplitMix64::new(26);
        std::array::from_fn(|_| rng.next_u64() as u8)
    }

    #[test]
    fn both_paths_equal_the_reference_at_every_length_shape() {
        let secret = secret();
        let mut rng = stats::SplitMix64::new(7);
        let data: Vec<u8> = (0..400_000).map(|_| rng.next_u64() as u8).collect();
        // Around the stripe and block edges, and a real KV page (368,640 bytes).
        let lengths = [
            241, 255, 256, 257, 1023, 1024, 1025, 1087, 2048, 4097, 65_537, 368_640,
        ];
        for len in lengths.into_iter().chain((241..1500).step_by(37)) {
            let input = &data[..len];
            let reference = xxh3_64_with_secret(input, &secret);
            assert_eq!(
                xxh3_64_long_scalar(input, &secret),
                reference,
                "scalar, {len}"
            );
            assert_eq!(xxh3_64_long(input, &secret), reference, "dispatched, {len}");
        }
    }

    #[test]
    fn the_copying_hash_equals_the_hash_and_copies_exactly_its_range() {
        let secret = secret();
        let mut rng = stats::SplitMix64::new(11);
        let data: Vec<u8> = (0..370_000).map(|_| rng.next_u64() as u8).collect();
        for len in [241, 256, 1024, 1087, 4096, 4097, 368_640] {
            // Offsets 0 and 32 stream (with a length that is a multiple of 32); the others
            // take ordinary stores.
            for offset in [0, 1, 8, 32] {
                let input = &data[..len];
                let mut target = vec![0xEEu8; len + 128];
                let at = target.as_ptr().align_offset(32) + offset;
                // SAFETY: `target` has `at + len` bytes (at < 64) and is apart from `data`.
                let hash =
                    unsafe { xxh3_64_long_copy(input, target.as_mut_ptr().add(at), &secret) };
                assert_eq!(
                    hash,
                    xxh3_64_with_secret(input, &secret),
                    "{len} at {offset}"
                );
                assert_eq!(&target[at..at + len], input, "{len} at {offset}");
                assert!(
                    target[..at]
                        .iter()
                        .chain(&target[at + len..])
                        .all(|&b| b == 0xEE),
                    "a byte outside the range changed: {len} at {offset}"
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "long inputs only")]
    fn short_inputs_are_refused() {
        xxh3_64_long(&[0; XXH3_SHORT_MAX], &secret());
    }
}
