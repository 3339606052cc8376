//! Micro-benchmark of one quantized matmul: `cargo run --release -p kernels --example
//! matmul_speed -- ROWS COLS TOKENS [COPIES] [THREADS]` prints GMAC/s per backend (one thread
//! unless THREADS says more), and for Q8_0 on a VNNI CPU also with the turned copy the model
//! keeps of its output projection (`QuantMatrix::add_vnni_layout`).

use kernels::{quantize_acts, Backend, QuantActs, QuantMatrix, WeightFormat};
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numeric argument"))
        .collect();
    let (rows, cols, tokens) = (
        args.first().copied().unwrap_or(1536),
        args.get(1).copied().unwrap_or(576),
        args.get(2).copied().unwrap_or(1),
    );
    // COPIES (4th argument): distinct copies of the matrix, cycled, so a set larger than the
    // last-level cache streams from memory as a model's layers do.
    let copies = args.get(3).copied().unwrap_or(1).max(1);
    let workers = kernels::Workers::new(args.get(4).copied().unwrap_or(1).max(1));
    for format in [WeightFormat::Q4_1, WeightFormat::Q8_0] {
        let bytes: Vec<u8> = (0..rows * cols / 32 * format.block_bytes())
            .map(|i| (i * 7 % 251) as u8 & 0x3f)
            .collect();
        let mut matrices: Vec<QuantMatrix> = (0..copies)
            .map(|_| QuantMatrix::from_gguf_bytes(format, rows, cols, &bytes).expect("valid shape"))
            .collect();
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| ((i * 13) % 17) as f32 - 8.0)
            .collect();
        let mut acts = QuantActs::default();
        quantize_acts(&x, tokens, cols, &mut acts);
        let mut out = vec![0f32; rows * tokens];
        let time = |matrices: &[QuantMatrix], backend: Backend, out: &mut [f32]| {
            let reps = (2e9 / (rows * cols * tokens) as f64).max(3.0) as usize;
            let started = Instant::now();
            for rep in 0..reps {
                matrices[rep % copies].matmul(backend, &workers, &acts, out)
            }
            (rows * cols * tokens * reps) as f64 / started.elapsed().as_secs_f64() / 1e9
        };
        for backend in Backend::available() {
            let gmacs = time(&matrices, backend, &mut out);
            println!("{format:?} {backend:?} {rows}x{cols} x{tokens}: {gmacs:.2} GMAC/s");
        }
        // Q8_0 again with the VNNI kernel's turned copy, where the CPU has VNNI.
        for matrix in &mut matrices {
            matrix.add_vnni_layout();
        }
        if matrices[0].has_vnni_layout() {
            let gmacs = time(&matrices, Backend::Avx512Vnni, &mut out);
            println!(
                "{format:?} Avx512Vnni (turned copy) {rows}x{cols} x{tokens}: {gmacs:.2} GMAC/s"
            );
        }
    }
}
