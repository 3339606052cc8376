//! `--ab`: guarded against unguarded builds, alternating.

use crate::measure::measure;
use crate::server::Server;
use crate::Args;
use anyhow::bail;
use anyhow::Result;
use std::time::Instant;

/// Guarded vs unguarded, alternating, one concurrency level: per-pair differences and their
/// mean with a 95% confidence interval (Student's t over the pairs).
pub(crate) fn run_ab(
    args: &Args,
    prompts: &[String],
    runtime: &tokio::runtime::Runtime,
) -> Result<()> {
    let [guarded, unguarded] = args.ab.as_slice() else {
        bail!("--ab takes two binaries: GUARDED,UNGUARDED");
    };
    if args.pairs < 2 {
        bail!("--pairs must be at least 2 for a confidence interval");
    }
    let concurrency = args.concurrency.first().copied().unwrap_or(8);
    let level = Args {
        concurrency: vec![concurrency],
        ..args.clone()
    };
    let mut throughput_change = Vec::new();
    let mut p99_change_ms = Vec::new();
    for pair in 0..args.pairs {
        let mut measured = Vec::new();
        for binary in [guarded, unguarded] {
            let server = Server::start_serve(binary, args)?;
            let reports = runtime.block_on(measure(
                &server.url,
                &server.model_id,
                prompts,
                &level,
                Instant::now(),
                &mut Vec::new(),
            ))?;
            drop(server);
            let report = &reports[0];
            if report.failed > 0 {
                bail!("{} failed {} requests", binary.display(), report.failed);
            }
            let itl = report.itl.clone();
            measured.push((
                report.tokens as f64 / report.wall,
                stats::percentile(&itl, 99.0),
            ));
        }
        let (a, b) = (measured[0], measured[1]);
        // Positive = the guards cost throughput (unguarded faster) / latency (guarded slower).
        throughput_change.push((b.0 - a.0) / b.0 * 100.0);
        p99_change_ms.push((a.1 - b.1) * 1e3);
        eprintln!(
            "pair {}: guarded {:.1} tok/s p99 ITL {:.1} ms | unguarded {:.1} tok/s p99 ITL {:.1} ms",
            pair + 1,
            a.0,
            a.1 * 1e3,
            b.0,
            b.1 * 1e3
        );
    }
    let (mean, half) = stats::mean_and_ci95(&throughput_change);
    let (p99_mean, p99_half) = stats::mean_and_ci95(&p99_change_ms);
    println!(
        "\nguarded = {}\nunguarded = {}\n{} pairs, concurrency {concurrency}, {} requests of \
         max_tokens {} per run\nthroughput cost of the guards: {mean:+.2}% (95% CI {:+.2}% .. \
         {:+.2}%)\np99 inter-token latency cost: {p99_mean:+.2} ms (95% CI {:+.2} .. {:+.2} ms)",
        guarded.display(),
        unguarded.display(),
        args.pairs,
        args.requests,
        args.max_tokens,
        mean - half,
        mean + half,
        p99_mean - p99_half,
        p99_mean + p99_half,
    );
    Ok(())
}
