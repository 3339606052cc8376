use crate::*;
use half::f16;
use proptest::prelude::*;
use stats::SplitMix64;

/// A deterministic pseudo-random stream (xorshift) for test data.
/// Says that `what` could not be tested on this machine, and why: on stderr, and appended to
/// the file `AIRLOCK_SKIPPED_TESTS` names, which `.ci/run` prints after the run (cargo shows a
/// passing test's output only with `--nocapture`, so a skip would otherwise pass unseen).
fn skipped(what: &str, why: &str) {
    let line = format!("SKIPPED {what}: {why}");
    eprintln!("{line}");
    if let Some(path) = std::env::var_os("AIRLOCK_SKIPPED_TESTS") {
        use std::io::Write;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path);
        if let Ok(mut file) = file {
            let _ = writeln!(file, "{line}");
        }
    }
}

/// Each backend this CPU cannot run is left out of every test that loops over the backends:
/// say so once, by name.
#[test]
fn backends_this_cpu_cannot_run_are_reported() {
    let available = Backend::available();
    for backend in [Backend::Avx2, Backend::Avx512Vnni] {
        if !available.contains(&backend) {
            skipped(
                &format!("kernels {backend:?} backend"),
                "this CPU lacks its instructions; the tests over every backend ran without it",
            );
        }
    }
    assert!(available.contains(&Backend::Scalar));
}

/// GGUF-layout Q4_1 bytes for a random `rows × cols` matrix, and its dequantized values.
fn random_q41(rng: &mut SplitMix64, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::new();
    let mut values = Vec::new();
    for _ in 0..rows * cols / 32 {
        let d = f16::from_f32(rng.signed_f32().abs() * 0.1);
        let m = f16::from_f32(rng.signed_f32() * 0.5);
        bytes.extend_from_slice(&d.to_bits().to_le_bytes());
        bytes.extend_from_slice(&m.to_bits().to_le_bytes());
        let nibbles: Vec<u8> = (0..16).map(|_| rng.next_u64() as u8).collect();
        let mut block = [0f32; 32];
        for (j, &b) in nibbles.iter().enumerate() {
            block[j] = d.to_f32() * (b & 15) as f32 + m.to_f32();
            block[j + 16] = d.to_f32() * (b >> 4) as f32 + m.to_f32();
        }
        bytes.extend_from_slice(&nibbles);
        values.extend_from_slice(&block);
    }
    (bytes, values)
}

fn random_q80(rng: &mut SplitMix64, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::new();
    let mut values = Vec::new();
    for _ in 0..rows * cols / 32 {
        let d = f16::from_f32(rng.signed_f32().abs() * 0.01);
        bytes.extend_from_slice(&d.to_bits().to_le_bytes());
        for _ in 0..32 {
            let q = (rng.next_u64() as u8 as i8).max(-127);
            bytes.push(q as u8);
            values.push(d.to_f32() * q as f32);
        }
    }
    (bytes, values)
}

/// Q8Offset blocks (f16 scale, f16 offset, 32 signed bytes) for a random `rows × cols` matrix,
/// and its values.
fn random_q8_offset(rng: &mut SplitMix64, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::new();
    let mut values = Vec::new();
    for _ in 0..rows * cols / 32 {
        let d = f16::from_f32(rng.signed_f32().abs() * 0.01);
        let m = f16::from_f32(rng.signed_f32() * 0.5);
        bytes.extend_from_slice(&d.to_bits().to_le_bytes());
        bytes.extend_from_slice(&m.to_bits().to_le_bytes());
        for _ in 0..32 {
            let q = rng.next_u64() as u8 as i8;
            bytes.push(q as u8);
            values.push(q as f32 * d.to_f32() + m.to_f32());
        }
    }
    (bytes, values)
}

/// GGUF Q5_0 bytes for a random `rows × cols` matrix, and its values.
fn random_q50(rng: &mut SplitMix64, rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::new();
    let mut values = Vec::new();
    for _ in 0..rows * cols / 32 {
        let d = f16::from_f32(rng.signed_f32().abs() * 0.05);
        let qh = rng.next_u64() as u32;
        let nibbles: Vec<u8> = (0..16).map(|_| rng.next_u64() as u8).collect();
        bytes.extend_from_slice(&d.to_bits().to_le_bytes());
        bytes.extend_from_slice(&qh.to_le_bytes());
        bytes.extend_from_slice(&nibbles);
        for j in 0..32 {
            let nibble = if j < 16 {
                nibbles[j] & 15
            } else {
                nibbles[j - 16] >> 4
            };
            let q = nibble as i32 | (((qh >> j) & 1) << 4) as i32;
            values.push((q - 16) as f32 * d.to_f32());
        }
    }
    (bytes, values)
}

/// Every compute layout.
const LAYOUTS: [WeightFormat; 4] = [
    WeightFormat::Q4_1,
    WeightFormat::Q5_0,
    WeightFormat::Q8_0,
    WeightFormat::Q8Offset,
];

/// `random_q41`, `random_q80` or `random_q8_offset`, as `format` says.
fn random_weights(
    rng: &mut SplitMix64,
    format: WeightFormat,
    rows: usize,
    cols: usize,
) -> (Vec<u8>, Vec<f32>) {
    match format {
        WeightFormat::Q4_1 => random_q41(rng, rows, cols),
        WeightFormat::Q8_0 => random_q80(rng, rows, cols),
        WeightFormat::Q5_0 => random_q50(rng, rows, cols),
        WeightFormat::Q8Offset => random_q8_offset(rng, rows, cols),
    }
}

fn naive_matmul(w: &[f32], rows: usize, cols: usize, x: &[f32], tokens: usize) -> Vec<f32> {
    let mut out = vec![0f32; tokens * rows];
    for t in 0..tokens {
        for r in 0..rows {
            out[t * rows + r] = (0..cols)
                .map(|c| w[r * cols + c] as f64 * x[t * cols + c] as f64)
                .sum::<f64>() as f32;
        }
    }
    out
}

