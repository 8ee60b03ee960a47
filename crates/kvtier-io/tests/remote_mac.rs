//! Regression (#28, forged blocks): the frame tag was an unkeyed hash, so anyone who could write
//! to the shared store recomputed it and had their bytes served (16/16 tokens changed). With
//! `remote.mac_key_file` the tag is a keyed MAC: a frame forged with a recomputed unkeyed tag
//! reads as a miss (the engine recomputes), one claiming to be keyed without the key is corrupt,
//! and the cluster's own frames round-trip. Directory store through the configuration, and a
//! real Redis.
#![allow(clippy::unwrap_used)]
mod remote_support;

use kvtier::hash::SequenceHash;
use std::collections::HashMap;

use anyhow::Result;
use kvtier::config::KvtierConfig;
use kvtier::transfer::{RemoteError, RemoteStore, TransferError};
use kvtier_io::storage::remote::{encode_value, open, RedisStore};
use remote_support::{block, RedisServer};

const SECRET: &[u8] = b"kvtier-test-cluster-secret-0123456789\n";

fn remote_err(r: Result<(), TransferError>) -> RemoteError {
    match r {
        Err(TransferError::Remote(e)) => e,
        other => panic!("expected a remote error, got {other:?}"),
    }
}

fn config(vars: &[(&str, String)]) -> Result<KvtierConfig, kvtier::config::ConfigError> {
    let env: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    KvtierConfig::build(None, &env, None)
}

#[test]
fn keyed_directory_store_refuses_forged_frames() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let key_file = tmp.path().join("mac.key");
    std::fs::write(&key_file, SECRET)?;
    let dir = tmp.path().join("store");
    let c = config(&[
        ("KVTIER_HOST_NUM_BLOCKS", "4".into()),
        ("KVTIER_REMOTE_URL", format!("dir://{}", dir.display())),
        ("KVTIER_REMOTE_MAC_KEY_FILE", key_file.display().to_string()),
    ])?;
    let target = c.remote.as_ref().unwrap();
    let store = open(target, "mac")?;
    let good = block(1, 4096);
    store.put(SequenceHash(1), &good)?;
    let mut out = vec![0u8; 4096];
    store.get(SequenceHash(1), &mut out)?;
    assert_eq!(out, good);

    // A writer without the key recomputes the unkeyed tag over its own bytes: a miss.
    let path = dir
        .join(format!("kvtier-v{}", kvtier::hash::HASH_SCHEME_VERSION))
        .join("mac")
        .join("00")
        .join(format!("{:032x}", 1u128));
    assert!(path.is_file(), "{path:?}");
    std::fs::write(&path, encode_value("mac", 1, &block(2, 4096)))?;
    assert_eq!(
        remote_err(store.get(SequenceHash(1), &mut out)),
        RemoteError::Missing {
            key: SequenceHash(1)
        }
    );
    // The same forgery claiming the keyed flag: corrupt.
    let mut flagged = encode_value("mac", 1, &block(2, 4096));
    flagged[6] = 2; // FLAG_KEYED
    std::fs::write(&path, &flagged)?;
    assert!(matches!(
        remote_err(store.get(SequenceHash(1), &mut out)),
        RemoteError::Corrupt { .. }
    ));

    // Configuration errors name the problem.
    std::fs::write(&key_file, b"short\n")?;
    let e = open(target, "mac").err().unwrap().to_string();
    assert!(e.contains("mac.key") && e.contains("at least 16"), "{e}");
    let e = config(&[
        ("KVTIER_HOST_NUM_BLOCKS", "4".into()),
        ("KVTIER_REMOTE_MAC_KEY_FILE", "/x".into()),
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("remote.url"), "{e}");
    Ok(())
}

#[test]
fn keyed_redis_store_refuses_forged_frames() -> Result<()> {
    let Some(srv) = RedisServer::start() else {
        return Ok(());
    };
    let store = RedisStore::open(&srv.url(), "mac", Default::default())?.with_mac_key(SECRET)?;
    let good = block(3, 8192);
    store.put(SequenceHash(7), &good)?;
    let mut out = vec![0u8; 8192];
    store.get(SequenceHash(7), &mut out)?;
    assert_eq!(out, good);
    let mut raw = srv.raw()?;
    let name = format!("kvtier:v1:mac:{:032x}", 7u128);
    let _: () = redis::cmd("SET")
        .arg(&name)
        .arg(encode_value("mac", 7, &block(4, 8192)))
        .query(&mut raw)?;
    assert_eq!(
        remote_err(store.get(SequenceHash(7), &mut out)),
        RemoteError::Missing {
            key: SequenceHash(7)
        }
    );
    // Another cluster's key: corrupt, never bytes.
    let other = RedisStore::open(&srv.url(), "mac", Default::default())?
        .with_mac_key(b"another-cluster-secret-0123456789")?;
    other.put(SequenceHash(7), &block(5, 8192))?;
    assert!(matches!(
        remote_err(store.get(SequenceHash(7), &mut out)),
        RemoteError::Corrupt { .. }
    ));
    Ok(())
}
