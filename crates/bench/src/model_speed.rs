//! `airlock bench-model`: prefill and decode speed of the forward pass on this machine, with
//! llama.cpp (through the `llama-cpp-python` package, same GGUF, same threads) measured in the
//! same run when Python can import it. Prints medians and ratios; asserts nothing.

use anyhow::{Context, Result};
use kv::{Owner, PagePool, PageTable, PoolConfig, PoolSize, RequestId, TenantId};
use model::{Model, SeqStep};
use model_args::ModelArgs;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Thread counts to measure, comma separated
    #[arg(
        long,
        env = "AIRLOCK_BENCH_MODEL_THREAD_COUNTS",
        value_delimiter = ',',
        default_value = "1,2"
    )]
    pub(crate) thread_counts: Vec<usize>,
    /// Repetitions of each measurement (the median is reported)
    #[arg(long, env = "AIRLOCK_BENCH_MODEL_REPS", default_value_t = 5)]
    pub(crate) reps: usize,
    /// Prompt length for the prefill measurement
    #[arg(
        long,
        env = "AIRLOCK_BENCH_MODEL_PREFILL_TOKENS",
        default_value_t = 512
    )]
    pub(crate) prefill_tokens: usize,
    /// Tokens generated per sequence in the decode measurements
    #[arg(long, env = "AIRLOCK_BENCH_MODEL_DECODE_TOKENS", default_value_t = 128)]
    pub(crate) decode_tokens: usize,
    /// Tokens already in each sequence's context when its decode measurement starts (prefilled
    /// untimed; llama-bench's --n-depth): decode at depth 4,096 is `--decode-depth 4096`
    #[arg(long, env = "AIRLOCK_BENCH_MODEL_DECODE_DEPTH", default_value_t = 16)]
    pub(crate) decode_depth: usize,
    /// Batch sizes for aggregate decode, comma separated
    #[arg(
        long,
        env = "AIRLOCK_BENCH_MODEL_BATCHES",
        value_delimiter = ',',
        default_value = "1,4,16"
    )]
    pub(crate) batches: Vec<usize>,
    /// Skip the llama.cpp peer measurement
    #[arg(long, env = "AIRLOCK_BENCH_MODEL_NO_PEER")]
    pub(crate) no_peer: bool,
    #[command(flatten)]
    pub(crate) model: ModelArgs,
}

/// Medians for one thread count.
pub(crate) struct Figures {
    pub(crate) threads: usize,
    pub(crate) prefill_tok_s: f64,
    pub(crate) decode_tok_s: Vec<(usize, f64)>,
    /// The median over rounds of the largest batch's aggregate over batch 1's in that round.
    pub(crate) scaling: Option<f64>,
}

pub fn run(args: Args) -> Result<()> {
    let path = args.model.resolve_model()?;
    let mut rows = Vec::new();
    for &threads in &args.thread_counts {
        let mut options = args.model.load_options();
        options.threads = threads;
        let loaded = Model::load(&path, &options, &mut |_| {})?;
        let figures = measure(&loaded.model, threads, &args)?;
        let peer = if args.no_peer {
            None
        } else {
            peer(&path, threads, &args)
        };
        print_figures(&figures, peer.as_ref());
        rows.push((figures, peer));
    }
    println!(
        "\nsummary (median of {} reps; machine: {} cores)",
        args.reps,
        cores()
    );
    let largest = args.batches.iter().copied().max().unwrap_or(1);
    println!(
        "threads | prefill {} tok/s | decode b1 tok/s (depth {}) | ratio prefill | ratio decode | b{largest} / b1 (median of rounds)",
        args.prefill_tokens, args.decode_depth
    );
    for (f, peer) in &rows {
        let batch = |size| f.decode_tok_s.iter().find(|(b, _)| *b == size).map(|x| x.1);
        let b1 = batch(1);
        let rp = peer.as_ref().map(|p| f.prefill_tok_s / p.prefill_tok_s);
        let rd = peer.as_ref().zip(b1).map(|(p, b1)| b1 / p.decode_tok_s);
        println!(
            "{:7} | {:17.1} | {:>24} | {:>13} | {:>12} | {:>8}",
            f.threads,
            f.prefill_tok_s,
            cell(b1, "", 1),
            cell(rp, "x", 2),
            cell(rd, "x", 2),
            cell(f.scaling, "x", 2),
        );
    }
    Ok(())
}