fn check_matmul(format: WeightFormat, rows: usize, cols: usize, tokens: usize, seed: u64) {
    let mut rng = SplitMix64::new(seed);
    let (bytes, values) = random_weights(&mut rng, format, rows, cols);
    let matrix = QuantMatrix::from_gguf_bytes(format, rows, cols, &bytes).unwrap();
    let x: Vec<f32> = (0..tokens * cols).map(|_| rng.signed_f32()).collect();
    let mut acts = QuantActs::default();
    quantize_acts(&x, tokens, cols, &mut acts);
    let expected = naive_matmul(&values, rows, cols, &x, tokens);
    let workers = Workers::new(2);
    let mut results = Vec::new();
    for backend in Backend::available() {
        let mut out = vec![0f32; tokens * rows];
        matrix.matmul(backend, &workers, &acts, &mut out);
        // Activation quantization error: ~|w|·|x|·sqrt(cols)/254 per output.
        let scale = expected.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        for (i, (got, want)) in out.iter().zip(&expected).enumerate() {
            assert!(
                (got - want).abs() <= 0.02 * scale,
                "{format:?} {backend:?} out[{i}] = {got}, want {want} (scale {scale})"
            );
        }
        results.push(out);
    }
    // Every backend computes the same integer sums; only float summation order differs.
    for other in &results[1..] {
        for (a, b) in results[0].iter().zip(other) {
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
                "backends disagree: {a} vs {b}"
            );
        }
    }
}

#[test]
fn q41_matmul_matches_dequantized_reference_on_every_backend() {
    check_matmul(WeightFormat::Q4_1, 64, 96, 1, 1);
    check_matmul(WeightFormat::Q4_1, 8, 32, 3, 2);
    check_matmul(WeightFormat::Q4_1, 136, 576, 5, 3);
    check_matmul(WeightFormat::Q4_1, 64, 64, 131, 12);
}

#[test]
fn q8_offset_matmul_matches_dequantized_reference_on_every_backend() {
    check_matmul(WeightFormat::Q8Offset, 64, 96, 1, 14);
    check_matmul(WeightFormat::Q8Offset, 8, 32, 4, 15);
    check_matmul(WeightFormat::Q8Offset, 200, 576, 2, 16);
    check_matmul(WeightFormat::Q8Offset, 16, 64, 70, 17);
}

#[test]
fn q50_matmul_matches_dequantized_reference_on_every_backend() {
    check_matmul(WeightFormat::Q5_0, 64, 96, 1, 18);
    check_matmul(WeightFormat::Q5_0, 8, 32, 4, 19);
    check_matmul(WeightFormat::Q5_0, 200, 576, 2, 20);
    check_matmul(WeightFormat::Q5_0, 16, 64, 70, 21);
}

#[test]
fn q80_matmul_matches_dequantized_reference_on_every_backend() {
    check_matmul(WeightFormat::Q8_0, 64, 96, 1, 4);
    check_matmul(WeightFormat::Q8_0, 8, 32, 4, 5);
    check_matmul(WeightFormat::Q8_0, 200, 576, 2, 6);
    check_matmul(WeightFormat::Q8_0, 16, 64, 70, 13);
}

/// How a matmul's rows are split into tasks (one per thread) must not change a bit: each row
/// is computed whole by one kernel call chain whatever the split, including a last task
/// with an odd number of row groups.
#[test]
fn matmul_bits_do_not_depend_on_the_thread_count() {
    let mut rng = SplitMix64::new(31);
    let pools: Vec<Workers> = [1, 2, 3].into_iter().map(Workers::new).collect();
    for format in LAYOUTS {
        for (rows, cols, tokens) in [(136, 64, 1), (200, 96, 5), (24, 32, 16), (40, 64, 70)] {
            let (bytes, _) = random_weights(&mut rng, format, rows, cols);
            let mut matrix = QuantMatrix::from_gguf_bytes(format, rows, cols, &bytes).unwrap();
            matrix.add_vnni_layout();
            let x: Vec<f32> = (0..tokens * cols).map(|_| rng.signed_f32()).collect();
            let mut acts = QuantActs::default();
            quantize_acts(&x, tokens, cols, &mut acts);
            for backend in Backend::available() {
                let outs: Vec<Vec<u32>> = pools
                    .iter()
                    .map(|workers| {
                        let mut out = vec![0f32; tokens * rows];
                        matrix.matmul(backend, workers, &acts, &mut out);
                        out.iter().map(|v| v.to_bits()).collect()
                    })
                    .collect();
                for (threads, out) in [2, 3].iter().zip(&outs[1..]) {
                    assert!(
                        *out == outs[0],
                        "{format:?} {backend:?} {rows}x{cols}x{tokens}: {threads} threads differ from 1"
                    );
                }
            }
        }
    }
}

/// The VNNI kernels must compute exactly what the AVX2 ones do (same integer sums, same float
/// steps in the same order), for every token count the run splitting can produce and for the
/// extreme bytes a hostile file may hold (Q8_0 weights of -128, nibbles of 15).
#[test]
fn vnni_matmuls_equal_avx2_bit_for_bit() {
    let available = Backend::available();
    if !available.contains(&Backend::Avx512Vnni) {
        skipped(
            "kernels::vnni_matmuls_equal_avx2_bit_for_bit",
            "no AVX-512 VNNI on this CPU",
        );
        return;
    }
    let workers = Workers::new(2);
    let mut rng = SplitMix64::new(21);
    for format in LAYOUTS {
        for (rows, cols, tokens) in [
            (8, 32, 1),
            (16, 64, 3),
            (24, 96, 7),
            (8, 64, 13),
            (64, 576, 21),
            (16, 128, 70),
            // Pairs of groups with an odd one out, over runs of 8, 4 and 1 tokens.
            (40, 64, 29),
            (48, 96, 16),
        ] {
            let mut bytes = random_weights(&mut rng, format, rows, cols).0;
            // The first block of row 0 at the extremes: all nibbles 15 / every byte -128.
            let first_block = &mut bytes[..format.block_bytes()];
            match format {
                WeightFormat::Q4_1 => first_block[4..].fill(0xFF),
                WeightFormat::Q8_0 => first_block[2..].fill(0x80),
                WeightFormat::Q5_0 => first_block[2..].fill(0xFF),
                WeightFormat::Q8Offset => first_block[4..].fill(0x80),
            }
            let matrix = QuantMatrix::from_gguf_bytes(format, rows, cols, &bytes).unwrap();
            let mut x: Vec<f32> = (0..tokens * cols).map(|_| rng.signed_f32()).collect();
            // Token 0's first block quantizes to ±127 everywhere.
            for (i, v) in x[..32].iter_mut().enumerate() {
                *v = if i % 3 == 0 { -1.0 } else { 1.0 };
            }
            let mut acts = QuantActs::default();
            quantize_acts(&x, tokens, cols, &mut acts);
            // The same matrix with the VNNI kernel's own copy of its blocks (Q8_0 only).
            let mut turned = matrix.clone();
            turned.add_vnni_layout();
            assert_eq!(turned.has_vnni_layout(), format == WeightFormat::Q8_0);
            let run = |matrix: &QuantMatrix, backend| {
                let mut out = vec![0f32; tokens * rows];
                matrix.matmul(backend, &workers, &acts, &mut out);
                out
            };
            let avx2 = run(&matrix, Backend::Avx2);
            for (layout, matrix) in [("plain", &matrix), ("turned", &turned)] {
                let vnni = run(matrix, Backend::Avx512Vnni);
                for (i, (a, v)) in avx2.iter().zip(&vnni).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        v.to_bits(),
                        "{format:?} {rows}x{cols} x{tokens} {layout}: out[{i}] avx2 {a} vs vnni {v}"
                    );
                }
            }
        }
    }
}

