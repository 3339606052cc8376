//! `airlock`: the command-line entry point. One module per subcommand; glue only.

mod bench;
mod bench_curves;
mod bench_model;
mod bench_plot;
mod canary;
mod config_file;
mod generate;
mod model_path;
mod preflight;
mod serve;

use clap::{Parser, Subcommand};

/// Airlock: an LLM inference server whose KV cache pages are checked against their owner on
/// every read, so no tenant is ever answered from another tenant's memory.
#[derive(Parser)]
#[command(name = "airlock", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI API: router + prefill + decode workers in one process, linked over
    /// TCP on loopback (the embedded default).
    Serve(serve::ServeArgs),
    /// Run the HTTP router in front of workers started elsewhere.
    Router(serve::RouterArgs),
    /// Run a prefill worker: runs prompts, then transfers their KV pages to decode workers.
    Prefill(serve::WorkerArgs),
    /// Run a decode worker: receives and verifies KV pages, then generates.
    Decode(serve::WorkerArgs),
    /// Serve with one unified worker (prefill and decode in one pool, no transfer): the
    /// single-node baseline.
    Unified(serve::UnifiedArgs),
    /// Load-test OpenAI-compatible endpoints (ours and llama.cpp's, started in turn, or any
    /// URL): output tokens/s, TTFT and inter-token latency per concurrency level.
    Bench(bench::Args),
    /// Audit any OpenAI-compatible endpoint for cross-tenant leaks: tenants send prompts
    /// carrying their own canary markers and every answer is scanned for another tenant's;
    /// requests that must fail are checked to get a 4xx. Exits 1 on a leak or a wrong 200.
    Canary(canary::Args),
    /// Check a deployment's KV capacity against its context length, node by node (from a
    /// TOML file, or a running router's /health); exits non-zero if any node fails.
    Preflight(preflight::Args),
    /// Generate text for one prompt, streaming tokens to stdout.
    Generate(generate::Args),
    /// Measure prefill and decode speed on this machine, beside llama.cpp when available.
    BenchModel(bench_model::Args),
}

/// Errors end the process with one line (and its causes), never a backtrace: they are the
/// user's to act on. A worker refusing its configuration exits 78 (EX_CONFIG), others 1.
fn main() {
    keep_freed_memory_for_reuse();
    if let Err(error) = run() {
        eprintln!("airlock: {error:#}");
        let code = if error.downcast_ref::<serve::RefusedToStart>().is_some() {
            serve::EXIT_CONFIG
        } else {
            1
        };
        std::process::exit(code);
    }
}

/// glibc hands every allocation over 128 KiB (a KV page frame is 360 KiB; a prefill step's
/// buffers are megabytes) to the kernel on free, so the next one page-faults its memory in
/// again: with 8,192 tokens sent, faults were most of the transfer's time (0.9 GB/s over
/// loopback, 1.5 GB/s with this). Serve such sizes from the heap and keep up to 256 MiB of
/// freed heap instead.
fn keep_freed_memory_for_reuse() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; it is called first thing in main,
    // before any other thread exists, and both values are in the ranges glibc documents.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

/// Guards this build runs without (benchmark builds only).
const GUARDS_OFF: &[(bool, &str)] = &[
    (
        cfg!(feature = "unguarded-owner-check"),
        "owner/generation check",
    ),
    (cfg!(feature = "unguarded-checksum"), "transfer checksum"),
    (
        cfg!(feature = "unguarded-deferred-release"),
        "deferred release",
    ),
];

fn run() -> anyhow::Result<()> {
    for (off, guard) in GUARDS_OFF {
        if *off {
            eprintln!(
                "airlock: BENCHMARK BUILD WITHOUT THE {guard} GUARD; never serve users with it"
            );
        }
    }
    let args = config_file::apply(std::env::args_os().collect())?;
    let cli = Cli::parse_from(args);
    match cli.command {
        Command::Serve(args) => serve::serve(args),
        Command::Router(args) => serve::router(args),
        Command::Prefill(args) => serve::prefill(args),
        Command::Decode(args) => serve::decode(args),
        Command::Unified(args) => serve::unified(args),
        Command::Bench(args) => bench::run(args),
        Command::Canary(args) => canary::run(args),
        Command::Preflight(args) => preflight::run(args),
        Command::Generate(args) => generate::run(args),
        Command::BenchModel(args) => bench_model::run(args),
    }
}
