//! The Redis backend in cluster mode against a real 3-master Redis Cluster on loopback: keys spread
//! over the nodes round-trip bit-exactly, `contains` spans nodes in one call, damage on the owning
//! node is detected, and a dead node yields bounded errors, never wrong bytes.
#![allow(clippy::unwrap_used)]
mod remote_support;

use kvtier::hash::SequenceHash;
use std::time::{Duration, Instant};

use anyhow::Result;
use kvtier::transfer::{RemoteError, TransferError};
use kvtier_io::storage::remote::{encode_value, from_url};
use remote_support::{block, RedisCluster};

const LEN: usize = 256 << 10;

#[test]
fn cluster_round_trip_contains_and_damage() -> Result<()> {
    let Some(cluster) = RedisCluster::start(3) else {
        return Ok(());
    };
    let store = from_url(&cluster.url(), "cl")?;
    let keys: Vec<u128> = (0..24u128)
        .map(|i| i * 0x9e37_79b9_7f4a_7c15_f39c)
        .collect();
    for (i, &k) in keys.iter().enumerate() {
        store.put(SequenceHash(k), &block(i as u64, LEN))?;
    }
    // The keys really are spread over all three nodes.
    let mut per_node = [0usize; 3];
    for &k in &keys {
        let name = format!("kvtier:v1:cl:{k:032x}");
        let owner = cluster.owner_of(&name);
        let idx = cluster
            .nodes
            .iter()
            .position(|n| n.port == owner.port)
            .unwrap();
        per_node[idx] += 1;
        let stored: Vec<u8> = redis::cmd("GET").arg(&name).query(&mut owner.raw()?)?;
        assert!(
            stored
                == encode_value(
                    "cl",
                    k,
                    &block(keys.iter().position(|&x| x == k).unwrap() as u64, LEN)
                )
        );
    }
    assert!(per_node.iter().all(|&n| n > 0), "{per_node:?}");

    for (i, &k) in keys.iter().enumerate() {
        let mut out = vec![0u8; LEN];
        store.get(SequenceHash(k), &mut out)?;
        assert!(out == block(i as u64, LEN), "block {i}");
    }
    let mut probe = keys.clone();
    probe.insert(5, 12345);
    probe.push(u128::MAX);
    let mut expect = vec![true; keys.len()];
    expect.insert(5, false);
    expect.push(false);
    assert_eq!(
        store.contains(&probe.iter().copied().map(SequenceHash).collect::<Vec<_>>())?,
        expect
    );

    // Damage one value on its owning node.
    let name = format!("kvtier:v1:cl:{:032x}", keys[7]);
    let owner = cluster.owner_of(&name);
    let mut v: Vec<u8> = redis::cmd("GET").arg(&name).query(&mut owner.raw()?)?;
    v[100] ^= 1;
    let _: () = redis::cmd("SET")
        .arg(&name)
        .arg(&v)
        .query(&mut owner.raw()?)?;
    let mut out = vec![0u8; LEN];
    assert!(matches!(
        store.get(SequenceHash(keys[7]), &mut out),
        Err(TransferError::Remote(RemoteError::Corrupt { .. }))
    ));
    assert!(matches!(
        store.get(SequenceHash(777), &mut out),
        Err(TransferError::Remote(RemoteError::Missing {
            key: SequenceHash(777)
        }))
    ));
    Ok(())
}

#[test]
fn dead_cluster_node_gives_bounded_errors_never_wrong_bytes() -> Result<()> {
    let Some(mut cluster) = RedisCluster::start(3) else {
        return Ok(());
    };
    let url = format!(
        "{}&connect_timeout_ms=300&io_timeout_ms=500&backoff_ms=0",
        cluster.url()
    );
    let store = from_url(&url, "dead")?;
    let keys: Vec<u128> = (0..12u128).map(|i| i * 0x1234_5678_9abc_def1).collect();
    for (i, &k) in keys.iter().enumerate() {
        store.put(SequenceHash(k), &block(i as u64, 4096))?;
    }
    cluster.nodes[1].kill();
    let mut errors = 0;
    for (i, &k) in keys.iter().enumerate() {
        let mut out = vec![0u8; 4096];
        let t = Instant::now();
        match store.get(SequenceHash(k), &mut out) {
            Ok(()) => assert!(out == block(i as u64, 4096), "wrong bytes for key {i}"),
            Err(TransferError::Remote(RemoteError::Unavailable { .. })) => errors += 1,
            Err(e) => panic!("unexpected error {e}"),
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "get took {:?}",
            t.elapsed()
        );
    }
    assert!(errors > 0, "no key lived on the killed node");
    Ok(())
}

/// Regression: one breaker for the whole cluster meant that once a dead master's keys tripped it,
/// every key of the healthy masters failed too for the breaker's window. Each node now has its
/// own: the dead node's keys fail (fast once its breaker is open), the others' keep round-tripping.
#[test]
fn a_dead_node_trips_only_its_own_breaker() -> Result<()> {
    let Some(mut cluster) = RedisCluster::start(3) else {
        return Ok(());
    };
    let url = format!(
        "{}&connect_timeout_ms=300&io_timeout_ms=500&backoff_ms=5000&trip_after=1",
        cluster.url()
    );
    let store = from_url(&url, "trip")?;
    let keys: Vec<u128> = (0..24u128).map(|i| i * 0x2545_f491_4f6c_dd1d).collect();
    for (i, &k) in keys.iter().enumerate() {
        store.put(SequenceHash(k), &block(i as u64, 4096))?;
    }
    let dead_port = cluster.nodes[1].port;
    let on_dead = |k: u128| cluster.owner_of(&format!("kvtier:v1:trip:{k:032x}")).port == dead_port;
    let dead: Vec<bool> = keys.iter().map(|&k| on_dead(k)).collect();
    assert!(
        dead.iter().any(|d| *d) && dead.iter().any(|d| !*d),
        "{dead:?}"
    );
    cluster.nodes[1].kill();
    for round in 0..2 {
        for (i, &k) in keys.iter().enumerate() {
            let mut out = vec![0u8; 4096];
            let t = Instant::now();
            let r = store.get(SequenceHash(k), &mut out);
            if dead[i] {
                assert!(
                    matches!(
                        r,
                        Err(TransferError::Remote(RemoteError::Unavailable { .. }))
                    ),
                    "round {round} key {i}: {r:?}"
                );
            } else {
                assert!(r.is_ok(), "round {round} key {i} on a live node: {r:?}");
                assert!(out == block(i as u64, 4096));
            }
            assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        }
    }
    Ok(())
}