/// The VNNI copy is made once, counted in `bytes`, and left out where it would not be used.
#[test]
fn vnni_layout_is_a_q8_0_copy_made_only_where_vnni_runs() {
    let mut rng = SplitMix64::new(22);
    let vnni = Backend::available().contains(&Backend::Avx512Vnni);
    for format in LAYOUTS {
        let bytes = random_weights(&mut rng, format, 40, 64).0;
        let mut matrix = QuantMatrix::from_gguf_bytes(format, 40, 64, &bytes).unwrap();
        let plain = matrix.bytes();
        matrix.add_vnni_layout();
        matrix.add_vnni_layout();
        let copied = vnni && format == WeightFormat::Q8_0;
        assert_eq!(matrix.has_vnni_layout(), copied, "{format:?}");
        // 5 groups make 3 pairs (the last one twice), 2 blocks wide, 544 bytes a block.
        let copy = if copied { 3 * 2 * 544 } else { 0 };
        assert_eq!(matrix.bytes(), plain + copy, "{format:?}");
    }
}

#[test]
fn dequantize_row_recovers_every_row() {
    let mut rng = SplitMix64::new(7);
    for format in LAYOUTS {
        let (rows, cols) = (24, 64);
        let (bytes, values) = random_weights(&mut rng, format, rows, cols);
        let matrix = QuantMatrix::from_gguf_bytes(format, rows, cols, &bytes).unwrap();
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            matrix.dequantize_row(r, &mut row);
            assert_eq!(
                &row[..],
                &values[r * cols..(r + 1) * cols],
                "{format:?} row {r}"
            );
        }
    }
}

#[test]
fn concat_rows_stacks_matrices() {
    let mut rng = SplitMix64::new(8);
    let (a_bytes, a_vals) = random_q41(&mut rng, 16, 64);
    let (b_bytes, b_vals) = random_q41(&mut rng, 8, 64);
    let a = QuantMatrix::from_gguf_bytes(WeightFormat::Q4_1, 16, 64, &a_bytes).unwrap();
    let b = QuantMatrix::from_gguf_bytes(WeightFormat::Q4_1, 8, 64, &b_bytes).unwrap();
    let ab = QuantMatrix::concat_rows(&[a, b.clone()]).unwrap();
    assert_eq!(ab.rows(), 24);
    let mut row = vec![0f32; 64];
    ab.dequantize_row(3, &mut row);
    assert_eq!(&row[..], &a_vals[3 * 64..4 * 64]);
    ab.dequantize_row(20, &mut row);
    assert_eq!(&row[..], &b_vals[4 * 64..5 * 64]);
    let (c_bytes, _) = random_q41(&mut rng, 8, 32);
    let c = QuantMatrix::from_gguf_bytes(WeightFormat::Q4_1, 8, 32, &c_bytes).unwrap();
    assert!(matches!(
        QuantMatrix::concat_rows(&[b, c]),
        Err(Error::ConcatMismatch)
    ));
}

#[test]
fn concat_rows_refuses_mixed_formats() {
    let mut rng = SplitMix64::new(9);
    let (q41_bytes, _) = random_q41(&mut rng, 8, 64);
    let (q80_bytes, _) = random_q80(&mut rng, 8, 64);
    let q41 = QuantMatrix::from_gguf_bytes(WeightFormat::Q4_1, 8, 64, &q41_bytes).unwrap();
    let q80 = QuantMatrix::from_gguf_bytes(WeightFormat::Q8_0, 8, 64, &q80_bytes).unwrap();
    assert!(matches!(
        QuantMatrix::concat_rows(&[q41, q80]),
        Err(Error::ConcatMismatch)
    ));
}

/// Sharing moves blocks, never changes them: every row and every matmul result stays the
/// same, and matrices too small for a huge page alone end up in one buffer that is advised.
#[test]
fn share_buffers_keeps_every_matrix_and_advises_the_shared_buffer() {
    let mut rng = SplitMix64::new(10);
    // Eight 553 KB Q4_1 matrices (none advised alone, 4.4 MB together) and two Q8_0 ones.
    let shapes = [(WeightFormat::Q4_1, 1536, 576); 8]
        .into_iter()
        .chain([(WeightFormat::Q8_0, 16, 64), (WeightFormat::Q8_0, 8, 96)]);
    let mut matrices: Vec<QuantMatrix> = shapes
        .map(|(format, rows, cols)| {
            let (bytes, _) = random_weights(&mut rng, format, rows, cols);
            QuantMatrix::from_gguf_bytes(format, rows, cols, &bytes).unwrap()
        })
        .collect();
    assert!(matrices.iter().all(|matrix| !matrix.storage_is_advised()));
    let workers = Workers::new(2);
    let snapshot = |matrix: &QuantMatrix| {
        let mut rows = vec![0f32; matrix.rows() * matrix.cols()];
        for (r, row) in rows.chunks_exact_mut(matrix.cols()).enumerate() {
            matrix.dequantize_row(r, row);
        }
        let tokens = 3;
        let x: Vec<f32> = (0..tokens * matrix.cols())
            .map(|i| (i % 17) as f32 - 8.0)
            .collect();
        let mut acts = QuantActs::default();
        quantize_acts(&x, tokens, matrix.cols(), &mut acts);
        let mut out = vec![0f32; tokens * matrix.rows()];
        matrix.matmul(Backend::detect(), &workers, &acts, &mut out);
        (rows, out)
    };
    let before: Vec<_> = matrices.iter().map(snapshot).collect();
    QuantMatrix::share_buffers(&mut matrices.iter_mut().collect::<Vec<_>>());
    let after: Vec<_> = matrices.iter().map(snapshot).collect();
    assert!(before == after, "sharing changed a matrix");
    assert!(matrices[..8]
        .iter()
        .all(|m| m.shares_buffer_with(&matrices[0])));
    assert!(matrices[0].storage_is_advised() == cfg!(target_os = "linux"));
    assert!(matrices[9].shares_buffer_with(&matrices[8]));
    assert!(!matrices[8].shares_buffer_with(&matrices[0]));
}

