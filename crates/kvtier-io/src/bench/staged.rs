//! Disk -> GPU and remote -> GPU through the engine's pinned bounce buffer (no host tier),
//! checked bit-exact on a sample, timed against the two hops through a pinned host tier.
use super::gpu::GpuCache;
use super::*;

/// Like [`jobs`], for disk and remote jobs: block `i`'s key is `keys[i]` (0 past its end).
pub(super) fn keyed_jobs(
    pairs: &[(u32, u32)],
    src: Tier,
    dst: Tier,
    per_job: usize,
    keys: &[u128],
) -> Vec<TransferJob> {
    let key = |i: u32| keys.get(i as usize).copied().unwrap_or(0);
    pairs
        .chunks(per_job.max(1))
        .enumerate()
        .map(|(i, c)| crate::transfer::numbered_job(JobId(i as u64), src, dst, c, key))
        .collect()
}

/// The key of block `i` in the remote store (any distinct 128-bit values).
pub(super) fn bench_key(i: u32) -> u128 {
    0x6b76_7469_6572_0000_0000_0000_0000_0000u128 | (u128::from(i) * 0x9E37_79B9)
}

/// Disk -> GPU and remote -> GPU through the TransferEngine's pinned bounce buffer (no host
/// tier), checked bit-exact on a sample, then timed against the two-hop path through a pinned
/// host tier (`Disk -> Host` then `Host -> Device`, same job sizes, same files).
pub(super) fn gpu_staged(
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
    let remote = crate::storage::remote::from_url(
        &format!("dir://{}", dir.join("remote").display()),
        "bench",
    )
    .map_err(|e| e.to_string())?;
    let kind = DeviceKind::Cuda(opts.cuda_device as u32);
    let staged = TransferEngine::builder()
        .device(
            // the benchmark's device cache outlives these engines; only their jobs touch it.
            job::register_own_memory(Arc::new(layout.clone()), kind),
        )
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
        .device(
            // the benchmark's device cache outlives these engines; only their jobs touch it.
            job::register_own_memory(Arc::new(layout.clone()), kind),
        )
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
                _ => remote
                    .get(kvtier::hash::SequenceHash(keys[i]), &mut buf)
                    .map_err(|e| e.to_string())?,
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
    // Pair 1 (the victim) reads a key the store does not hold.
    let mut miss_keys = keys.clone();
    miss_keys[0] = 0xDEAD_BEEF;
    let miss = keyed_jobs(
        &[(1, other), (0, victim)],
        Tier::Remote,
        Tier::Device,
        8,
        &miss_keys,
    );
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
            let hops = keyed_jobs(&pairs, Tier::Device, Tier::Host, jb, &keys)
                .into_iter()
                .zip(keyed_jobs(&pairs, Tier::Host, far, jb, &keys));
            for (j, far_j) in hops {
                run_jobs(&two_hop, std::slice::from_ref(&j), es)?;
                run_jobs(&two_hop, std::slice::from_ref(&far_j), es)?;
            }
            Ok(t.elapsed())
        })?;
        let load = keyed_jobs(&pairs, far, Tier::Device, jb, &keys);
        let t_load = best_of(2, || run_jobs(&staged, &load, es))?;
        let two_load = best_of(2, || {
            let t = Instant::now();
            let hops = keyed_jobs(&pairs, far, Tier::Host, jb, &keys)
                .into_iter()
                .zip(keyed_jobs(&pairs, Tier::Host, Tier::Device, jb, &keys));
            for (j, dev_j) in hops {
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
        .device(
            // the benchmark's device cache outlives these engines; only their jobs touch it.
            job::register_own_memory(Arc::new(layout.clone()), kind),
        )
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
