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

use kvtier::transfer::{BlockPair, BlockTransfer, TransferJob};
use kvtier::{JobId, Tier};

use crate::cuda::CudaCopyMethod;
use crate::device::DeviceKind;
use crate::disk::{DiskOptions, DiskStorage};
use crate::engine::TransferEngine;
use crate::host::{HostOptions, HostStorage, PinMode};
use crate::layout::{BlockChunks, StridedLayout};
use crate::sys::cublas::Gemm;
use crate::sys::cuda::{self as cu, DeviceAlloc, Driver, Event, PinnedAlloc, Stream};
use crate::sys::mem::{self, Mapping};

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

fn jobs(pairs: &[(u32, u32)], src: Tier, dst: Tier, per_job: usize) -> Vec<TransferJob> {
    pairs
        .chunks(per_job.max(1))
        .enumerate()
        .map(|(i, c)| TransferJob {
            id: JobId(i as u64),
            src,
            dst,
            pairs: c
                .iter()
                .map(|&(s, d)| BlockPair { src: s, dst: d })
                .collect(),
            remote_keys: Vec::new(),
        })
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

/// Host copies: TransferEngine host->host and CPU-device->host against one large memcpy.
fn cpu_host(opts: &BenchOptions, r: &mut BenchReport) -> Result<(), String> {
    let n = opts.blocks as usize;
    let bytes = n * BPB;
    let a = Mapping::new(bytes).map_err(|e| e.to_string())?;
    let b = Mapping::new(bytes).map_err(|e| e.to_string())?;
    a.touch_parallel(4);
    b.touch_parallel(4);
    let memcpy = best_of(3, || {
        let t = Instant::now();
        // SAFETY: two distinct live mappings of `bytes` bytes, used by this thread only.
        unsafe { mem::copy(a.addr(), b.addr(), bytes) };
        Ok(t.elapsed())
    })?;
    let base = ("one large memcpy".to_string(), gbps(bytes, memcpy));
    r.add("host: memcpy, one call", base.1, "GB/s", None);

    let mut ho = HostOptions::new(2 * opts.blocks, BPB);
    ho.pin = PinMode::Never;
    let host = Arc::new(HostStorage::new(&ho).map_err(|e| e.to_string())?);
    // The CPU "engine" cache, per-layer layout, lives in mapping `a`, reinterpreted as 32
    // layer tensors of [2, n, CHUNK].
    let layer_bytes = 2 * n * CHUNK;
    let bases: Vec<u64> = (0..LAYERS)
        .map(|l| (a.addr() + l * layer_bytes) as u64)
        .collect();
    let per_layer =
        StridedLayout::kv_per_layer(&bases, opts.blocks, CHUNK).map_err(|e| e.to_string())?;
    let e = TransferEngine::builder()
        .device(Arc::new(per_layer), DeviceKind::Cpu)
        .host(host.clone())
        .build()
        .map_err(|e| e.to_string())?;
    let pairs: Vec<(u32, u32)> = (0..opts.blocks).map(|i| (i, opts.blocks + i)).collect();
    let hh = jobs(&pairs, Tier::Host, Tier::Host, opts.job_blocks);
    let off: Vec<(u32, u32)> = (0..opts.blocks).map(|i| (i, i)).collect();
    let dj = jobs(&off, Tier::Device, Tier::Host, opts.job_blocks);
    let uj = jobs(&off, Tier::Host, Tier::Device, opts.job_blocks);
    // warm the host tier
    run_jobs(&e, &hh, None)?;
    for (mode, nt) in [("memcpy", false), ("non-temporal", true)] {
        mem::set_non_temporal(nt);
        let t = best_of(3, || run_jobs(&e, &hh, None))?;
        r.add(
            format!("host: host->host blocks (2 MiB) [{mode}]"),
            gbps(bytes, t),
            "GB/s",
            Some(base.clone()),
        );
        let t = best_of(3, || run_jobs(&e, &dj, None))?;
        r.add(
            format!("host: CPU device->host, vLLM per-layer (64 x 32 KiB) [{mode}]"),
            gbps(bytes, t),
            "GB/s",
            Some(base.clone()),
        );
        let t = best_of(3, || run_jobs(&e, &uj, None))?;
        r.add(
            format!("host: host->CPU device, vLLM per-layer [{mode}]"),
            gbps(bytes, t),
            "GB/s",
            Some(base.clone()),
        );
    }
    mem::set_non_temporal(true);
    Ok(())
}

/// Disk tier against fio (O_DIRECT, io_uring, 2 MiB blocks, queue depth 32) on the same dir.
fn disk(opts: &BenchOptions, r: &mut BenchReport) -> Result<(), String> {
    let n = opts.blocks.min(512);
    let dir = opts.dir.join("disk");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let mut ho = HostOptions::new(n, BPB);
    ho.pin = PinMode::Never;
    let host = Arc::new(HostStorage::new(&ho).map_err(|e| e.to_string())?);
    for b in 0..n {
        let mut v = vec![0u8; BPB];
        pattern_fill(&mut v, u64::from(b));
        host.write_block(b, &v).map_err(|e| e.to_string())?;
    }
    let d =
        Arc::new(DiskStorage::create(&DiskOptions::new(&dir, n, BPB)).map_err(|e| e.to_string())?);
    r.note(format!(
        "disk tier at {}: O_DIRECT {}, io_uring {}",
        dir.display(),
        d.is_direct(),
        d.uses_io_uring()
    ));
    let e = TransferEngine::builder()
        .host(host.clone())
        .disk(d.clone())
        .build()
        .map_err(|e| e.to_string())?;
    let pairs: Vec<(u32, u32)> = (0..n).map(|i| (i, i)).collect();
    let wj = jobs(&pairs, Tier::Host, Tier::Disk, opts.job_blocks);
    let rj = jobs(&pairs, Tier::Disk, Tier::Host, opts.job_blocks);
    let bytes = n as usize * BPB;
    let w = best_of(2, || run_jobs(&e, &wj, None))?;
    let rd = best_of(2, || run_jobs(&e, &rj, None))?;
    // bit-exact check of what came back
    let mut v = vec![0u8; BPB];
    let mut want = vec![0u8; BPB];
    for b in (0..n).step_by(37) {
        host.read_block(b, &mut v).map_err(|e| e.to_string())?;
        pattern_fill(&mut want, u64::from(b));
        if v != want {
            return Err(format!("disk round trip of block {b} is not bit-exact"));
        }
    }
    let fio_dir = opts.dir.join("fio");
    std::fs::create_dir_all(&fio_dir).map_err(|e| e.to_string())?;
    let fw = fio(&fio_dir, "write", bytes);
    let fr = fio(&fio_dir, "read", bytes);
    let _ = std::fs::remove_dir_all(&fio_dir);
    match (fw, fr) {
        (Ok(fw), Ok(fr)) => {
            r.add(
                "disk: host->disk (2 MiB blocks + checksums)",
                gbps(bytes, w),
                "GB/s",
                Some(("fio write O_DIRECT".into(), fw)),
            );
            r.add(
                "disk: disk->host (verified)",
                gbps(bytes, rd),
                "GB/s",
                Some(("fio read O_DIRECT".into(), fr)),
            );
        }
        (a, b) => {
            r.add("disk: host->disk", gbps(bytes, w), "GB/s", None);
            r.add("disk: disk->host", gbps(bytes, rd), "GB/s", None);
            r.note(format!("fio unavailable: {:?} {:?}", a.err(), b.err()));
        }
    }
    disk_cpu_device(opts, r, &d, &host, n)
}

/// Disk <-> CPU device memory (vLLM per-layer layout) through the engine's bounce buffers (no
/// host tier; far and device legs of neighbouring slices overlap) against the two hops through a
/// host tier, job by job. Disk slot `i` holds pattern `i` (written by [`disk`]).
fn disk_cpu_device(
    opts: &BenchOptions,
    r: &mut BenchReport,
    d: &Arc<DiskStorage>,
    host: &Arc<HostStorage>,
    n: u32,
) -> Result<(), String> {
    let bytes = n as usize * BPB;
    let kv = Mapping::new(bytes).map_err(|e| e.to_string())?;
    kv.touch_parallel(4);
    let layer_bytes = 2 * n as usize * CHUNK;
    let bases: Vec<u64> = (0..LAYERS)
        .map(|l| (kv.addr() + l * layer_bytes) as u64)
        .collect();
    let layout =
        Arc::new(StridedLayout::kv_per_layer(&bases, n, CHUNK).map_err(|e| e.to_string())?);
    let staged = TransferEngine::builder()
        .device(layout.clone(), DeviceKind::Cpu)
        .disk(d.clone())
        .build()
        .map_err(|e| e.to_string())?;
    let two_hop = TransferEngine::builder()
        .device(layout, DeviceKind::Cpu)
        .host(host.clone())
        .disk(d.clone())
        .build()
        .map_err(|e| e.to_string())?;
    let pairs: Vec<(u32, u32)> = (0..n).map(|i| (i, i)).collect();
    let jb = opts.job_blocks;
    let two = |first: (Tier, Tier), second: (Tier, Tier)| -> Result<Duration, String> {
        let t = Instant::now();
        for j in jobs(&pairs, first.0, first.1, jb) {
            let k = TransferJob {
                src: second.0,
                dst: second.1,
                ..j.clone()
            };
            run_jobs(&two_hop, std::slice::from_ref(&j), None)?;
            run_jobs(&two_hop, std::slice::from_ref(&k), None)?;
        }
        Ok(t.elapsed())
    };
    let load = jobs(&pairs, Tier::Disk, Tier::Device, jb);
    let t_load = best_of(2, || run_jobs(&staged, &load, None))?;
    // Check: device blocks back to host through the two-hop engine, compare with the patterns.
    let sample: Vec<(u32, u32)> = (0..n).step_by(29).map(|b| (b, b)).collect();
    run_jobs(&two_hop, &jobs(&sample, Tier::Device, Tier::Host, jb), None)?;
    let (mut v, mut want) = (vec![0u8; BPB], vec![0u8; BPB]);
    for &(b, _) in &sample {
        host.read_block(b, &mut v).map_err(|e| e.to_string())?;
        pattern_fill(&mut want, u64::from(b));
        if v != want {
            return Err(format!("disk -> CPU device (bounce): block {b} differs"));
        }
    }
    let two_load = best_of(2, || {
        two((Tier::Disk, Tier::Host), (Tier::Host, Tier::Device))
    })?;
    let store = jobs(&pairs, Tier::Device, Tier::Disk, jb);
    let t_store = best_of(2, || run_jobs(&staged, &store, None))?;
    let two_store = best_of(2, || {
        two((Tier::Device, Tier::Host), (Tier::Host, Tier::Disk))
    })?;
    r.add(
        "disk: disk->CPU device, vLLM per-layer (bounce, no host tier)",
        gbps(bytes, t_load),
        "GB/s",
        Some(("disk->host tier->device".into(), gbps(bytes, two_load))),
    );
    r.add(
        "disk: CPU device->disk, vLLM per-layer (bounce, no host tier)",
        gbps(bytes, t_store),
        "GB/s",
        Some(("device->host tier->disk".into(), gbps(bytes, two_store))),
    );
    Ok(())
}

/// fio bandwidth in GB/s for one sequential pass.
fn fio(dir: &std::path::Path, rw: &str, bytes: usize) -> Result<f64, String> {
    let out = std::process::Command::new("fio")
        .args([
            "--name=kvtier",
            &format!("--directory={}", dir.display()),
            &format!("--rw={rw}"),
            "--bs=2M",
            "--direct=1",
            "--ioengine=io_uring",
            "--iodepth=32",
            &format!("--size={bytes}"),
            "--numjobs=1",
            "--output-format=json",
        ])
        .output()
        .map_err(|e| format!("running fio: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
    let bw = v["jobs"][0][rw]["bw_bytes"]
        .as_f64()
        .ok_or("no bw_bytes in fio output")?;
    Ok(bw / 1e9)
}

/// A GPU KV cache in both layouts, with the host-side truth for checks.
struct GpuCache {
    mem: DeviceAlloc,
    blocks: u32,
}

impl GpuCache {
    fn new(blocks: u32) -> Result<Self, String> {
        let mem = DeviceAlloc::new(blocks as usize * BPB)?;
        // Fill with a pattern, 64 MiB at a time.
        let step = 64 << 20;
        let mut buf = vec![0u8; step];
        let mut off = 0;
        while off < mem.len() {
            let n = step.min(mem.len() - off);
            pattern_fill(&mut buf[..n], off as u64);
            mem.upload(off, &buf[..n])?;
            off += n;
        }
        Ok(GpuCache { mem, blocks })
    }
    /// TensorRT-LLM pool `[blocks, layers, 2, chunk]`: one contiguous 2 MiB chunk per block.
    fn pool(&self) -> Result<StridedLayout, String> {
        StridedLayout::contiguous(self.mem.addr(), self.blocks, BPB).map_err(|e| e.to_string())
    }
    /// vLLM per-layer `[2, blocks, chunk]` per layer: 64 chunks of 32 KiB per block.
    fn per_layer(&self) -> Result<StridedLayout, String> {
        let lb = 2 * self.blocks as usize * CHUNK;
        let bases: Vec<u64> = (0..LAYERS)
            .map(|l| self.mem.addr() + (l * lb) as u64)
            .collect();
        StridedLayout::kv_per_layer(&bases, self.blocks, CHUNK).map_err(|e| e.to_string())
    }
    /// Canonical bytes of device block `b` under `layout`, read back from the GPU.
    fn block_bytes(&self, layout: &StridedLayout, b: u32) -> Result<Vec<u8>, String> {
        let mut chunks = Vec::new();
        layout.chunks(b, &mut chunks)?;
        let mut out = vec![0u8; BPB];
        let mut o = 0;
        for c in chunks {
            self.mem
                .download((c.addr - self.mem.addr()) as usize, &mut out[o..o + c.len])?;
            o += c.len;
        }
        Ok(out)
    }
}

fn gpu(opts: &BenchOptions, r: &mut BenchReport) -> Result<(), String> {
    let driver = Driver::open(opts.cuda_device)?;
    let n = opts.blocks;
    let bytes = n as usize * BPB;
    // 1. The limit: one large pinned copy each way, and both at once.
    let (lim_d2h, lim_h2d, lim_both) = {
        let h1 = PinnedAlloc::new(1 << 30)?;
        let h2 = PinnedAlloc::new(1 << 30)?;
        let d1 = DeviceAlloc::new(1 << 30)?;
        let d2 = DeviceAlloc::new(1 << 30)?;
        let (s1, s2) = (Stream::new(false)?, Stream::new(false)?);
        let (e0, e1, e2, e3) = (
            Event::new(true)?,
            Event::new(true)?,
            Event::new(true)?,
            Event::new(true)?,
        );
        let mut best = [0f64; 3];
        for _ in 0..3 {
            // SAFETY: our own allocations of 1 GiB each, synchronised before reuse.
            unsafe {
                e0.record(&s1)?;
                cu::memcpy_async(h1.addr() as u64, d1.addr(), 1 << 30, &s1)?;
                e1.record(&s1)?;
                cu::memcpy_async(d2.addr(), h2.addr() as u64, 1 << 30, &s1)?;
                e2.record(&s1)?;
            }
            e2.synchronize()?;
            let d2h = (1u64 << 30) as f64 / (Event::elapsed_ms(&e0, &e1)? as f64 / 1e3) / 1e9;
            let h2d = (1u64 << 30) as f64 / (Event::elapsed_ms(&e1, &e2)? as f64 / 1e3) / 1e9;
            let t = Instant::now();
            // SAFETY: as above; two streams, opposite directions, disjoint buffers.
            unsafe {
                cu::memcpy_async(h1.addr() as u64, d1.addr(), 1 << 30, &s1)?;
                cu::memcpy_async(d2.addr(), h2.addr() as u64, 1 << 30, &s2)?;
            }
            e3.record(&s1)?;
            s2.synchronize()?;
            e3.synchronize()?;
            let both = 2.0 * (1u64 << 30) as f64 / t.elapsed().as_secs_f64() / 1e9;
            best = [best[0].max(d2h), best[1].max(h2d), best[2].max(both)];
        }
        (best[0], best[1], best[2])
    };
    r.add(
        "gpu limit: one 1 GiB pinned copy D2H",
        lim_d2h,
        "GB/s",
        None,
    );
    r.add(
        "gpu limit: one 1 GiB pinned copy H2D",
        lim_h2d,
        "GB/s",
        None,
    );
    r.add("gpu limit: both directions at once", lim_both, "GB/s", None);

    // 2. Transfers through the TransferEngine.
    let cache = GpuCache::new(n)?;
    let mut ho = HostOptions::new(2 * n, BPB);
    ho.pin = PinMode::Require;
    ho.cuda_device = opts.cuda_device;
    let host = Arc::new(HostStorage::new(&ho).map_err(|e| e.to_string())?);
    let engine_stream = Stream::new(false)?;
    let es = Some(engine_stream.raw() as usize as u64);
    let layouts: [(&str, StridedLayout); 2] = [
        ("TRT-LLM pool", cache.pool()?),
        ("vLLM per-layer", cache.per_layer()?),
    ];
    let mut best_method = CudaCopyMethod::Auto;
    for (lname, layout) in &layouts {
        let mut best = (0.0f64, CudaCopyMethod::Auto);
        for method in [
            CudaCopyMethod::PerChunk,
            CudaCopyMethod::Batch,
            CudaCopyMethod::Kernel,
            CudaCopyMethod::Auto,
        ] {
            let e = match TransferEngine::builder()
                .device(
                    Arc::new(layout.clone()),
                    DeviceKind::Cuda(opts.cuda_device as u32),
                )
                .host(host.clone())
                .cuda_copy_method(method)
                .build()
            {
                Ok(e) => e,
                Err(err) => {
                    r.note(format!("{lname} {method:?}: unavailable: {err}"));
                    continue;
                }
            };
            if let Err(err) = check_gpu_round_trip(&e, &cache, layout, &host, n, es) {
                r.note(format!(
                    "{lname} {method:?}: NOT bit-exact, not measured: {err}"
                ));
                continue;
            }
            // device block i -> host block i (offload); host block i -> device block i (onboard,
            // writes back the same bytes so the cache stays valid).
            let pairs: Vec<(u32, u32)> = (0..n).map(|i| (i, i)).collect();
            let off = jobs(&pairs, Tier::Device, Tier::Host, opts.job_blocks);
            let on = jobs(&pairs, Tier::Host, Tier::Device, opts.job_blocks);
            let t_off = best_of(3, || run_jobs(&e, &off, es))?;
            let t_on = best_of(3, || run_jobs(&e, &on, es))?;
            let (g_off, g_on) = (gbps(bytes, t_off), gbps(bytes, t_on));
            r.add(
                format!("gpu {lname} offload D2H [{method:?}]"),
                g_off,
                "GB/s",
                Some(("1 GiB pinned copy".into(), lim_d2h)),
            );
            r.add(
                format!("gpu {lname} onboard H2D [{method:?}]"),
                g_on,
                "GB/s",
                Some(("1 GiB pinned copy".into(), lim_h2d)),
            );
            if *lname == "vLLM per-layer" && g_off + g_on > best.0 && method != CudaCopyMethod::Auto
            {
                best = (g_off + g_on, method);
            }
        }
        if *lname == "vLLM per-layer" {
            best_method = best.1;
        }
    }
    r.note(format!(
        "fastest method for the per-layer layout: {best_method:?}"
    ));

    // 3. Offload and onboard at once (disjoint halves), per-layer layout, Auto method.
    let per_layer = Arc::new(layouts[1].1.clone());
    let e = Arc::new(
        TransferEngine::builder()
            .device(per_layer.clone(), DeviceKind::Cuda(opts.cuda_device as u32))
            .host(host.clone())
            .build()
            .map_err(|e| e.to_string())?,
    );
    let half = n / 2;
    let off_pairs: Vec<(u32, u32)> = (0..half).map(|i| (i, n + i)).collect();
    let on_pairs: Vec<(u32, u32)> = (half..n).map(|i| (i, i)).collect();
    let offj = jobs(&off_pairs, Tier::Device, Tier::Host, opts.job_blocks);
    let onj = jobs(&on_pairs, Tier::Host, Tier::Device, opts.job_blocks);
    let mut best_both = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let res = std::thread::scope(|s| {
            let a = s.spawn(|| run_jobs(&e, &offj, es));
            let b = s.spawn(|| run_jobs(&e, &onj, es));
            (a.join(), b.join())
        });
        let el = t.elapsed();
        match res {
            (Ok(Ok(_)), Ok(Ok(_))) => {}
            other => return Err(format!("bidirectional run failed: {other:?}")),
        }
        best_both = best_both.max(gbps((off_pairs.len() + on_pairs.len()) * BPB, el));
    }
    r.add(
        "gpu vLLM per-layer offload+onboard at once [Auto]",
        best_both,
        "GB/s",
        Some(("both directions, 1 GiB copies".into(), lim_both)),
    );

    // 4. Disk and remote straight to and from GPU memory (bounce buffers).
    if let Err(err) = gpu_staged(opts, r, &cache, &layouts[1].1, es) {
        r.note(format!("staged disk/remote <-> GPU failed: {err}"));
    }

    // 5. Pinning speed.
    if opts.pin_gib > 0 {
        let gib = opts.pin_gib;
        // Grow the VM's memory once first (untimed), so neither method pays for that.
        if let Ok(m) = Mapping::new(gib << 30) {
            m.touch_parallel(16);
        }
        let t = Instant::now();
        let theirs = PinnedAlloc::new(gib << 30)?;
        let t_alloc = t.elapsed();
        drop(theirs);
        let t = Instant::now();
        let mut po = HostOptions::new((gib * 512) as u32, BPB);
        po.pin = PinMode::Require;
        po.cuda_device = opts.cuda_device;
        let ours = HostStorage::new(&po).map_err(|e| e.to_string())?;
        let t_ours = t.elapsed();
        drop(ours);
        r.add(
            format!("pin {gib} GiB host tier: mmap+touch+cuMemHostRegister (s, lower is better)"),
            t_ours.as_secs_f64(),
            "s",
            Some(("cuMemHostAlloc".into(), t_alloc.as_secs_f64())),
        );
        r.note(format!(
            "pinning speed-up: {:.1}x",
            t_alloc.as_secs_f64() / t_ours.as_secs_f64()
        ));
    }

    // 6. GEMM next to a continuous offload.
    match gemm_interference(opts, &driver, &e, n, half) {
        Ok((alone, beside)) => r.add(
            "bf16 GEMM 8192^3 beside continuous offload",
            beside,
            "TFLOP/s",
            Some(("GEMM alone".into(), alone)),
        ),
        Err(err) => r.note(format!("GEMM interference not measured: {err}")),
    }
    Ok(())
}

/// Like [`jobs`], for remote jobs: pair `src`/`dst` on the remote side index `keys`.
fn keyed_jobs(
    pairs: &[(u32, u32)],
    src: Tier,
    dst: Tier,
    per_job: usize,
    keys: &[u128],
) -> Vec<TransferJob> {
    let mut js = jobs(pairs, src, dst, per_job);
    for j in &mut js {
        j.remote_keys = keys.to_vec();
    }
    js
}

/// The key of block `i` in the remote store (any distinct 128-bit values).
fn bench_key(i: u32) -> u128 {
    0x6b76_7469_6572_0000_0000_0000_0000_0000u128 | (u128::from(i) * 0x9E37_79B9)
}

/// Disk -> GPU and remote -> GPU through the TransferEngine's pinned bounce buffer (no host
/// tier), checked bit-exact on a sample, then timed against the two-hop path through a pinned
/// host tier (`Disk -> Host` then `Host -> Device`, same job sizes, same files).
fn gpu_staged(
    opts: &BenchOptions,
    r: &mut BenchReport,
    cache: &GpuCache,
    layout: &StridedLayout,
    es: Option<u64>,
) -> Result<(), String> {
    let n = opts.blocks.min(512).min(cache.blocks);
    let bytes = n as usize * BPB;
    let dir = opts.dir.join("staged");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let disk = Arc::new(
        DiskStorage::create(&DiskOptions::new(dir.join("disk"), n, BPB))
            .map_err(|e| e.to_string())?,
    );
    let remote =
        crate::remote::from_url(&format!("dir://{}", dir.join("remote").display()), "bench")
            .map_err(|e| e.to_string())?;
    let kind = DeviceKind::Cuda(opts.cuda_device as u32);
    let staged = TransferEngine::builder()
        .device(Arc::new(layout.clone()), kind)
        .disk(disk.clone())
        .remote(remote.clone())
        .build()
        .map_err(|e| e.to_string())?;
    r.note(format!(
        "staged (vLLM per-layer, no host tier): bounce buffer {:?} blocks per direction, pinned {:?}; disk O_DIRECT {}, io_uring {}",
        staged.bounce_blocks(),
        staged.bounce_pinned(),
        disk.is_direct(),
        disk.uses_io_uring()
    ));
    let mut ho = HostOptions::new(n, BPB);
    ho.pin = PinMode::Require;
    ho.cuda_device = opts.cuda_device;
    let host = Arc::new(HostStorage::new(&ho).map_err(|e| e.to_string())?);
    let two_hop = TransferEngine::builder()
        .device(Arc::new(layout.clone()), kind)
        .host(host)
        .disk(disk.clone())
        .remote(remote.clone())
        .build()
        .map_err(|e| e.to_string())?;
    let keys: Vec<u128> = (0..n).map(bench_key).collect();

    // Correctness on a sample: store, load into other blocks (reversed), compare, restore.
    let sample: Vec<u32> = (0..n).step_by((n as usize / 24).max(1)).take(24).collect();
    let m = sample.len();
    let truth: Vec<Vec<u8>> = sample
        .iter()
        .map(|&b| cache.block_bytes(layout, b))
        .collect::<Result<_, _>>()?;
    for far in [Tier::Disk, Tier::Remote] {
        let store: Vec<(u32, u32)> = sample
            .iter()
            .enumerate()
            .map(|(i, &b)| (b, i as u32))
            .collect();
        run_jobs(
            &staged,
            &keyed_jobs(&store, Tier::Device, far, 7, &keys),
            es,
        )?;
        let mut buf = vec![0u8; BPB];
        for (i, t) in truth.iter().enumerate() {
            match far {
                Tier::Disk => disk
                    .read_block(i as u32, &mut buf)
                    .map_err(|e| e.to_string())?,
                _ => remote.get(keys[i], &mut buf).map_err(|e| e.to_string())?,
            }
            if &buf != t {
                return Err(format!("{far:?}: stored block {} differs", sample[i]));
            }
        }
        let load: Vec<(u32, u32)> = (0..m).map(|i| (i as u32, sample[m - 1 - i])).collect();
        run_jobs(&staged, &keyed_jobs(&load, far, Tier::Device, 7, &keys), es)?;
        for (i, t) in truth.iter().enumerate() {
            if &cache.block_bytes(layout, sample[m - 1 - i])? != t {
                return Err(format!(
                    "{far:?}: loaded block {} differs",
                    sample[m - 1 - i]
                ));
            }
        }
        let back: Vec<(u32, u32)> = (0..m).map(|i| (i as u32, sample[i])).collect();
        run_jobs(&staged, &keyed_jobs(&back, far, Tier::Device, 7, &keys), es)?;
        for (i, t) in truth.iter().enumerate() {
            if &cache.block_bytes(layout, sample[i])? != t {
                return Err(format!("{far:?}: restored block {} differs", sample[i]));
            }
        }
    }
    // A missing key fails only its pair and leaves that device block as it was.
    let (victim, other) = (sample[0], sample[1]);
    let before = cache.block_bytes(layout, victim)?;
    let mut miss = keyed_jobs(
        &[(1, other), (0, victim)],
        Tier::Remote,
        Tier::Device,
        8,
        &keys,
    );
    miss[0].remote_keys[0] = 0xDEAD_BEEF;
    let f = staged.fence(es).map_err(|e| e.to_string())?;
    let out = staged.execute(&miss[0], &f);
    if out.failed_pairs() != vec![1] || cache.block_bytes(layout, victim)? != before {
        return Err(format!("missing remote key not isolated: {out:?}"));
    }
    if cache.block_bytes(layout, other)? != truth[1] {
        return Err("the pair beside a missing key differs".into());
    }
    r.note(format!(
        "staged Disk/Remote <-> CUDA bit-exact on {m} sampled blocks (store, reversed load, restore); a missing remote key failed only its pair"
    ));

    // Throughput: device block i <-> slot/key i (loads write back the same bytes).
    let pairs: Vec<(u32, u32)> = (0..n).map(|i| (i, i)).collect();
    let jb = opts.job_blocks;
    for far in [Tier::Disk, Tier::Remote] {
        let store = keyed_jobs(&pairs, Tier::Device, far, jb, &keys);
        let t_store = best_of(2, || run_jobs(&staged, &store, es))?;
        // Two hops: device -> host, host -> far, job by job.
        let two_store = best_of(2, || {
            let t = Instant::now();
            for j in keyed_jobs(&pairs, Tier::Device, Tier::Host, jb, &keys) {
                let far_j = TransferJob {
                    src: Tier::Host,
                    dst: far,
                    ..j.clone()
                };
                run_jobs(&two_hop, std::slice::from_ref(&j), es)?;
                run_jobs(&two_hop, std::slice::from_ref(&far_j), es)?;
            }
            Ok(t.elapsed())
        })?;
        let load = keyed_jobs(&pairs, far, Tier::Device, jb, &keys);
        let t_load = best_of(2, || run_jobs(&staged, &load, es))?;
        let two_load = best_of(2, || {
            let t = Instant::now();
            for j in keyed_jobs(&pairs, far, Tier::Host, jb, &keys) {
                let dev_j = TransferJob {
                    src: Tier::Host,
                    dst: Tier::Device,
                    ..j.clone()
                };
                run_jobs(&two_hop, std::slice::from_ref(&j), es)?;
                run_jobs(&two_hop, std::slice::from_ref(&dev_j), es)?;
            }
            Ok(t.elapsed())
        })?;
        let name = if far == Tier::Disk {
            "disk"
        } else {
            "remote dir://"
        };
        r.add(
            format!("gpu staged {name} -> device (bounce)"),
            gbps(bytes, t_load),
            "GB/s",
            Some((
                format!("{name} -> host tier -> device"),
                gbps(bytes, two_load),
            )),
        );
        r.add(
            format!("gpu staged device -> {name} (bounce)"),
            gbps(bytes, t_store),
            "GB/s",
            Some((
                format!("device -> host tier -> {name}"),
                gbps(bytes, two_store),
            )),
        );
    }
    // A larger bounce buffer (64 blocks: two halves of 32, the job size): disk rows only.
    let big = TransferEngine::builder()
        .device(Arc::new(layout.clone()), kind)
        .disk(disk.clone())
        .bounce_blocks(64)
        .build()
        .map_err(|e| e.to_string())?;
    let load = jobs(&pairs, Tier::Disk, Tier::Device, jb);
    let store = jobs(&pairs, Tier::Device, Tier::Disk, jb);
    let t_load = best_of(2, || run_jobs(&big, &load, es))?;
    let t_store = best_of(2, || run_jobs(&big, &store, es))?;
    r.add(
        "gpu staged disk -> device (bounce of 64 blocks)",
        gbps(bytes, t_load),
        "GB/s",
        None,
    );
    r.add(
        "gpu staged device -> disk (bounce of 64 blocks)",
        gbps(bytes, t_store),
        "GB/s",
        None,
    );
    // Everything still as it was.
    for (i, t) in truth.iter().enumerate() {
        if &cache.block_bytes(layout, sample[i])? != t {
            return Err(format!("block {} differs after the timed runs", sample[i]));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Offload sample blocks, check host bytes; onboard them to other device blocks, check device
/// bytes; then restore those device blocks.
fn check_gpu_round_trip(
    e: &TransferEngine,
    cache: &GpuCache,
    layout: &StridedLayout,
    host: &HostStorage,
    n: u32,
    es: Option<u64>,
) -> Result<(), String> {
    let sample: Vec<u32> = (0..n).step_by((n as usize / 40).max(1)).take(40).collect();
    let truth: Vec<Vec<u8>> = sample
        .iter()
        .map(|&b| cache.block_bytes(layout, b))
        .collect::<Result<_, _>>()?;
    // Offload sample[i] -> host n + i (scattered host ids to exercise non-coalesced copies).
    let off: Vec<(u32, u32)> = sample
        .iter()
        .enumerate()
        .map(|(i, &b)| (b, n + (i as u32 * 7) % n))
        .collect();
    run_jobs(e, &jobs(&off, Tier::Device, Tier::Host, 16), es)?;
    let mut buf = vec![0u8; BPB];
    for (i, &(_, h)) in off.iter().enumerate() {
        host.read_block(h, &mut buf).map_err(|e| e.to_string())?;
        if buf != truth[i] {
            return Err(format!("offloaded block {} differs", sample[i]));
        }
    }
    // Onboard host copies into the device blocks reversed, check, then put the originals back.
    let m = sample.len();
    let on: Vec<(u32, u32)> = (0..m).map(|i| (off[i].1, sample[m - 1 - i])).collect();
    run_jobs(e, &jobs(&on, Tier::Host, Tier::Device, 16), es)?;
    for i in 0..m {
        if cache.block_bytes(layout, sample[m - 1 - i])? != truth[i] {
            return Err(format!("onboarded block {} differs", sample[m - 1 - i]));
        }
    }
    let back: Vec<(u32, u32)> = (0..m).map(|i| (off[i].1, sample[i])).collect();
    run_jobs(e, &jobs(&back, Tier::Host, Tier::Device, 16), es)?;
    Ok(())
}

/// TFLOP/s of back-to-back GEMMs alone, then beside a thread offloading continuously.
fn gemm_interference(
    opts: &BenchOptions,
    driver: &Arc<Driver>,
    e: &Arc<TransferEngine>,
    n: u32,
    half: u32,
) -> Result<(f64, f64), String> {
    let stream = Stream::new(false)?;
    let mut g = Gemm::new(8192, &stream)?;
    let measure = |g: &mut Gemm| -> Result<f64, String> {
        let t = Instant::now();
        let mut flops = 0.0;
        while t.elapsed().as_secs_f64() < opts.gemm_secs {
            for _ in 0..8 {
                flops += g.run()?;
            }
            stream.synchronize()?;
        }
        Ok(flops / t.elapsed().as_secs_f64() / 1e12)
    };
    for _ in 0..4 {
        g.run()?;
    }
    stream.synchronize()?;
    let alone = measure(&mut g)?;
    let stop = Arc::new(AtomicBool::new(false));
    let pairs: Vec<(u32, u32)> = (0..half).map(|i| (i, n + i)).collect();
    let offj = jobs(&pairs, Tier::Device, Tier::Host, opts.job_blocks);
    let es = Some(stream.raw() as usize as u64);
    let moved = std::thread::scope(|s| {
        let stop2 = stop.clone();
        let d = driver.clone();
        let h = s.spawn(move || -> Result<usize, String> {
            d.make_current()?;
            let mut bytes = 0usize;
            while !stop2.load(Ordering::Relaxed) {
                run_jobs(e, &offj, es)?;
                bytes += offj.len() * opts.job_blocks * BPB;
            }
            Ok(bytes)
        });
        std::thread::sleep(Duration::from_millis(200));
        let beside = measure(&mut g);
        stop.store(true, Ordering::Relaxed);
        (beside, h.join())
    });
    let beside = moved.0?;
    match moved.1 {
        Ok(Ok(_)) => {}
        other => return Err(format!("offload loop failed: {other:?}")),
    }
    Ok((alone, beside))
}
