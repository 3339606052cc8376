use super::transcode::quantize_q8_0_block;
use super::*;
use crate::{quantize_acts, Backend, QuantActs, QuantMatrix, Workers};
use half::f16;
use stats::SplitMix64;

/// A format's test vectors: blocks, and what llama.cpp's gguf-py makes of them
/// (`tests/data/formats/blocks`, written by `scripts/reference/make_format_vectors.py`).
fn vectors(format: TensorFormat) -> (Vec<u8>, Vec<f32>) {
    let path = format!(
        "{}/../../tests/data/formats/blocks/{}.bin",
        env!("CARGO_MANIFEST_DIR"),
        format.name()
    );
    let file = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let count = u32::from_le_bytes(file[0..4].try_into().unwrap()) as usize;
    let (blocks, values) = file[4..].split_at(count * format.block_bytes());
    let values: Vec<f32> = values
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(values.len(), count * format.block_values(), "{path}");
    (blocks.to_vec(), values)
}

#[test]
fn each_reference_dequantizer_gives_llama_cpps_values_bit_for_bit() {
    for format in TensorFormat::ALL {
        let (blocks, expected) = vectors(format);
        let mut got = vec![f32::NAN; expected.len()];
        format.dequantize(&blocks, &mut got);
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g.to_bits(), e.to_bits(), "{format} value {i}: {g} vs {e}");
        }
    }
}

#[test]
fn names_and_sizes_are_ggmls() {
    for format in TensorFormat::ALL {
        assert_eq!(TensorFormat::from_name(format.name()), Some(format));
    }
    assert_eq!(TensorFormat::from_name("IQ2_XS"), None);
    assert!(TensorFormat::supported_names().contains("Q6_K"));
    assert_eq!(TensorFormat::Q4_K.row_bytes(512), Some(288));
    assert_eq!(TensorFormat::Q4_K.row_bytes(576), None);
    assert_eq!(TensorFormat::BF16.row_bytes(3), Some(6));
}

/// The largest distance from a layout's values to the reference's that `fidelity` allows,
/// for one 32-value block of the layout.
fn allowed_error(fidelity: Fidelity, layout: WeightFormat, block: &[u8], reference: &[f32]) -> f32 {
    match fidelity {
        Fidelity::Exact => 0.0,
        Fidelity::RoundedScales => {
            // The largest integer a rounded-scale layout holds: Q4_K's 15, Q5_K's 31.
            let largest = match layout {
                WeightFormat::Q4_1 => 15.0,
                WeightFormat::Q8Offset => 31.0,
                WeightFormat::Q5_0 | WeightFormat::Q8_0 => {
                    panic!("scales are rounded into Q4_1 or Q8Offset")
                }
            };
            let (d, m) = (f16_at(block), f16_at(&block[2..]));
            (largest * d.abs() + m.abs()) * 2f32.powi(-11) * 1.001
        }
        Fidelity::Requantized => {
            let amax = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
            amax / 254.0 * 1.002
        }
    }
}

/// Checks that `bytes` (`rows × cols` of `format`) transcoded into `layout` keeps every value
/// within what its fidelity states.
fn check_transcoding(
    format: TensorFormat,
    rows: usize,
    cols: usize,
    bytes: &[u8],
    common: bool,
) -> Fidelity {
    let mut transcoded = transcode(format, rows, cols, bytes).unwrap();
    if common {
        transcoded = into_layout(transcoded, WeightFormat::Q8Offset).unwrap();
    }
    let mut reference = vec![0f32; rows * cols];
    format.dequantize(bytes, &mut reference);
    let got = layout_values(transcoded.layout, &transcoded.bytes);
    let blocks = transcoded
        .bytes
        .chunks_exact(transcoded.layout.block_bytes());
    for (b, ((block, got), want)) in blocks
        .zip(got.chunks_exact(32))
        .zip(reference.chunks_exact(32))
        .enumerate()
    {
        let allowed = allowed_error(transcoded.fidelity, transcoded.layout, block, want);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let error = (g - w).abs();
            assert!(
                error <= allowed,
                "{format} → {:?} ({:?}), block {b} value {i}: {g} vs {w}, allowed {allowed}",
                transcoded.layout,
                transcoded.fidelity
            );
        }
    }
    transcoded.fidelity
}

#[test]
fn every_format_reaches_a_compute_layout_within_its_stated_fidelity() {
    for format in TensorFormat::ALL {
        let (blocks, _) = vectors(format);
        let cols = format.block_values().max(32);
        let rows = blocks.len() / format.row_bytes(cols).unwrap();
        let fidelity = check_transcoding(format, rows, cols, &blocks, false);
        let expected = match format {
            TensorFormat::Q4_0
            | TensorFormat::Q4_1
            | TensorFormat::Q5_0
            | TensorFormat::Q5_1
            | TensorFormat::Q8_0 => Fidelity::Exact,
            TensorFormat::Q4_K | TensorFormat::Q5_K => Fidelity::RoundedScales,
            _ => Fidelity::Requantized,
        };
        assert_eq!(fidelity, expected, "{format}");
        // In the common layout (to be stacked with other formats), each keeps its fidelity.
        assert_eq!(
            check_transcoding(format, rows, cols, &blocks, true),
            fidelity
        );
    }
}