/// A figure for the summary, or "-" where it was not measured (no peer, no batch 1).
pub(crate) fn cell(value: Option<f64>, unit: &str, decimals: usize) -> String {
    value.map_or_else(|| "-".to_string(), |v| format!("{v:.decimals$}{unit}"))
}

pub(crate) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

pub(crate) fn print_figures(f: &Figures, peer: Option<&Peer>) {
    println!("\n== {} thread(s) ==", f.threads);
    println!("airlock   prefill: {:8.1} tok/s", f.prefill_tok_s);
    for (batch, tok_s) in &f.decode_tok_s {
        println!("airlock   decode batch {batch:2}: {tok_s:8.1} tok/s aggregate");
    }
    match peer {
        Some(p) => {
            println!("{}  prefill: {:8.1} tok/s", p.engine, p.prefill_tok_s);
            println!(
                "{}  decode batch  1: {:8.1} tok/s",
                p.engine, p.decode_tok_s
            );
            println!(
                "ratio     prefill {:.2}x, decode batch 1 {:.2}x",
                f.prefill_tok_s / p.prefill_tok_s,
                f.decode_tok_s
                    .iter()
                    .find(|(b, _)| *b == 1)
                    .map_or(f64::NAN, |x| x.1)
                    / p.decode_tok_s
            );
        }
        None => {
            println!("(no llama.cpp peer figures: llama-cpp-python not importable or --no-peer)")
        }
    }
}

pub(crate) fn measure(model: &Model, threads: usize, args: &Args) -> Result<Figures> {
    anyhow::ensure!(args.reps >= 1, "--reps must be at least 1");
    anyhow::ensure!(
        args.prefill_tokens >= 16,
        "--prefill-tokens must be at least 16"
    );
    anyhow::ensure!(
        args.decode_tokens >= 1,
        "--decode-tokens must be at least 1"
    );
    anyhow::ensure!(args.decode_depth >= 1, "--decode-depth must be at least 1");
    anyhow::ensure!(
        !args.batches.is_empty() && args.batches.iter().all(|&b| (1..=256).contains(&b)),
        "--batches takes sizes from 1 to 256"
    );
    let vocab = model.config().vocab_size as u32;
    // Deterministic ordinary token ids; content does not change the arithmetic.
    let longest = args.prefill_tokens.max(args.decode_depth) as u32;
    let text: Vec<u32> = (0..longest)
        .map(|i| 200 + (i * 7919) % (vocab - 200))
        .collect();
    let (prompt, context) = (&text[..args.prefill_tokens], &text[..args.decode_depth]);
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    let per_seq = args.decode_depth + args.decode_tokens;
    let tokens = (args.prefill_tokens + 16).max(per_seq * max_batch);
    let layout = model.config().kv_layout(16);
    let mut pool = PagePool::new(PoolConfig {
        layout,
        size: PoolSize::Tokens(tokens + 64 * 16),
        scrub_on_free: false,
    })?;

    let mut prefill = Vec::new();
    for rep in 0..args.reps + 1 {
        let table = pool.allocate(owner(0), prompt.len())?;
        let started = Instant::now();
        model.forward(
            &mut pool,
            &[SeqStep {
                table: &table,
                tokens: prompt,
                start_pos: 0,
                logits: model::LogitRows::Last,
            }],
        )?;
        let secs = started.elapsed().as_secs_f64();
        pool.release(table)?;
        if rep > 0 {
            prefill.push(prompt.len() as f64 / secs); // rep 0 warms caches and threads
        }
    }
    // Rounds of every batch size in turn rather than all of one size, then the next: this
    // shared machine moves between a fast and a slow mode, and a size measured only in one of
    // them would make the batch-16 / batch-1 ratio a comparison of modes, not of batch sizes.
    let mut samples = vec![Vec::new(); args.batches.len()];
    for round in 1..=args.reps {
        let mut figures = Vec::new();
        for (samples, &batch) in samples.iter_mut().zip(&args.batches) {
            let tok_s = decode_run(model, &mut pool, batch, args.decode_tokens, context)?;
            samples.push(tok_s);
            figures.push(format!("batch {batch} {tok_s:.1}"));
        }
        // Progress, and each round's own figures: the spread the medians hide.
        eprintln!(
            "  {threads} thread(s), decode round {round}/{}: {} tok/s",
            args.reps,
            figures.join(", ")
        );
    }
    let of_size = |size| args.batches.iter().position(|&b| b == size);
    let largest = args.batches.iter().copied().max().unwrap_or(1);
    // Each round's ratio compares two measurements seconds apart, in the same mode as often
    // as not; their median is steadier than the ratio of two medians.
    let scaling = of_size(1)
        .zip(of_size(largest))
        .map(|(one, big)| median_of_round_ratios(&samples[big], &samples[one]));
    let decode = args
        .batches
        .iter()
        .zip(&mut samples)
        .map(|(&batch, samples)| (batch, stats::median(samples)))
        .collect();
    Ok(Figures {
        threads,
        prefill_tok_s: stats::median(&prefill),
        decode_tok_s: decode,
        scaling,
    })
}

