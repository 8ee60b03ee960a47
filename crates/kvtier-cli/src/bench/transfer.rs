//! `kvtier bench transfer`: CLI glue over `kvtier_io::bench` (the measuring logic lives there).
//! `main` hands over before its own parsing when the arguments start with `bench transfer`.
use std::path::PathBuf;

use clap::Parser;
use kvtier_io::bench::{self, BenchOptions};

/// Offload/onboard throughput per tier and layout, against baselines measured in the same run.
#[derive(Parser, Debug)]
#[command(name = "kvtier bench transfer")]
pub struct TransferArgs {
    /// Directory for the disk tier and fio's files.
    #[arg(long, default_value = "kvtier-bench")]
    pub dir: PathBuf,
    /// 2 MiB blocks moved per measurement.
    #[arg(long, default_value_t = 1024)]
    pub blocks: u32,
    /// Blocks per transfer job.
    #[arg(long, default_value_t = 32)]
    pub job_blocks: usize,
    /// GiB pinned in the pinning comparison (0 = skip).
    #[arg(long, default_value_t = 32)]
    pub pin_gib: usize,
    /// Seconds per GEMM measurement.
    #[arg(long, default_value_t = 3.0)]
    pub gemm_secs: f64,
    #[arg(long)]
    pub no_cpu: bool,
    #[arg(long)]
    pub no_gpu: bool,
    #[arg(long)]
    pub no_disk: bool,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: i32,
    /// Write the figures as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the figures as a markdown table here.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
}

/// Run `kvtier bench transfer ...` if that is the command line; `None` otherwise.
pub fn try_run() -> Option<anyhow::Result<()>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) != Some("bench")
        || args.get(2).map(String::as_str) != Some("transfer")
    {
        return None;
    }
    let rest = std::iter::once("kvtier bench transfer".to_string()).chain(args.into_iter().skip(3));
    Some(run(TransferArgs::parse_from(rest)))
}

pub fn run(a: TransferArgs) -> anyhow::Result<()> {
    let opts = BenchOptions {
        dir: a.dir,
        blocks: a.blocks,
        job_blocks: a.job_blocks,
        pin_gib: a.pin_gib,
        gemm_secs: a.gemm_secs,
        cpu: !a.no_cpu,
        gpu: !a.no_gpu,
        disk: !a.no_disk,
        cuda_device: a.device,
    };
    let report = bench::run(&opts);
    if let Some(p) = a.json {
        std::fs::write(p, report.to_json())?;
    }
    if let Some(p) = a.markdown {
        std::fs::write(p, report.to_markdown())?;
    }
    println!("\n{}", report.to_markdown());
    Ok(())
}
