//! Host <-> Remote jobs through the real `TransferEngine`, as in disaggregated serving: a prefill
//! worker offloads its KV blocks (device -> host -> remote) under their sequence hashes, and a
//! decode worker with its own engine, host tier and store handle (as another process would open
//! it) loads them (remote -> host -> device). Checked on a real redis-server and on a directory;
//! damaged, missing and unreachable values fail exactly their pairs, never deliver wrong bytes.
#![allow(clippy::unwrap_used)]
mod remote_support;

use kvtier::hash::SequenceHash;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use kvtier::hash::{sequence_hashes, HashSalt};
use kvtier::transfer::{BlockTransfer, RemoteStore, TransferJob, TransferOutcome};
use kvtier::{JobId, Tier};
use kvtier_io::storage::remote::from_url;
use kvtier_io::{
    DeviceKind, DevicePtr, EngineMemory, HostOptions, HostStorage, PinMode, StridedLayout,
    TransferEngine,
};
use remote_support::{block, RedisServer};

const BLOCK: usize = 64 << 10;
const BLOCKS: u32 = 8;
const TOKENS_PER_BLOCK: usize = 16;

/// One worker: a CPU "engine" KV cache of `BLOCKS` blocks, a host tier and the remote store.
struct Worker {
    kv: Vec<u8>,
    host: Arc<HostStorage>,
    engine: TransferEngine,
}

impl Worker {
    fn new(remote: Arc<dyn RemoteStore>) -> Worker {
        let kv = vec![0u8; BLOCKS as usize * BLOCK];
        let layout =
            StridedLayout::contiguous(DevicePtr::from_host(kv.as_ptr()).unwrap(), BLOCKS, BLOCK)
                .unwrap();
        let mut o = HostOptions::new(BLOCKS, BLOCK);
        o.pin = PinMode::Never;
        let host = Arc::new(HostStorage::new(&o).unwrap());
        let engine = TransferEngine::builder()
            .device(
                // SAFETY: the cache outlives the engine; the test touches it only between jobs.
                unsafe { EngineMemory::new(Arc::new(layout), DeviceKind::Cpu) },
            )
            .host(Arc::clone(&host))
            .remote(remote)
            .build()
            .unwrap();
        Worker { kv, host, engine }
    }

    fn device_block(&self, b: u32) -> &[u8] {
        &self.kv[b as usize * BLOCK..(b as usize + 1) * BLOCK]
    }

    fn run(&self, job: &TransferJob) -> TransferOutcome {
        let fence = self.engine.fence(None).unwrap();
        self.engine.execute(job, &fence)
    }
}

/// A job of block numbers; a remote block's key is `keys[i]`, `i` its number on the remote side.
fn job(src: Tier, dst: Tier, pairs: &[(u32, u32)], keys: &[u128]) -> TransferJob {
    kvtier_io::transfer::numbered_job(JobId(7), src, dst, pairs, |i| {
        keys.get(i as usize).copied().unwrap_or(0)
    })
}

/// The sequence hashes of a prompt of `n` full blocks.
fn prompt_keys(n: usize, seed: u32) -> Vec<u128> {
    let tokens: Vec<u32> = (0..(n * TOKENS_PER_BLOCK) as u32)
        .map(|t| t.wrapping_mul(7919) ^ seed)
        .collect();
    let salt = HashSalt::new("test-model", None, None);
    sequence_hashes(salt, &tokens, TOKENS_PER_BLOCK)
        .into_iter()
        .map(|h| h.0)
        .collect()
}

/// Prefill computes 4 blocks into device blocks 2..6 and offloads them to the remote store.
fn prefill(url: &str, ns: &str, keys: &[u128]) -> Result<Vec<Vec<u8>>> {
    let mut p = Worker::new(from_url(url, ns)?);
    let mut computed = Vec::new();
    for (i, dev) in (2u32..6).enumerate() {
        let data = block(1000 + i as u64, BLOCK);
        p.kv[dev as usize * BLOCK..(dev as usize + 1) * BLOCK].copy_from_slice(&data);
        computed.push(data);
    }
    // G1 -> G2 into host blocks 4..8, then G2 -> G4 (remote side = index into the key list).
    let out = p.run(&job(
        Tier::Device,
        Tier::Host,
        &[(2, 4), (3, 5), (4, 6), (5, 7)],
        &[],
    ));
    assert_eq!(out, TransferOutcome::Ok);
    let out = p.run(&job(
        Tier::Host,
        Tier::Remote,
        &[(4, 0), (5, 1), (6, 2), (7, 3)],
        keys,
    ));
    assert_eq!(out, TransferOutcome::Ok);
    for (i, data) in computed.iter().enumerate() {
        assert!(p.device_block(2 + i as u32) == &data[..]);
    }
    Ok(computed)
}