pub(crate) fn owner(request: u64) -> Owner {
    Owner {
        tenant: TenantId(0),
        request: RequestId(request),
    }
}

/// Aggregate tokens/s of `batch` sequences decoding `steps` tokens each in lockstep.
pub(crate) fn decode_run(
    model: &Model,
    pool: &mut PagePool,
    batch: usize,
    steps: usize,
    prompt: &[u32],
) -> Result<f64> {
    let tables: Vec<PageTable> = (0..batch)
        .map(|i| pool.allocate(owner(i as u64 + 1), prompt.len() + steps))
        .collect::<Result<_, _>>()?;
    for table in &tables {
        model.forward(
            pool,
            &[SeqStep {
                table,
                tokens: prompt,
                start_pos: 0,
                logits: model::LogitRows::Last,
            }],
        )?;
    }
    let next: Vec<[u32; 1]> = (0..batch).map(|i| [300 + i as u32]).collect();
    let started = Instant::now();
    for step in 0..steps {
        let seqs: Vec<SeqStep> = tables
            .iter()
            .zip(&next)
            .map(|(table, token)| SeqStep {
                table,
                tokens: token,
                start_pos: prompt.len() + step,
                logits: model::LogitRows::Last,
            })
            .collect();
        model.forward(pool, &seqs)?;
    }
    let secs = started.elapsed().as_secs_f64();
    for table in tables {
        pool.release(table)?;
    }
    Ok((batch * steps) as f64 / secs)
}

/// The median over rounds of `big[r] / small[r]`.
pub(crate) fn median_of_round_ratios(big: &[f64], small: &[f64]) -> f64 {
    let ratios: Vec<f64> = big.iter().zip(small).map(|(b, s)| b / s).collect();
    stats::median(&ratios)
}

/// llama.cpp's figures from `scripts/bench/llamacpp_peer.py`.
pub(crate) struct Peer {
    pub(crate) engine: String,
    pub(crate) prefill_tok_s: f64,
    pub(crate) decode_tok_s: f64,
}

pub(crate) fn peer(model: &Path, threads: usize, args: &Args) -> Option<Peer> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/bench/llamacpp_peer.py");
    let output = Command::new("python3")
        .arg(&script)
        .args(["--model", &model.display().to_string()])
        .args([
            "--threads",
            &threads.to_string(),
            "--reps",
            &args.reps.to_string(),
            "--prefill-tokens",
            &args.prefill_tokens.to_string(),
            "--decode-tokens",
            &args.decode_tokens.to_string(),
            "--decode-depth",
            &args.decode_depth.to_string(),
        ])
        .output()
        .context("running python3")
        .ok()?;
    if !output.status.success() {
        eprintln!(
            "llama.cpp peer failed: {}",
            String::from_utf8_lossy(&output.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
        return None;
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))?;
    let json: serde_json::Value = serde_json::from_str(line).ok()?;
    Some(Peer {
        engine: json["engine"].as_str().unwrap_or("llama.cpp").to_string(),
        prefill_tok_s: json["prefill_tok_s"].as_f64()?,
        decode_tok_s: json["decode_tok_s"].as_f64()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rounds pair each batch-16 figure with the batch-1 figure of its own round: a slow round
    /// on both sides keeps its ratio, where the ratio of the medians would mix rounds.
    #[test]
    fn scaling_is_the_median_of_each_rounds_own_ratio() {
        let batch16 = [1500.0, 1100.0, 1480.0];
        let batch1 = [300.0, 220.0, 310.0];
        let ratio = median_of_round_ratios(&batch16, &batch1);
        assert!(
            (ratio - 5.0).abs() < 1e-9,
            "rounds' ratios 5.0, 5.0, 4.77: got {ratio}"
        );
        let of_medians = 1480.0 / 300.0;
        assert!(
            (ratio - of_medians).abs() > 0.05,
            "differs from the ratio of medians"
        );
    }
}
