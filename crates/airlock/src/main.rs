//! `airlock`: the command-line entry point. One module per subcommand; glue only.

mod bench_model;
mod generate;
mod model_path;

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
    /// Generate text for one prompt, streaming tokens to stdout.
    Generate(generate::Args),
    /// Measure prefill and decode speed on this machine, beside llama.cpp when available.
    BenchModel(bench_model::Args),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::BenchModel(args) => bench_model::run(args),
    }
}