#[test]
fn bad_shapes_and_lengths_are_errors() {
    let bytes = vec![0u8; 20 * 2];
    assert!(matches!(
        QuantMatrix::from_gguf_bytes(WeightFormat::Q4_1, 2, 32, &bytes),
        Err(Error::UnsupportedShape { .. })
    ));
    assert!(matches!(
        QuantMatrix::from_gguf_bytes(WeightFormat::Q4_1, 8, 32, &bytes),
        Err(Error::WrongByteLength {
            expected: 160,
            got: 40,
            ..
        })
    ));
    assert!(matches!(
        QuantMatrix::from_gguf_bytes(WeightFormat::Q8_0, usize::MAX / 8 * 8, 64, &bytes),
        Err(Error::UnsupportedShape { .. })
    ));
}

#[test]
fn quantized_activations_round_trip_within_half_a_step() {
    let mut rng = SplitMix64::new(9);
    let x: Vec<f32> = (0..128).map(|_| rng.signed_f32() * 3.0).collect();
    let mut acts = QuantActs::default();
    quantize_acts(&x, 2, 64, &mut acts);
    for (row, chunk) in x.chunks(64).enumerate() {
        for (block, values) in acts.row(row).iter().zip(chunk.chunks(32)) {
            let sum: i32 = block.qs.iter().map(|&q| q as i32).sum();
            assert_eq!(block.qsum, sum);
            assert!((block.s - block.d * sum as f32).abs() <= 1e-2 * block.s.abs().max(1e-3));
            for (&q, &v) in block.qs.iter().zip(values) {
                assert!((q as f32 * block.d - v).abs() <= block.d * 0.51 + 1e-3);
            }
        }
    }
}

#[test]
fn simd_activation_quantization_equals_the_portable_one() {
    let mut rng = SplitMix64::new(22);
    let mut x: Vec<f32> = (0..64 * 32).map(|_| rng.signed_f32() * 4.0).collect();
    // A zero block, a block of exact halves (ties round to even), one huge and one tiny value.
    x[32..64].fill(0.0);
    for (i, v) in x[64..96].iter_mut().enumerate() {
        *v = if i == 0 { 127.0 } else { i as f32 - 0.5 };
    }
    x[100] = 3.0e38;
    x[200] = -1.0e-30;
    let mut acts = QuantActs::default();
    quantize_acts(&x, 2, 1024, &mut acts);
    let portable = crate::quant::quantize_acts_portable(&x, 1024);
    let simd: Vec<&ActBlock> = (0..2).flat_map(|r| acts.row(r)).collect();
    assert_eq!(simd.len(), portable.len());
    for (i, (a, b)) in simd.iter().zip(&portable).enumerate() {
        assert_eq!(a.qs, b.qs, "block {i} bytes");
        assert_eq!(
            (a.d.to_bits(), a.s.to_bits(), a.qsum),
            (b.d.to_bits(), b.s.to_bits(), b.qsum),
            "block {i} scales"
        );
    }
}

#[test]
fn attention_scores_and_mix_agree_with_plain_arithmetic_on_every_backend() {
    let mut rng = SplitMix64::new(10);
    for (width, count) in [(8, 5), (64, 5), (64, 16), (67, 3), (16, 9)] {
        let q: Vec<f32> = (0..width).map(|_| rng.signed_f32()).collect();
        // One page of `count` slots: the keys dimension-major, the values slot-major.
        let cache: Vec<f16> = (0..width * count)
            .map(|_| f16::from_f32(rng.signed_f32()))
            .collect();
        let weights: Vec<f32> = (0..count).map(|_| rng.signed_f32().abs()).collect();
        for backend in Backend::available() {
            let mut scores = vec![0f32; count];
            attention_scores_f16(&q, &cache, count, 0.5, &mut scores);
            for (i, score) in scores.iter().enumerate() {
                let key = (0..width).map(|d| cache[crate::key_index(count, i, d)].to_f32());
                let want: f32 = q.iter().zip(key).map(|(a, b)| a * b).sum::<f32>() * 0.5;
                assert!(
                    (score - want).abs() < 1e-4,
                    "{backend:?} width {width}: {score} vs {want}"
                );
            }
            let mut out = vec![1f32; width];
            attention_mix_f16(backend, &weights, &cache, &mut out);
            for (d, o) in out.iter().enumerate() {
                let want: f32 = 1.0
                    + (0..count)
                        .map(|i| f16::from_f32(weights[i]).to_f32() * cache[i * width + d].to_f32())
                        .sum::<f32>();
                assert!(
                    (o - want).abs() < 1e-4,
                    "{backend:?} width {width}: {o} vs {want}"
                );
            }
        }
    }
}

#[test]
fn rope_rotates_pairs_and_position_zero_is_identity() {
    let table = RopeTable::new(4, 10000.0, 8);
    let mut x = vec![1.0, 2.0, 3.0, 4.0];
    rope_in_place(&table, &mut x, 0);
    assert_eq!(x, vec![1.0, 2.0, 3.0, 4.0]);
    rope_in_place(&table, &mut x, 1);
    let (c, s) = (1f32.cos(), 1f32.sin());
    assert!((x[0] - (c - 2.0 * s)).abs() < 1e-6 && (x[1] - (s + 2.0 * c)).abs() < 1e-6);
    // Rotation preserves the norm of each pair.
    assert!(((x[2] * x[2] + x[3] * x[3]) - 25.0).abs() < 1e-4);
}

#[test]
fn rms_norm_and_softmax_basics() {
    let mut out = vec![0f32; 4];
    rms_norm(&[1.0, -1.0, 1.0, -1.0], &[2.0; 4], 0.0, &mut out);
    assert_eq!(out, vec![2.0, -2.0, 2.0, -2.0]);
    let mut p = vec![0.0, 0.0, f32::NEG_INFINITY, 2f32.ln()];
    softmax_in_place(Backend::Scalar, &mut p);
    assert!((p[0] - 0.25).abs() < 1e-6 && p[2] == 0.0 && (p[3] - 0.5).abs() < 1e-6);
}