#[test]
fn q4_k_whose_scales_overflow_an_f16_is_requantized() {
    let (mut blocks, _) = vectors(TensorFormat::Q4_K);
    // d = 60000: d · sc overflows an f16 for any 6-bit scale above 1.
    blocks[0..2].copy_from_slice(&f16::from_f32(60_000.0).to_le_bytes());
    blocks[4] = 63;
    let transcoded = transcode(TensorFormat::Q4_K, 8, 256, &blocks).unwrap();
    assert_eq!(transcoded.layout, WeightFormat::Q8_0);
    assert_eq!(transcoded.fidelity, Fidelity::Requantized);
}

#[test]
fn hostile_bytes_get_errors_or_values_never_a_panic() {
    for format in TensorFormat::ALL {
        let (blocks, _) = vectors(format);
        let cols = format.block_values().max(32);
        let row = format.row_bytes(cols).unwrap();
        let rows = blocks.len() / row;
        assert!(transcode(format, rows, cols, &blocks[..blocks.len() - 1]).is_err());
        assert!(transcode(format, rows + 1, cols, &blocks).is_err());
        assert!(transcode(format, rows, cols + 1, &blocks).is_err());
        assert!(transcode(format, usize::MAX, cols, &blocks).is_err());
        // An empty matrix (a width or height of 0 in a hostile header) is refused.
        assert!(transcode(format, rows, 0, &[]).is_err());
        assert!(transcode(format, 0, cols, &[]).is_err());
        // Every f16 a NaN or an infinity: values may be NaN, but nothing panics.
        for fill in [0xFFu8, 0x7C] {
            let hostile = vec![fill; rows * row];
            let transcoded = transcode(format, rows, cols, &hostile).unwrap();
            let transcoded = into_layout(transcoded, WeightFormat::Q8Offset).unwrap();
            assert_eq!(transcoded.bytes.len() % transcoded.layout.block_bytes(), 0);
        }
    }
}

#[test]
fn requantizing_rounds_to_the_nearest_step_of_an_f16_scale() {
    let x: Vec<f32> = (0..32).map(|i| (i as f32 - 15.5) * 0.37).collect();
    let block = quantize_q8_0_block(&x);
    let d = f16_at(&block);
    assert_eq!(d, f16::from_f32(5.735 / 127.0).to_f32());
    for (q, v) in block[2..].iter().zip(&x) {
        assert_eq!(*q as i8 as f32, (v / d).round(), "{v}");
    }
    assert_eq!(quantize_q8_0_block(&[0.0; 32])[2..], [0u8; 32]);
}

/// Random valid blocks of `format` for a `rows × cols` tensor: random bytes, each f16 scale a
/// finite value of a weight's size.
fn random_tensor(rng: &mut SplitMix64, format: TensorFormat, rows: usize, cols: usize) -> Vec<u8> {
    let len = rows * format.row_bytes(cols).unwrap();
    match format {
        TensorFormat::F32 => {
            return (0..len / 4)
                .flat_map(|_| (rng.signed_f32() * 0.1).to_le_bytes())
                .collect();
        }
        TensorFormat::F16 | TensorFormat::BF16 => {
            return (0..len / 2)
                .flat_map(|_| {
                    let v = rng.signed_f32() * 0.1;
                    match format {
                        TensorFormat::F16 => f16::from_f32(v).to_le_bytes(),
                        _ => ((v.to_bits() >> 16) as u16).to_le_bytes(),
                    }
                })
                .collect();
        }
        _ => {}
    }
    let scales: &[usize] = match format {
        TensorFormat::Q4_0 | TensorFormat::Q5_0 | TensorFormat::Q8_0 => &[0],
        TensorFormat::Q6_K => &[208],
        _ => &[0, 2],
    };
    let mut bytes: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
    for block in bytes.chunks_exact_mut(format.block_bytes()) {
        for &at in scales {
            let scale = f16::from_f32(rng.signed_f32() * 0.01);
            block[at..at + 2].copy_from_slice(&scale.to_le_bytes());
        }
    }
    bytes
}

/// The matmul of a transcoded matrix, on every backend, is the f64 product of the file's
/// reference values with the quantized activations' values, within what the fidelity and
/// the float sums allow.
#[test]
fn matmul_of_every_format_follows_its_reference_values() {
    let (rows, cols, tokens) = (16, 512, 5);
    let workers = Workers::new(2);
    let mut rng = SplitMix64::new(27);
    for format in TensorFormat::ALL {
        let bytes = random_tensor(&mut rng, format, rows, cols);
        let x: Vec<f32> = (0..tokens * cols).map(|_| rng.signed_f32()).collect();
        for common in [false, true] {
            check_matmul_of(format, (rows, cols), &bytes, common, &x, &workers);
        }
    }
}

