//! The `kvtier` binary: `serve`, `bench`, `inspect`. With no command it runs `kvtier bench` on its
//! embedded defaults (the project's main job).

#![forbid(unsafe_code)]

#[path = "bench/transfer.rs"]
mod bench_transfer;

use clap::{Parser, Subcommand};
use kvtier_cli::cmd::{bench::BenchArgs, inspect::InspectArgs, node::NodeArgs, serve::ServeArgs};

/// kvtier: a tiered KV-cache block manager for LLM inference, with a reference engine.
#[derive(Debug, Parser)]
#[command(name = "kvtier", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// OpenAI-compatible HTTP server on the reference engine.
    Serve(ServeArgs),
    /// Workload benchmarks: no cache vs the engine's prefix cache vs kvtier tiers (table, JSON, PNG
    /// in ./bench-out/);
    /// `kvtier bench transfer --help` for tier transfer throughput.
    Bench(BenchArgs),
    /// Print the resolved configuration, tier sizes and the disk tier's contents.
    Inspect(InspectArgs),
    /// The node tier: one shared host cache for every engine process on this machine
    /// (engines attach with `remote.url = "node:///SOCKET"`).
    Node(NodeArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Some(r) = bench_transfer::try_run() {
        return r;
    }
    let cli = Cli::parse();
    let command = match cli.command {
        Some(c) => c,
        None => {
            eprintln!("kvtier: no command given; running `kvtier bench` on its embedded defaults (`kvtier --help` lists commands)");
            Command::Bench(BenchArgs::parse_defaults())
        }
    };
    match command {
        Command::Inspect(a) => kvtier_cli::cmd::inspect::run(a),
        Command::Serve(a) => runtime()?.block_on(kvtier_cli::cmd::serve::run(a)),
        Command::Bench(a) => runtime()?.block_on(kvtier_cli::cmd::bench::run(a)),
        Command::Node(a) => runtime()?.block_on(kvtier_cli::cmd::node::run(a)),
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}
