//! The `kvtier` binary: `serve`, `bench`, `inspect`. With no command it runs `kvtier bench` on its
//! embedded defaults (the project's main job).

#![forbid(unsafe_code)]

use clap::{Args, Parser, Subcommand};
use kvtier_cli::bench::command::BenchArgs;
use kvtier_cli::bench::transfer::TransferArgs;
use kvtier_cli::inspect::InspectArgs;
use kvtier_cli::node::NodeArgs;
use kvtier_cli::serve::command::ServeArgs;

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
    Bench(Box<BenchCli>),
    /// Print the resolved configuration, tier sizes and the disk tier's contents.
    Inspect(InspectArgs),
    /// The node tier: one shared host cache for every engine process on this machine
    /// (engines attach with `remote.url = "node:///SOCKET"`).
    Node(NodeArgs),
}

/// `kvtier bench [FLAGS]` (the workload comparison) or `kvtier bench transfer [FLAGS]`.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
struct BenchCli {
    #[command(subcommand)]
    command: Option<BenchCommand>,
    #[command(flatten)]
    args: BenchArgs,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Offload/onboard throughput per tier and layout, against baselines measured in the same run.
    Transfer(TransferArgs),
}

/// Exit status of a configuration error (as clap's usage errors).
const EXIT_CONFIG: u8 = 2;

/// Runs the command; an error is printed as one message (its causes joined, never a backtrace,
/// whatever `RUST_BACKTRACE` says) and exits 1, or 2 for a configuration error.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let (what, code) = if is_config_error(&e) {
                ("configuration error", EXIT_CONFIG)
            } else {
                ("error", 1)
            };
            eprintln!("kvtier: {what}: {e:#}");
            std::process::ExitCode::from(code)
        }
    }
}

/// Whether `e` is (caused by) an invalid setting.
fn is_config_error(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.is::<kvtier::config::ConfigError>()
            || matches!(
                c.downcast_ref::<kvtier_io::compose::ComposeError>(),
                Some(kvtier_io::compose::ComposeError::Config(_))
            )
    })
}

fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let command = match cli.command {
        Some(c) => c,
        None => {
            eprintln!("kvtier: no command given; running `kvtier bench` on its embedded defaults (`kvtier --help` lists commands)");
            Command::Bench(Box::new(BenchCli {
                command: None,
                args: BenchArgs::parse_defaults(),
            }))
        }
    };
    match command {
        Command::Inspect(a) => kvtier_cli::inspect::run(a),
        Command::Serve(a) => runtime()?.block_on(kvtier_cli::serve::command::run(a)),
        Command::Bench(b) => match *b {
            BenchCli {
                command: Some(BenchCommand::Transfer(a)),
                ..
            } => kvtier_cli::bench::transfer::run(a),
            BenchCli { args, .. } => runtime()?.block_on(kvtier_cli::bench::command::run(args)),
        },
        Command::Node(a) => runtime()?.block_on(kvtier_cli::node::run(a)),
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    /// `bench transfer` is a clap subcommand: its flags are parsed (and refused) by clap, and it
    /// does not mix with the workload benchmark's flags.
    #[test]
    fn bench_transfer_is_a_subcommand() {
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from(["kvtier", "bench", "transfer", "--blocks", "8"]);
        match cli.map(|c| c.command) {
            Ok(Some(Command::Bench(b))) => match b.command {
                Some(BenchCommand::Transfer(t)) => assert_eq!(t.blocks, 8),
                other => panic!("not a transfer command: {other:?}"),
            },
            other => panic!("not a bench command: {other:?}"),
        }
        assert!(Cli::try_parse_from(["kvtier", "bench", "transfer", "--blocks", "x"]).is_err());
        assert!(Cli::try_parse_from(["kvtier", "bench", "--large", "transfer"]).is_err());
        let plain = Cli::try_parse_from(["kvtier", "bench", "--large"]).map(|c| c.command);
        assert!(matches!(plain, Ok(Some(Command::Bench(b))) if b.command.is_none()));
    }
}