/// RMSNorm of rows side by side gives each row the bits of `rms_norm` alone, for every count
/// of rows up to two groups of four and more, at the model's width and an odd one.
#[test]
fn rms_norm_of_rows_side_by_side_equals_each_row_alone_bit_for_bit() {
    let mut rng = SplitMix64::new(23);
    for width in [7, 576] {
        let weight: Vec<f32> = (0..width).map(|_| rng.signed_f32() * 2.0).collect();
        for rows in 1..=9 {
            // Magnitudes from 1e-3 to 1e3: rows' norms differ widely, so a row normed with
            // another row's sum shows.
            let x: Vec<f32> = (0..rows * width)
                .map(|i| rng.signed_f32() * 10f32.powi((i % 7) as i32 - 3))
                .collect();
            let mut together = vec![0f32; x.len()];
            rms_norm_rows(&x, &weight, 1e-5, &mut together);
            for (r, (x, got)) in x.chunks(width).zip(together.chunks(width)).enumerate() {
                let mut alone = vec![0f32; width];
                rms_norm(x, &weight, 1e-5, &mut alone);
                let same = alone
                    .iter()
                    .zip(got)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "width {width}, {rows} rows: row {r} differs");
            }
        }
    }
}

/// SwiGLU and softmax (the two `expf` users) give every backend the same bits, and softmax
/// of rows side by side gives each row the bits of softmax alone, at lengths
/// that leave partial registers of 8 and 16 lanes, and with values past `expf`'s special
/// thresholds (|x| ≥ 88, ±∞) among ordinary ones.
#[test]
fn silu_and_softmax_bits_are_the_same_on_every_backend() {
    let mut rng = SplitMix64::new(17);
    let specials = [f32::INFINITY, f32::NEG_INFINITY, 95.0, -95.0, -104.0, 88.5];
    for len in (1..=40).chain([79, 80, 81, 1536]) {
        let values: Vec<f32> = (0..len)
            .map(|i| match i % 11 {
                3 => specials[(i / 11) % specials.len()],
                _ => rng.signed_f32() * 20.0,
            })
            .collect();
        let up: Vec<f32> = (0..len).map(|_| rng.signed_f32() * 2.0).collect();
        let finite: Vec<f32> = values.iter().map(|v| v.clamp(-30.0, 30.0)).collect();
        let run = |backend| {
            let mut silu = values.clone();
            silu_mul(backend, &mut silu, &up);
            let mut probs = finite.clone();
            softmax_in_place(backend, &mut probs);
            (silu, probs)
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let (silu, probs) = run(Backend::Scalar);
        // Attention's softmax: six rows at once, each its own values (the ones above, then
        // shifted copies), with the probabilities rounded to f16.
        let rows: Vec<f32> = (0..6)
            .flat_map(|r| finite.iter().map(move |v| v + r as f32 * 0.37))
            .collect();
        // And two rows whose values lie 88 and more below their largest (95 or 88.5 beside
        // ordinary ones: `expf`'s special cases after the shift) and −∞ (a masked position).
        let spread: Vec<f32> = (0..2)
            .flat_map(|r| {
                values.iter().map(move |&v| match v {
                    f32::INFINITY => f32::NEG_INFINITY,
                    v => v - r as f32 * 0.37,
                })
            })
            .collect();
        let alone = |rows: &[f32]| -> Vec<f32> {
            rows.chunks(len)
                .flat_map(|row| {
                    let mut row = row.to_vec();
                    crate::ops::attention_softmax_rows(Backend::Scalar, &mut row, len);
                    row
                })
                .collect()
        };
        let (rows_alone, spread_alone) = (alone(&rows), alone(&spread));
        // Within an f16 rounding of the plain softmax.
        let mut plain = rows[..len].to_vec();
        softmax_in_place(Backend::Scalar, &mut plain);
        for (i, (&a, &p)) in rows_alone.iter().zip(&plain).enumerate() {
            assert!((a - p).abs() <= p.abs() / 1024.0 + 1e-7, "[{i}] {a} vs {p}");
        }
        assert!(
            spread_alone.iter().all(|p| (0.0..=1.0).contains(p)),
            "probabilities, length {len}"
        );
        for backend in Backend::available() {
            let (s, p) = run(backend);
            assert_eq!(bits(&s), bits(&silu), "{backend:?} SwiGLU, length {len}");
            assert_eq!(bits(&p), bits(&probs), "{backend:?} softmax, length {len}");
            for (rows, alone) in [(&rows, &rows_alone), (&spread, &spread_alone)] {
                let mut together = rows.clone();
                crate::ops::attention_softmax_rows(backend, &mut together, len);
                assert_eq!(
                    bits(&together),
                    bits(alone),
                    "{backend:?} attention softmax, length {len}"
                );
            }
        }
    }
}

proptest! {
    #[test]
    fn matmul_never_panics_on_arbitrary_weight_bytes(bytes in proptest::collection::vec(any::<u8>(), 8 * 36 * 2)) {
        for format in LAYOUTS {
            let len = 8 * 2 * format.block_bytes();
            let matrix = QuantMatrix::from_gguf_bytes(format, 8, 64, &bytes[..len]).unwrap();
            let mut acts = QuantActs::default();
            quantize_acts(&[0.5; 64], 1, 64, &mut acts);
            let workers = Workers::new(1);
            for backend in Backend::available() {
                let mut out = vec![0f32; 8];
                matrix.matmul(backend, &workers, &acts, &mut out);
            }
        }
    }
}

/// The `ggml-exact` Q4_1 kernel's AVX2 version gives the portable version's floats, bit for
/// bit, for several tokens and rows.
#[test]
fn ggml_exact_q41_simd_equals_portable() {
    if !crate::backend::has_avx2() {
        skipped(
            "kernels::ggml_exact_q41_simd_equals_portable",
            "this CPU has no AVX2, so there is no SIMD version to compare",
        );
        return;
    }
    let (rows, cols, tokens) = (16, 256, 5);
    let mut rng = SplitMix64::new(77);
    let (bytes, _) = random_q41(&mut rng, rows, cols);
    let matrix = QuantMatrix::from_gguf_bytes(WeightFormat::Q4_1, rows, cols, &bytes).unwrap();
    let x: Vec<f32> = (0..tokens * cols).map(|_| rng.signed_f32() * 3.0).collect();
    let mut acts = QuantActs::default();
    quantize_acts(&x, tokens, cols, &mut acts);
    let blocks = matrix.q41_blocks().expect("a Q4_1 matrix");
    let per_group = cols / BLOCK;
    let run = |kernel: fn(&[crate::layout::Q41GroupBlock], crate::layout::GroupJob)| {
        let mut out = vec![0f32; rows * tokens];
        let mut token_rows: Vec<&mut [f32]> = out.chunks_exact_mut(rows).collect();
        for group in 0..rows / 8 {
            let job = crate::layout::GroupJob::new(&acts, 0..tokens, &mut token_rows, group * 8, 8);
            kernel(&blocks[group * per_group..(group + 1) * per_group], job);
        }
        out
    };
    let portable = run(crate::ggml_exact::q41_group_portable);
    let dispatched = run(crate::ggml_exact::q41_group);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&portable), bits(&dispatched));
    // And `matmul` with the ggml-exact backend routes to this kernel.
    let mut via_matrix = vec![0f32; rows * tokens];
    matrix.matmul(Backend::GgmlExact, &Workers::new(1), &acts, &mut via_matrix);
    assert_eq!(bits(&via_matrix), bits(&portable));
}