/// `matmul_of_every_format_follows_its_reference_values` for one matrix, in its own layout or
/// the common one, and activations `x` (`tokens × cols`).
fn check_matmul_of(
    format: TensorFormat,
    (rows, cols): (usize, usize),
    bytes: &[u8],
    common: bool,
    x: &[f32],
    workers: &Workers,
) {
    let tokens = x.len() / cols;
    let layout = common.then_some(WeightFormat::Q8Offset);
    let (matrix, fidelity) = QuantMatrix::from_tensor(format, rows, cols, bytes, layout).unwrap();
    let mut reference = vec![0f32; rows * cols];
    format.dequantize(bytes, &mut reference);
    let mut acts = QuantActs::default();
    quantize_acts(x, tokens, cols, &mut acts);
    let act_values: Vec<f32> = (0..tokens)
        .flat_map(|t| {
            acts.row(t)
                .iter()
                .flat_map(|b| b.qs.map(|q| q as f32 * b.d))
                .collect::<Vec<_>>()
        })
        .collect();
    for backend in Backend::available() {
        let mut out = vec![0f32; tokens * rows];
        matrix.matmul(backend, workers, &acts, &mut out);
        for t in 0..tokens {
            for r in 0..rows {
                let w = &reference[r * cols..(r + 1) * cols];
                let a = &act_values[t * cols..(t + 1) * cols];
                let exact: f64 = w.iter().zip(a).map(|(&w, &a)| w as f64 * a as f64).sum();
                let magnitude: f64 = w.iter().zip(a).map(|(&w, &a)| (w * a).abs() as f64).sum();
                // An offset term uses the activations' f16 sum: ~2⁻¹¹ of each block's.
                let allowed = match fidelity {
                    Fidelity::Exact | Fidelity::RoundedScales => 2e-3 * magnitude,
                    Fidelity::Requantized => 2e-2 * magnitude,
                };
                let got = out[t * rows + r] as f64;
                assert!(
                    (got - exact).abs() <= allowed + 1e-6,
                    "{format} as {:?} ({fidelity:?}) {backend:?} token {t} row {r}: {got} vs \
                     {exact}",
                    matrix.format()
                );
            }
        }
    }
}

/// The values of blocks of a compute layout, by the reference dequantizers (Q8Offset's own
/// encoding: f16 scale, f16 offset, 32 signed bytes).
fn layout_values(layout: WeightFormat, bytes: &[u8]) -> Vec<f32> {
    let values = bytes.len() / layout.block_bytes() * 32;
    let mut out = vec![0f32; values];
    match layout {
        WeightFormat::Q4_1 => TensorFormat::Q4_1.dequantize(bytes, &mut out),
        WeightFormat::Q5_0 => TensorFormat::Q5_0.dequantize(bytes, &mut out),
        WeightFormat::Q8_0 => TensorFormat::Q8_0.dequantize(bytes, &mut out),
        WeightFormat::Q8Offset => {
            for (block, out) in bytes.chunks_exact(36).zip(out.chunks_exact_mut(32)) {
                let (d, m) = (f16_at(block), f16_at(&block[2..]));
                for (o, &q) in out.iter_mut().zip(&block[4..]) {
                    *o = q as i8 as f32 * d + m;
                }
            }
        }
    }
    out
}

#[test]
fn stacked_matrices_meet_in_a_layout_that_keeps_every_value() {
    use WeightFormat::*;
    assert_eq!(stacking_layout(&[Q4_1, Q4_1]), Q4_1);
    assert_eq!(stacking_layout(&[Q5_0, Q5_0, Q8_0]), Q8_0);
    assert_eq!(stacking_layout(&[Q4_1, Q8_0]), Q8Offset);
    assert_eq!(stacking_layout(&[Q5_0, Q8Offset]), Q8Offset);
    // Q5_0 into Q8_0 keeps each value; Q4_1 into Q8_0 could not.
    let (blocks, _) = vectors(TensorFormat::Q5_0);
    let q50 = transcode(TensorFormat::Q5_0, 1, blocks.len() / 22 * 32, &blocks).unwrap();
    assert_eq!(q50.layout, Q5_0);
    let q80 = into_layout(q50, Q8_0).unwrap();
    let mut reference = vec![0f32; blocks.len() / 22 * 32];
    TensorFormat::Q5_0.dequantize(&blocks, &mut reference);
    assert_eq!(layout_values(Q8_0, &q80.bytes), reference);
    let (blocks, _) = vectors(TensorFormat::Q4_1);
    let q41 = transcode(TensorFormat::Q4_1, 1, blocks.len() / 20 * 32, &blocks).unwrap();
    assert!(into_layout(q41, Q8_0).is_none());
}