/// Decode loads `keys` (G4 -> G2 blocks 0..n, G2 -> G1 blocks 1..n+1) and checks the bytes.
fn decode_and_check(url: &str, ns: &str, keys: &[u128], computed: &[Vec<u8>]) -> Result<()> {
    let store = from_url(url, ns)?;
    assert_eq!(
        store.contains(&keys.iter().copied().map(SequenceHash).collect::<Vec<_>>())?,
        vec![true; keys.len()]
    );
    let d = Worker::new(store);
    let to_host: Vec<(u32, u32)> = (0..keys.len() as u32).map(|i| (i, i)).collect();
    assert_eq!(
        d.run(&job(Tier::Remote, Tier::Host, &to_host, keys)),
        TransferOutcome::Ok
    );
    let to_dev: Vec<(u32, u32)> = (0..keys.len() as u32).map(|i| (i, i + 1)).collect();
    assert_eq!(
        d.run(&job(Tier::Host, Tier::Device, &to_dev, &[])),
        TransferOutcome::Ok
    );
    for (i, data) in computed.iter().enumerate() {
        assert!(
            d.device_block(i as u32 + 1) == &data[..],
            "decode block {i} differs from prefill's"
        );
    }
    Ok(())
}

#[test]
fn prefill_to_decode_through_redis() -> Result<()> {
    let Some(srv) = RedisServer::start() else {
        return Ok(());
    };
    let keys = prompt_keys(4, 1);
    let computed = prefill(&srv.url(), "disagg", &keys)?;
    decode_and_check(&srv.url(), "disagg", &keys, &computed)?;
    // Another namespace (another model) sees nothing.
    let other = from_url(&srv.url(), "other-model")?;
    assert_eq!(
        other.contains(&keys.iter().copied().map(SequenceHash).collect::<Vec<_>>())?,
        vec![false; 4]
    );
    Ok(())
}

#[test]
fn prefill_to_decode_through_a_shared_directory() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let url = format!("dir://{}", tmp.path().display());
    let keys = prompt_keys(4, 2);
    let computed = prefill(&url, "disagg", &keys)?;
    decode_and_check(&url, "disagg", &keys, &computed)
}

#[test]
fn damaged_and_missing_values_fail_exactly_their_pairs() -> Result<()> {
    let Some(srv) = RedisServer::start() else {
        return Ok(());
    };
    let keys = prompt_keys(4, 3);
    let computed = prefill(&srv.url(), "dmg", &keys)?;
    // Damage key 1 through a raw connection; key 4 (never stored) is missing.
    let mut raw = srv.raw()?;
    let name = format!("kvtier:v1:dmg:{:032x}", keys[1]);
    let mut v: Vec<u8> = redis::cmd("GET").arg(&name).query(&mut raw)?;
    v[40 + 1234] ^= 0x80;
    let _: () = redis::cmd("SET").arg(&name).arg(&v).query(&mut raw)?;
    let mut all = keys.clone();
    all.push(prompt_keys(5, 3)[4]);
    let d = Worker::new(from_url(&srv.url(), "dmg")?);
    let pairs: Vec<(u32, u32)> = (0..5).map(|i| (i, i)).collect();
    let out = d.run(&job(Tier::Remote, Tier::Host, &pairs, &all));
    assert_eq!(out.failed_pairs(), vec![1, 4]);
    let TransferOutcome::Failed(f) = &out else {
        unreachable!()
    };
    assert!(f[0].reason.contains("corrupt"), "{}", f[0].reason);
    assert!(f[1].reason.contains("not present"), "{}", f[1].reason);
    // The other pairs landed intact.
    let mut hb = vec![0u8; BLOCK];
    for i in [0u32, 2, 3] {
        d.host.read_block(i, &mut hb)?;
        assert!(hb == computed[i as usize], "host block {i}");
    }
    Ok(())
}

#[test]
fn unreachable_redis_fails_every_pair_quickly() -> Result<()> {
    let Some(mut srv) = RedisServer::start() else {
        return Ok(());
    };
    let url = format!("{}?connect_timeout_ms=300&io_timeout_ms=500", srv.url());
    let keys = prompt_keys(8, 4);
    let d = Worker::new(from_url(&url, "down")?);
    srv.signal("STOP");
    let pairs: Vec<(u32, u32)> = (0..8).map(|i| (i, i)).collect();
    let t = Instant::now();
    let out = d.run(&job(Tier::Remote, Tier::Host, &pairs, &keys));
    let took = t.elapsed();
    srv.signal("CONT");
    assert_eq!(out.failed_pairs(), (0..8).collect::<Vec<_>>());
    // One timeout, then the store fails fast: far below 8 separate timeouts.
    assert!(took < Duration::from_secs(2), "job took {took:?}");
    // Offload to a dead server fails too, pair by pair, without panicking.
    srv.kill();
    let out = d.run(&job(
        Tier::Host,
        Tier::Remote,
        &[(0, 0), (1, 1)],
        &keys[..2],
    ));
    assert_eq!(out.failed_pairs(), vec![0, 1]);
    Ok(())
}