/// K or V pages for `len` positions of one head (`page_size` slots each, laid out as
/// `KvHeadAttention` reads that kind), random; the slots past `len` hold NaN, so a kernel
/// that read one would give NaN.
fn random_pages(
    rng: &mut SplitMix64,
    kind: Kind,
    len: usize,
    page_size: usize,
    head_dim: usize,
) -> Vec<Vec<f16>> {
    let mut pages: Vec<Vec<f16>> = (0..len.div_ceil(page_size))
        .map(|_| {
            (0..page_size * head_dim)
                .map(|_| f16::from_f32(rng.signed_f32() * 2.0))
                .collect()
        })
        .collect();
    let last = pages.len() - 1;
    for slot in len - last * page_size..page_size {
        for d in 0..head_dim {
            pages[last][kind.index(page_size, head_dim, slot, d)] = f16::NAN;
        }
    }
    pages
}

/// Which half of the cache a page holds: keys dimension-major, values slot-major.
#[derive(Clone, Copy)]
enum Kind {
    Keys,
    Values,
}

impl Kind {
    fn index(self, page_size: usize, head_dim: usize, slot: usize, d: usize) -> usize {
        match self {
            Kind::Keys => crate::key_index(page_size, slot, d),
            Kind::Values => slot * head_dim + d,
        }
    }
}

/// Grouped attention: every backend within float tolerance of the plain per-head arithmetic
/// (`Scalar`) and bit-equal to its own per-head page-wise kernels (the path it replaced); on
/// each backend a head's bits do not depend on how many heads shared the call; over lengths
/// that end mid-page, on a page boundary and inside a four-key pass, and a head size that
/// is not whole registers (the per-head fallback).
#[test]
fn grouped_attention_agrees_with_per_head_arithmetic_and_not_with_its_group() {
    let mut rng = SplitMix64::new(33);
    for (head_dim, heads, page_size, len) in [
        (64, 3, 16, 1),
        (64, 3, 16, 16),
        (64, 3, 16, 37),
        (64, 2, 8, 21),
        (64, 4, 16, 130),
        (32, 3, 16, 5),
        (24, 3, 4, 11),
        (20, 3, 4, 9),
        // Many registers of keys: whole passes and a last partial one, for each group size.
        (64, 3, 16, 300),
        (64, 2, 16, 190),
        (64, 1, 16, 205),
        // Runs shorter than an AVX-512 register (pages of 8), longer pages, two mix passes of
        // AVX-512, and a head size only AVX2 takes.
        (64, 3, 8, 77),
        (64, 3, 32, 100),
        (128, 3, 16, 50),
        (48, 3, 16, 40),
    ] {
        let keys = random_pages(&mut rng, Kind::Keys, len, page_size, head_dim);
        let values = random_pages(&mut rng, Kind::Values, len, page_size, head_dim);
        let key_pages: Vec<&[f16]> = keys.iter().map(Vec::as_slice).collect();
        let value_pages: Vec<&[f16]> = values.iter().map(Vec::as_slice).collect();
        let attention = KvHeadAttention {
            keys: &key_pages,
            values: &value_pages,
            page_size,
            head_dim,
            len,
            masked: 0,
            scale: 0.125,
        };
        let queries: Vec<f32> = (0..heads * head_dim)
            .map(|_| rng.signed_f32() * 4.0)
            .collect();
        let run_all = |backend| {
            let mut out = vec![0f32; queries.len()];
            attention.run(backend, &queries, &mut out);
            out
        };
        let plain = run_all(Backend::Scalar);
        let mut simd_bits: Option<Vec<u32>> = None;
        for backend in Backend::available() {
            let grouped = run_all(backend);
            if backend != Backend::Scalar {
                // AVX2 and AVX-512 run the same chains of FMAs: the same bits.
                let bits: Vec<u32> = grouped.iter().map(|v| v.to_bits()).collect();
                let first = simd_bits.get_or_insert_with(|| bits.clone());
                assert!(
                    *first == bits,
                    "{backend:?} head_dim {head_dim} len {len}: bits differ from AVX2's"
                );
            }
            let mut one_by_one = vec![0f32; queries.len()];
            for (q, out) in queries
                .chunks_exact(head_dim)
                .zip(one_by_one.chunks_exact_mut(head_dim))
            {
                attention.run(backend, q, out);
            }
            let mut per_head = vec![0f32; queries.len()];
            attention.run_per_head(backend, &queries, &mut per_head);
            let case = format!("{backend:?} head_dim {head_dim} heads {heads} len {len}");
            for (i, (&g, &h)) in grouped.iter().zip(&per_head).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    h.to_bits(),
                    "{case}: out[{i}] vs per-head kernels"
                );
            }
            for (i, ((&g, &o), &p)) in grouped.iter().zip(&one_by_one).zip(&plain).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    o.to_bits(),
                    "{case}: out[{i}] grouped vs alone"
                );
                assert!(g.is_finite(), "{case}: out[{i}] read a slot past len");
                assert!((g - p).abs() < 2e-3, "{case}: out[{i}] {g} vs plain {p}");
            }
        }
    }
}

