//! Re-opening a persisted disk tier (#14 item 1): how long a restart takes to rebuild G3's
//! index from the journal and hand the leader its blocks, for `KVTIER_REOPEN_BLOCKS` blocks
//! (default 1M) of 4 KiB. Baseline in the same run: a cold start of the same geometry (files
//! truncated and preallocated, nothing recovered).
//!
//! `cargo bench -p kvtier-io --bench disk_reopen` (needs ~8.3 GB free under `KVTIER_REOPEN_DIR`,
//! default the system temp dir). Prints one table.
#![allow(clippy::unwrap_used)]
use std::time::Instant;

use kvtier::ids::Tier;
use kvtier::pool::{BlockPool, Priority};
use kvtier_io::{DirectMode, DiskOptions, DiskStorage};

const BPB: usize = 4096;

fn main() {
    let n: u32 = std::env::var("KVTIER_REOPEN_BLOCKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let base = std::env::var_os("KVTIER_REOPEN_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let tmp = tempfile::tempdir_in(base).unwrap();
    let mut o = DiskOptions::new(tmp.path(), n, BPB);
    o.persist = true;
    o.direct = DirectMode::Off;
    o.name = "bench".into();

    let t = Instant::now();
    let d = DiskStorage::create(&o).unwrap();
    let create = t.elapsed();
    let mut buf = vec![0u8; BPB * 64];
    let t = Instant::now();
    let mut slot = 0u32;
    while slot < n {
        let k = 64.min(n - slot);
        for (i, c) in buf.chunks_mut(BPB).enumerate().take(k as usize) {
            c[..8].copy_from_slice(&(slot as u64 + i as u64).to_le_bytes());
        }
        for i in 0..k {
            let b = &buf[i as usize * BPB..(i as usize + 1) * BPB];
            d.write_block_keyed(slot + i, 1 << 64 | (slot + i) as u128, b)
                .unwrap();
        }
        slot += k;
    }
    d.sync().unwrap();
    let fill = t.elapsed();
    let records = d.journal_records();
    drop(d);

    let t = Instant::now();
    let d = DiskStorage::create(&o).unwrap();
    let reopen = t.elapsed();
    let recovered = d.recovered().to_vec();
    assert_eq!(recovered.len(), n as usize, "every block recovered");
    let t = Instant::now();
    let mut pool = BlockPool::new(Tier::Disk, n as usize).unwrap();
    pool.set_record_events(false);
    let adopted = pool.adopt(&recovered, Priority::default());
    let adopt = t.elapsed();
    assert_eq!(adopted, n as usize);
    // Spot-check: recovered blocks read back exact.
    let mut out = vec![0u8; BPB];
    for s in (0..n).step_by((n as usize / 1000).max(1)) {
        d.read_block_keyed(s, 1 << 64 | s as u128, &mut out)
            .unwrap();
        assert_eq!(&out[..8], &(s as u64).to_le_bytes());
    }
    drop(d);

    let mut cold = o.clone();
    cold.persist = false;
    let t = Instant::now();
    let d = DiskStorage::create(&cold).unwrap();
    let cold_start = t.elapsed();
    assert!(d.recovered().is_empty());
    drop(d);

    // What the durability point costs writers: one-block writes (the leader's spill jobs) with
    // and without the journal, same files, same run.
    let rate = |blocks: u32, bpb: usize, persist: bool| {
        let mut o = DiskOptions::new(tmp.path(), blocks, bpb);
        o.persist = persist;
        o.direct = DirectMode::Auto;
        o.name = format!("rate{}", persist as u8);
        let d = DiskStorage::create(&o).unwrap();
        let b = vec![7u8; bpb];
        let t = Instant::now();
        for s in 0..blocks {
            d.write_block_keyed(s, 1 << 64 | s as u128, &b).unwrap();
        }
        d.sync().unwrap();
        (blocks as f64 * bpb as f64) / t.elapsed().as_secs_f64() / 1e6
    };
    let mut rates = Vec::new();
    for (b, bpb) in [(20_000u32, 4096usize), (2_000, 256 << 10)] {
        // Alternate the order so neither mode always runs on a warmer disk.
        let off1 = rate(b, bpb, false);
        let on1 = rate(b, bpb, true);
        let on2 = rate(b, bpb, true);
        let off2 = rate(b, bpb, false);
        rates.push((b, bpb, (off1 + off2) / 2.0, (on1 + on2) / 2.0));
    }

    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    println!("| blocks | first create | fill + sync | journal records | warm re-open | pool adopt | re-open + adopt | cold start (baseline) | ratio |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    println!(
        "| {n} x 4 KiB | {:.0} ms | {:.1} s | {records} | {:.0} ms | {:.0} ms | {:.0} ms | {:.0} ms | {:.2}x |",
        ms(create),
        fill.as_secs_f64(),
        ms(reopen),
        ms(adopt),
        ms(reopen + adopt),
        ms(cold_start),
        (reopen + adopt).as_secs_f64() / cold_start.as_secs_f64()
    );
    println!();
    println!("| one-block writes, O_DIRECT where supported, mean of 2 runs each | no journal (baseline) | persist (journal; flusher fdatasyncs per 256 records / 20 ms) | ratio |");
    println!("| --- | --- | --- | --- |");
    for (b, bpb, off, on) in rates {
        println!(
            "| {b} x {} KiB | {off:.0} MB/s | {on:.0} MB/s | {:.2}x |",
            bpb >> 10,
            on / off
        );
    }
}
