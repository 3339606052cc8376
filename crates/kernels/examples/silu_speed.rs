//! Micro-benchmark of SwiGLU (`silu_mul`, one `expf` per value): `cargo run --release -p
//! kernels --example silu_speed -- [LEN]` prints nanoseconds per value per backend (one thread).

use kernels::{silu_mul, Backend};
use std::time::Instant;

fn main() {
    let len: usize = std::env::args()
        .nth(1)
        .map_or(1536 * 16, |a| a.parse().expect("numeric length"));
    let gate: Vec<f32> = (0..len)
        .map(|i| ((i * 37) % 101) as f32 / 10.0 - 5.0)
        .collect();
    let up: Vec<f32> = (0..len).map(|i| ((i * 13) % 17) as f32 - 8.0).collect();
    for backend in Backend::available() {
        let mut work = gate.clone();
        let reps = (2e8 / len as f64).max(3.0) as usize;
        let started = Instant::now();
        for _ in 0..reps {
            work.copy_from_slice(&gate);
            silu_mul(backend, &mut work, &up);
        }
        let ns = started.elapsed().as_secs_f64() * 1e9 / (reps * len) as f64;
        println!("{backend:?} silu_mul x{len}: {ns:.2} ns per value");
    }
}
