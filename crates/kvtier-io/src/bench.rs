//! `kvtier bench transfer`: offload/onboard throughput of Llama-3.1-8B blocks (32 layers, 8 KV
//! heads, head dim 128, bf16, 16 tokens: 2 MiB per block) in TensorRT-LLM's pool layout and
//! vLLM's per-layer layout, each next to a baseline measured in the same run: one large pinned
//! copy (GPU), one large memcpy (host), `fio` with O_DIRECT on the same directory (disk),
//! `cuMemHostAlloc` (pinning) and a cuBLAS GEMM running alone (interference).
//!
//! Invariant: every measured path is first checked bit-exact on a sample of blocks, so a fast
//! but wrong path cannot produce a figure.
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::transfer::{BlockTransfer, TransferJob};
use kvtier::{JobId, Tier};

use crate::storage::disk::{DiskOptions, DiskStorage};
use crate::storage::host::{HostOptions, HostStorage, PinMode};
use crate::sys::cublas::Gemm;
use crate::sys::cuda::{self as cu, DeviceAlloc, Driver, Event, PinnedAlloc, Stream};
use crate::sys::job;
use crate::sys::mem::{self, Mapping};
use crate::transfer::cuda::CudaCopyMethod;
use crate::transfer::device::DeviceKind;
use crate::transfer::engine::TransferEngine;
use crate::transfer::layout::{BlockChunks, StridedLayout};
use crate::transfer::memory::DevicePtr;

mod gpu;
mod host;
mod staged;

use gpu::gpu;
use host::{cpu_host, disk};

const LAYERS: usize = 32;
const CHUNK: usize = 16 * 8 * 128 * 2; // tokens * heads * head_dim * bf16 = 32 KiB
const BPB: usize = LAYERS * 2 * CHUNK; // 2 MiB

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Directory for the disk tier and fio (default: ./kvtier-bench).
    pub dir: PathBuf,
    /// Blocks moved per measurement (2 MiB each).
    pub blocks: u32,
    /// Blocks per transfer job (one engine step's worth).
    pub job_blocks: usize,
    /// Size of the pinning comparison, GiB (0 = skip).
    pub pin_gib: usize,
    /// Seconds per GEMM measurement.
    pub gemm_secs: f64,
    pub cpu: bool,
    pub gpu: bool,
    pub disk: bool,
    pub cuda_device: i32,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            dir: PathBuf::from("kvtier-bench"),
            blocks: 1024,
            job_blocks: 32,
            pin_gib: 32,
            gemm_secs: 3.0,
            cpu: true,
            gpu: true,
            disk: true,
            cuda_device: 0,
        }
    }
}

/// One measured figure, with the baseline it is compared with.
#[derive(Clone, Debug)]
pub struct Figure {
    pub name: String,
    pub value: f64,
    pub unit: &'static str,
    /// (baseline name, baseline value in the same unit)
    pub baseline: Option<(String, f64)>,
}

impl Figure {
    pub fn ratio(&self) -> Option<f64> {
        self.baseline.as_ref().map(|b| self.value / b.1)
    }
}

/// All figures of one run.
#[derive(Clone, Debug, Default)]
pub struct BenchReport {
    pub figures: Vec<Figure>,
    pub notes: Vec<String>,
}

impl BenchReport {
    fn add(
        &mut self,
        name: impl Into<String>,
        value: f64,
        unit: &'static str,
        baseline: Option<(String, f64)>,
    ) {
        let f = Figure {
            name: name.into(),
            value,
            unit,
            baseline,
        };
        println!("{}", line(&f));
        self.figures.push(f);
    }
    fn note(&mut self, s: impl Into<String>) {
        let s = s.into();
        println!("note: {s}");
        self.notes.push(s);
    }
    /// A markdown table of the figures.
    pub fn to_markdown(&self) -> String {
        let mut s = String::from(
            "| measurement | value | baseline (same run) | ratio |\n|---|---|---|---|\n",
        );
        for f in &self.figures {
            let (b, r) = match &f.baseline {
                Some((n, v)) => (
                    format!("{n}: {v:.2} {}", f.unit),
                    format!("{:.1}%", 100.0 * f.value / v),
                ),
                None => ("-".into(), "-".into()),
            };
            s.push_str(&format!(
                "| {} | {:.2} {} | {b} | {r} |\n",
                f.name, f.value, f.unit
            ));
        }
        for n in &self.notes {
            s.push_str(&format!("\n- {n}"));
        }
        s
    }
    pub fn to_json(&self) -> String {
        let figs: Vec<serde_json::Value> = self
            .figures
            .iter()
            .map(|f| {
                serde_json::json!({
                    "name": f.name, "value": f.value, "unit": f.unit,
                    "baseline": f.baseline.as_ref().map(|b| serde_json::json!({"name": b.0, "value": b.1})),
                    "ratio": f.ratio(),
                })
            })
            .collect();
        serde_json::json!({"figures": figs, "notes": self.notes}).to_string()
    }
}

fn line(f: &Figure) -> String {
    match &f.baseline {
        Some((n, v)) => format!(
            "{:<58} {:>9.2} {:<6} vs {n} {v:.2} ({:.1}%)",
            f.name,
            f.value,
            f.unit,
            100.0 * f.value / v
        ),
        None => format!("{:<58} {:>9.2} {}", f.name, f.value, f.unit),
    }
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// Run the benchmark; prints each figure as it is measured.
pub fn run(opts: &BenchOptions) -> BenchReport {
    let mut r = BenchReport::default();
    if opts.cpu {
        if let Err(e) = cpu_host(opts, &mut r) {
            r.note(format!("host copy benchmark failed: {e}"));
        }
    }
    if opts.disk {
        if let Err(e) = disk(opts, &mut r) {
            r.note(format!("disk benchmark failed: {e}"));
        }
    }
    if opts.gpu {
        if !cu::library_present() {
            r.note("no CUDA driver: GPU benchmarks skipped");
        } else if let Err(e) = gpu(opts, &mut r) {
            r.note(format!("GPU benchmark failed: {e}"));
        }
    }
    r
}

/// Jobs of at most `per_job` pairs of block numbers (disk slots unkeyed).
fn jobs(pairs: &[(u32, u32)], src: Tier, dst: Tier, per_job: usize) -> Vec<TransferJob> {
    pairs
        .chunks(per_job.max(1))
        .enumerate()
        .map(|(i, c)| crate::transfer::numbered_job(JobId(i as u64), src, dst, c, |_| 0))
        .collect()
}

/// Run jobs back to back; error on any failure.
fn run_jobs(
    e: &TransferEngine,
    jobs: &[TransferJob],
    stream: Option<u64>,
) -> Result<Duration, String> {
    let t = Instant::now();
    for j in jobs {
        let f = e.fence(stream).map_err(|e| e.to_string())?;
        let out = e.execute(j, &f);
        if !out.is_ok() {
            return Err(format!("job failed: {out:?}"));
        }
    }
    Ok(t.elapsed())
}

fn best_of(n: usize, mut f: impl FnMut() -> Result<Duration, String>) -> Result<Duration, String> {
    let mut best = Duration::MAX;
    for _ in 0..n {
        best = best.min(f()?);
    }
    Ok(best)
}

fn pattern_fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    for c in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        c.copy_from_slice(&b[..c.len()]);
    }
}
