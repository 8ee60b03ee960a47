//! `kvtier bench transfer`: CLI glue over `kvtier_io::bench` (the measuring logic lives there,
//! beside the CUDA primitives it drives).
use std::path::PathBuf;

use clap::Args;
use kvtier_io::bench::{self, BenchOptions};

/// Offload/onboard throughput per tier and layout, against baselines measured in the same run.
#[derive(Args, Debug, Clone)]
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
    /// Skip the CPU (host memory) measurements.
    #[arg(long)]
    pub no_cpu: bool,
    /// Skip the GPU measurements.
    #[arg(long)]
    pub no_gpu: bool,
    /// Skip the disk measurements.
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

/// Run the transfer benchmark and write its figures where `a` says.
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