/// A block of rows at consecutive positions (`run_rows`, prefill's attention) gets, on every
/// backend, the bits each row gets alone from `run`: blocks that start and end mid-page, on a
/// page boundary, inside a four-key group, with rows that see only part of the last run of
/// keys, under a window's mask, and head sizes the block kernels do not take (the row-by-row
/// fallback). Slots past the last row's length hold NaN, so a read past it shows.
#[test]
fn a_block_of_rows_gets_the_bits_of_each_row_alone() {
    let mut rng = SplitMix64::new(57);
    for (head_dim, heads, page_size, len, rows, masked) in [
        (64, 3, 16, 2, 2, 0),
        (64, 3, 16, 16, 5, 0),
        (64, 3, 16, 37, 8, 0),
        (64, 3, 16, 37, 37, 0),
        (64, 3, 16, 300, 16, 0),
        (64, 2, 8, 77, 11, 0),
        (64, 1, 32, 100, 9, 0),
        (64, 4, 16, 130, 7, 0),
        (128, 3, 16, 50, 6, 0),
        (256, 2, 16, 40, 4, 0),
        (64, 3, 16, 60, 10, 7),
        (48, 3, 16, 40, 6, 0),
        (24, 3, 4, 11, 3, 0),
    ] {
        let keys = random_pages(&mut rng, Kind::Keys, len, page_size, head_dim);
        let values = random_pages(&mut rng, Kind::Values, len, page_size, head_dim);
        let key_pages: Vec<&[f16]> = keys.iter().map(Vec::as_slice).collect();
        let value_pages: Vec<&[f16]> = values.iter().map(Vec::as_slice).collect();
        let attention = KvHeadAttention {
            keys: &key_pages,
            values: &value_pages,
            page_size,
            head_dim,
            len,
            masked,
            scale: 0.125,
        };
        let width = heads * head_dim;
        let queries: Vec<f32> = (0..rows * width).map(|_| rng.signed_f32() * 4.0).collect();
        let query_rows: Vec<&[f32]> = queries.chunks_exact(width).collect();
        #[cfg(target_arch = "x86_64")]
        block_scores_match_each_row_alone(&attention, &query_rows);
        for backend in Backend::available() {
            let case = format!("{backend:?} head_dim {head_dim} heads {heads} page {page_size} len {len} rows {rows}");
            let mut together = vec![f32::NAN; rows * width];
            attention.run_rows(backend, &query_rows, &mut together);
            for (i, (q, got)) in query_rows
                .iter()
                .zip(together.chunks_exact(width))
                .enumerate()
            {
                let alone = KvHeadAttention {
                    len: len + 1 - rows + i,
                    ..attention
                };
                let mut want = vec![0f32; width];
                alone.run(backend, q, &mut want);
                assert!(
                    got.iter().all(|v| v.is_finite()),
                    "{case}: row {i} read past its length"
                );
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(got), bits(&want), "{case}: row {i}");
            }
        }
    }
}

/// Each ISA's block scores kernel's raw scores, bit for bit its per-row kernel's: softmax's
/// rounding to f16 would hide most low-bit differences (a row folding a page's last keys as
/// another row's length would fold them, say), so the scores are compared before it.
#[cfg(target_arch = "x86_64")]
fn block_scores_match_each_row_alone(attention: &KvHeadAttention, queries: &[&[f32]]) {
    use crate::attention::{GroupedKernels, RowBlock, RowKernels, HEADS_PER_PASS};
    use crate::{attention_avx512, avx2};
    let (head_dim, len, rows) = (attention.head_dim, attention.len, queries.len());
    let isas: [(bool, &RowKernels, &GroupedKernels); 2] = [
        (
            attention_avx512::fits(head_dim),
            &attention_avx512::ROW_KERNELS,
            &attention_avx512::KERNELS,
        ),
        (
            avx2::attention_fits(head_dim),
            &avx2::ROW_KERNELS,
            &avx2::ATTENTION_KERNELS,
        ),
    ];
    for (fits, block_kernels, row_kernels) in isas {
        if !fits || rows < 2 {
            continue;
        }
        let width = queries[0].len();
        let heads = width / head_dim;
        let block = RowBlock {
            rows,
            first_len: len + 1 - rows,
            q_stride: width,
            probs_stride: heads * len,
        };
        let q: Vec<f32> = queries.concat();
        let mut together = vec![f32::NAN; rows * heads * len];
        let mut tile = vec![0f32; block_kernels.positions * head_dim];
        for first in (0..heads).step_by(HEADS_PER_PASS) {
            let g = (heads - first).min(HEADS_PER_PASS);
            // SAFETY: `fits` checked the CPU and head size; the attention's pages are whole
            // for `len`, and the slices are the block's.
            unsafe {
                (block_kernels.scores)(
                    attention,
                    &block,
                    g,
                    &q[first * head_dim..],
                    &mut together[first * len..],
                    &mut tile,
                )
            };
        }
        for (i, q) in queries.iter().enumerate() {
            let row_len = len + 1 - rows + i;
            let alone = KvHeadAttention {
                len: row_len,
                ..*attention
            };
            let mut want = vec![0f32; heads * row_len];
            for (q, want) in q
                .chunks(HEADS_PER_PASS * head_dim)
                .zip(want.chunks_mut(HEADS_PER_PASS * row_len))
            {
                // SAFETY: as above, with the row's own length.
                unsafe { (row_kernels.scores)(&alone, q, want) };
            }
            for (h, want) in want.chunks_exact(row_len).enumerate() {
                let got = &together[i * heads * len + h * len..][..row_len];
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(got),
                    bits(want),
                    "positions {} len {len} rows {rows}: row {i} head {h}",
                    block_kernels.positions
                );
            }
        }
    }
}

/// Attention prefetches only pages whose every slot holds a position below `len`: a slot
/// past it may hold an earlier owner's bytes.
#[test]
fn only_whole_pages_count_as_full() {
    let (page_size, head_dim) = (8, 4);
    let no_pages: Vec<&[f16]> = Vec::new();
    for len in 1..=30 {
        let att = crate::KvHeadAttention {
            keys: &no_pages,
            values: &no_pages,
            page_size,
            head_dim,
            len,
            masked: 0,
            scale: 1.0,
        };
        for page in 0..6 {
            let full = (0..page_size).all(|slot| page * page_size + slot < len);
            assert_eq!(att.page_is_full(page), full, "len {len}, page {page}");
        }
        assert!(!att.page_is_full(usize::MAX), "no overflow");
        assert!(!att.page_is_full(usize::MAX / page_size), "no overflow");
    }
}

/// Frequency factors divide each pair's angle; none (or all 1) leave the table's bits alone.
#[test]
fn rope_frequency_factors_divide_each_pairs_angle() {
    let (head_dim, base, positions) = (8, 10_000.0, 40);
    let plain = RopeTable::new(head_dim, base, positions);
    let ones = RopeTable::with_freq_factors(head_dim, base, positions, &[1.0; 4]);
    let scaled = RopeTable::with_freq_factors(head_dim, base, positions, &[1.0, 2.0, 4.0, 8.0]);
    let rotate = |table: &RopeTable, pos| {
        let mut x = [1.0f32, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0];
        table.apply(&mut x, pos);
        x
    };
    for pos in 0..positions {
        assert_eq!(rotate(&plain, pos), rotate(&ones, pos), "position {pos}");
        let (x, expected) = (rotate(&scaled, pos), rotate(&plain, pos));
        // Pair 0 is unscaled; pair 3's angle is an eighth of the plain one's.
        assert_eq!(x[..2], expected[..2]);
        let plain_angle = expected[7].atan2(expected[6]);
        let angle = x[7].atan2(x[6]);
        if pos > 0 {
            assert!((angle - plain_angle / 8.0).abs() < 1e-5, "position {pos}");
        }
    }
}

