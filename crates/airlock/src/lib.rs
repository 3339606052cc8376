//! `airlock`: the command line, one module per subcommand (glue only), behind two
//! executables:
//!
//! - `airlock` (`src/main.rs`), the server users run. It never obeys `AIRLOCK_FAULTS`,
//!   whatever features it was built with: `cargo test` turns fault injection on in the
//!   workers it links (through this package's dev-dependencies), and its artifact lands at
//!   `target/<profile>/airlock`, the path users run.
//! - `airlock-fault-injection` (`src/bin/`), for tests and `scripts/canary-red.sh` only: the
//!   same command line, obeying `AIRLOCK_FAULTS` where it was built with the `fault-injection`
//!   feature, and saying what it is at every start.

mod config_file;
mod generate;
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
    BenchModel(bench::model_speed::Args),
}

/// Whether an executable may obey `AIRLOCK_FAULTS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Faults {
    /// The server: a non-empty `AIRLOCK_FAULTS` is refused at start.
    Refused,
    /// The test executable: workers take their plan from `AIRLOCK_FAULTS` (refused there too
    /// unless built with the `fault-injection` feature).
    FromEnv,
}

impl Faults {
    /// A worker's fault plan.
    fn plan(self, role: transfer::Role) -> anyhow::Result<worker::FaultPlan> {
        match self {
            Faults::Refused => Ok(worker::FaultPlan::none()),
            Faults::FromEnv => Ok(worker::FaultPlan::from_env(role)?),
        }
    }
}

/// What `airlock` says to a non-empty `AIRLOCK_FAULTS`, or `None`.
fn refused_faults(faults: Faults) -> Option<String> {
    let spec = std::env::var("AIRLOCK_FAULTS").ok()?;
    if faults == Faults::FromEnv || spec.trim().is_empty() {
        return None;
    }
    Some(format!(
        "this executable never injects faults, however it was built, so \
         AIRLOCK_FAULTS=`{spec}` cannot be honoured; unset it (fault injection is the \
         test-only `airlock-fault-injection` executable)"
    ))
}

/// Runs the command line. Errors end the process with one line (and its causes), never a
/// backtrace: they are the user's to act on. A worker refusing its configuration exits 78
/// (EX_CONFIG), others 1.
pub fn main(faults: Faults) {
    keep_freed_memory_for_reuse();
    if faults == Faults::FromEnv {
        eprintln!(
            "airlock-fault-injection: a TEST executable that obeys AIRLOCK_FAULTS where built \
             with fault injection; never serve users with it (use `airlock`)"
        );
    }
    if let Some(message) = refused_faults(faults) {
        eprintln!("airlock: {message}");
        std::process::exit(1);
    }
    if let Err(error) = run(faults) {
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

fn run(faults: Faults) -> anyhow::Result<()> {
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
        Command::Serve(args) => serve::serve(args, faults),
        Command::Router(args) => serve::router(args),
        Command::Prefill(args) => serve::prefill(args, faults),
        Command::Decode(args) => serve::decode(args, faults),
        Command::Unified(args) => serve::unified(args, faults),
        Command::Bench(args) => bench::run(args),
        Command::Canary(args) => canary::run(args),
        Command::Preflight(args) => preflight::run(args),
        Command::Generate(args) => generate::run(args),
        Command::BenchModel(args) => bench::model_speed::run(args),
    }
}
