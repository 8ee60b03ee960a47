//! The host and disk legs of the transfer benchmark: host copies against one large memcpy, the
//! disk tier against `fio` (O_DIRECT) on the same directory, and disk <-> CPU device memory
//! through the engine's bounce buffers against the two hops through a host tier.
use super::*;

/// Host copies: TransferEngine host->host and CPU-device->host against one large memcpy.
pub(super) fn cpu_host(opts: &BenchOptions, r: &mut BenchReport) -> Result<(), String> {
    let n = opts.blocks as usize;
    let bytes = n * BPB;
    let a = Mapping::new(bytes).map_err(|e| e.to_string())?;
    let b = Mapping::new(bytes).map_err(|e| e.to_string())?;
    a.touch_parallel(4);
    b.touch_parallel(4);
    let memcpy = best_of(3, || {
        let t = Instant::now();
        // Two distinct live mappings of `bytes` bytes, used by this thread only.
        job::copy(a.addr(), b.addr(), bytes);
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
    let bases = (0..LAYERS)
        .map(|l| DevicePtr::new((a.addr() + l * layer_bytes) as u64))
        .collect::<Option<Vec<_>>>()
        .ok_or("null mapping")?;
    let per_layer =
        StridedLayout::kv_per_layer(&bases, opts.blocks, CHUNK).map_err(|e| e.to_string())?;
    let e = TransferEngine::builder()
        .device(
            // the mapping outlives the engine (declared first); only its jobs touch it.
            job::register_own_memory(Arc::new(per_layer), DeviceKind::Cpu),
        )
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
pub(super) fn disk(opts: &BenchOptions, r: &mut BenchReport) -> Result<(), String> {
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
pub(super) fn disk_cpu_device(
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
    let bases = (0..LAYERS)
        .map(|l| DevicePtr::new((kv.addr() + l * layer_bytes) as u64))
        .collect::<Option<Vec<_>>>()
        .ok_or("null mapping")?;
    let layout =
        Arc::new(StridedLayout::kv_per_layer(&bases, n, CHUNK).map_err(|e| e.to_string())?);
    let staged = TransferEngine::builder()
        .device(
            // the mapping outlives the engine (declared first); only its jobs touch it.
            job::register_own_memory(layout.clone(), DeviceKind::Cpu),
        )
        .disk(d.clone())
        .build()
        .map_err(|e| e.to_string())?;
    let two_hop = TransferEngine::builder()
        .device(
            // the mapping outlives the engine (declared first); only its jobs touch it.
            job::register_own_memory(layout, DeviceKind::Cpu),
        )
        .host(host.clone())
        .disk(d.clone())
        .build()
        .map_err(|e| e.to_string())?;
    let pairs: Vec<(u32, u32)> = (0..n).map(|i| (i, i)).collect();
    let jb = opts.job_blocks;
    let two = |first: (Tier, Tier), second: (Tier, Tier)| -> Result<Duration, String> {
        let t = Instant::now();
        let hops = jobs(&pairs, first.0, first.1, jb)
            .into_iter()
            .zip(jobs(&pairs, second.0, second.1, jb));
        for (j, k) in hops {
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
pub(super) fn fio(dir: &std::path::Path, rw: &str, bytes: usize) -> Result<f64, String> {
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
