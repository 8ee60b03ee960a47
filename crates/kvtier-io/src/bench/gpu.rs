//! The GPU legs of the transfer benchmark: offload/onboard in both KV layouts against one large
//! pinned copy, each path first checked bit-exact by a round trip, and a cuBLAS GEMM's
//! throughput alone against beside a thread offloading continuously.
use super::staged::gpu_staged;
use super::*;

/// A GPU KV cache in both layouts, with the host-side truth for checks.
pub(super) struct GpuCache {
    mem: DeviceAlloc,
    pub(super) blocks: u32,
}

impl GpuCache {
    pub(super) fn new(blocks: u32) -> Result<Self, String> {
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
    pub(super) fn pool(&self) -> Result<StridedLayout, String> {
        let base = DevicePtr::new(self.mem.addr()).ok_or("null device allocation")?;
        StridedLayout::contiguous(base, self.blocks, BPB).map_err(|e| e.to_string())
    }
    /// vLLM per-layer `[2, blocks, chunk]` per layer: 64 chunks of 32 KiB per block.
    pub(super) fn per_layer(&self) -> Result<StridedLayout, String> {
        let lb = 2 * self.blocks as usize * CHUNK;
        let bases = (0..LAYERS)
            .map(|l| DevicePtr::new(self.mem.addr() + (l * lb) as u64))
            .collect::<Option<Vec<_>>>()
            .ok_or("null device allocation")?;
        StridedLayout::kv_per_layer(&bases, self.blocks, CHUNK).map_err(|e| e.to_string())
    }
    /// Canonical bytes of device block `b` under `layout`, read back from the GPU.
    pub(super) fn block_bytes(&self, layout: &StridedLayout, b: u32) -> Result<Vec<u8>, String> {
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

pub(super) fn gpu(opts: &BenchOptions, r: &mut BenchReport) -> Result<(), String> {
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
            // Our own allocations of 1 GiB each, synchronised before reuse.
            e0.record(&s1)?;
            job::memcpy_async(h1.addr() as u64, d1.addr(), 1 << 30, &s1)?;
            e1.record(&s1)?;
            job::memcpy_async(d2.addr(), h2.addr() as u64, 1 << 30, &s1)?;
            e2.record(&s1)?;
            e2.synchronize()?;
            let d2h = (1u64 << 30) as f64 / (Event::elapsed_ms(&e0, &e1)? as f64 / 1e3) / 1e9;
            let h2d = (1u64 << 30) as f64 / (Event::elapsed_ms(&e1, &e2)? as f64 / 1e3) / 1e9;
            let t = Instant::now();
            // As above; two streams, opposite directions, disjoint buffers.
            job::memcpy_async(h1.addr() as u64, d1.addr(), 1 << 30, &s1)?;
            job::memcpy_async(d2.addr(), h2.addr() as u64, 1 << 30, &s2)?;
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
                    // `cache` outlives every engine here; only their jobs touch it meanwhile.
                    job::register_own_memory(
                        Arc::new(layout.clone()),
                        DeviceKind::Cuda(opts.cuda_device as u32),
                    ),
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
            .device(
                // `cache` outlives every engine here; only their jobs touch it meanwhile.
                job::register_own_memory(
                    per_layer.clone(),
                    DeviceKind::Cuda(opts.cuda_device as u32),
                ),
            )
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

/// Offload sample blocks, check host bytes; onboard them to other device blocks, check device
/// bytes; then restore those device blocks.
pub(super) fn check_gpu_round_trip(
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
pub(super) fn gemm_interference(
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