/// The halves style (llama.cpp's "neox", qwen's and gemma's) rotates value i with value
/// i + head_dim/2 by pair i's angle: the adjacent style's bits on the values reordered so
/// those two sit side by side.
#[test]
fn rope_halves_style_rotates_value_i_with_value_i_plus_half() {
    let (head_dim, heads, positions) = (8, 2, 12);
    let adjacent = RopeTable::new(head_dim, 10_000.0, positions);
    let halves = RopeTable::new(head_dim, 10_000.0, positions).with_style(RopeStyle::Halves);
    assert_eq!(halves.style(), RopeStyle::Halves);
    let x: Vec<f32> = (0..head_dim * heads)
        .map(|i| (i as f32 * 0.7).sin())
        .collect();
    // Within each head, halves order (i, i + half) → adjacent order (2i, 2i + 1).
    let half = head_dim / 2;
    let interleaved = |v: &[f32]| -> Vec<f32> {
        v.chunks_exact(head_dim)
            .flat_map(|h| (0..half).flat_map(move |i| [h[i], h[i + half]]))
            .collect()
    };
    for pos in 0..positions {
        let mut by_halves = x.clone();
        halves.apply(&mut by_halves, pos);
        let mut by_adjacent = interleaved(&x);
        adjacent.apply(&mut by_adjacent, pos);
        assert_eq!(interleaved(&by_halves), by_adjacent, "position {pos}");
        if pos > 0 {
            let mut plain = x.clone();
            adjacent.apply(&mut plain, pos);
            assert_ne!(plain, by_halves, "the styles differ at position {pos}");
        }
    }
}

/// A sliding window's start (`masked`): on every backend, what the keys and values before it
/// hold does not move a bit of the output, and the output is softmax over the kept positions
/// alone (within float tolerance of an f64 computation over them).
#[test]
fn masked_positions_get_no_weight_on_every_backend() {
    let mut rng = SplitMix64::new(71);
    for (head_dim, heads, page_size, len, masked) in [
        (64, 3, 16, 37, 5),
        (32, 1, 16, 16, 15),
        (256, 4, 16, 40, 9),
        (24, 3, 4, 11, 3),
    ] {
        let keys = random_pages(&mut rng, Kind::Keys, len, page_size, head_dim);
        let values = random_pages(&mut rng, Kind::Values, len, page_size, head_dim);
        let queries: Vec<f32> = (0..heads * head_dim)
            .map(|_| rng.signed_f32() * 2.0)
            .collect();
        let run = |keys: &[Vec<f16>], values: &[Vec<f16>], masked, backend| {
            let key_pages: Vec<&[f16]> = keys.iter().map(Vec::as_slice).collect();
            let value_pages: Vec<&[f16]> = values.iter().map(Vec::as_slice).collect();
            let attention = KvHeadAttention {
                keys: &key_pages,
                values: &value_pages,
                page_size,
                head_dim,
                len,
                masked,
                scale: 1.0 / (head_dim as f32).sqrt(),
            };
            let mut out = vec![0f32; queries.len()];
            attention.run(backend, &queries, &mut out);
            out
        };
        // Other (finite) keys and values before the window.
        let (mut other_keys, mut other_values) = (keys.clone(), values.clone());
        for slot in 0..masked {
            for d in 0..head_dim {
                let k = Kind::Keys.index(page_size, head_dim, slot, d);
                other_keys[0][k] = f16::from_f32(rng.signed_f32() * 8.0);
                let v = Kind::Values.index(page_size, head_dim, slot, d);
                other_values[0][v] = f16::from_f32(rng.signed_f32() * 8.0);
            }
        }
        let key_at = |slot: usize, d| {
            let page = &keys[slot / page_size];
            page[Kind::Keys.index(page_size, head_dim, slot % page_size, d)].to_f32() as f64
        };
        let value_at = |slot: usize, d| {
            let page = &values[slot / page_size];
            page[Kind::Values.index(page_size, head_dim, slot % page_size, d)].to_f32() as f64
        };
        for backend in Backend::available() {
            let case = format!("{backend:?} head_dim {head_dim} len {len} masked {masked}");
            let out = run(&keys, &values, masked, backend);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&out),
                bits(&run(&other_keys, &other_values, masked, backend)),
                "{case}"
            );
            assert_ne!(bits(&out), bits(&run(&keys, &values, 0, backend)), "{case}");
            for (h, q) in queries.chunks_exact(head_dim).enumerate() {
                let scores: Vec<f64> = (masked..len)
                    .map(|p| {
                        let dot: f64 = (0..head_dim).map(|d| q[d] as f64 * key_at(p, d)).sum();
                        dot / (head_dim as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for d in 0..head_dim {
                    let want: f64 = (masked..len)
                        .zip(&weights)
                        .map(|(p, w)| w / total * value_at(p, d))
                        .sum();
                    let got = out[h * head_dim + d] as f64;
                    assert!(
                        (got - want).abs() < 2e-2,
                        "{case}: head {h} dim {d}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

/// GeGLU reads GELU from a table of f16 inputs, as llama.cpp does: within f16 rounding of
/// the formula, exact at 0, identity past 10 and 0 below −10.
#[test]
fn gelu_mul_follows_the_tanh_formula_through_f16() {
    let xs = [
        -12.0f32, -10.0, -3.0, -0.5, 0.0, 0.1, 0.7, 2.5, 9.99, 10.0, 30.0,
    ];
    let mut gate = xs.to_vec();
    gelu_mul(&mut gate, &[2.0; 11]);
    for (&x, &g) in xs.iter().zip(&gate) {
        let want = 2.0
            * if x <= -10.0 {
                0.0
            } else if x >= 10.0 {
                x
            } else {
                gelu(x)
            };
        assert!(
            (g - want).abs() <= want.abs() * 2e-3 + 1e-6,
            "gelu({x}): {g} vs {want}"
        );
    }
    assert_eq!(gate[4], 0.0);
    assert!((gelu(1.0) - 0.841_192).abs() < 1e-5, "the tanh form at 1");
}
