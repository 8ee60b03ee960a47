//! The shared-directory backend of the remote store: bit-exact round trips, presence, misses,
//! damaged and truncated files, permissions, and concurrent writers of one key.
#![allow(clippy::unwrap_used)]
mod remote_support;

use kvtier::hash::SequenceHash;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Result;
use kvtier::transfer::{RemoteError, RemoteStore, TransferError};
use kvtier_io::storage::remote::{encode_value, from_url, DirOptions, DirStore, HEADER_LEN};
use remote_support::block;

const MIB2: usize = 2 << 20;

fn remote_err(r: Result<(), TransferError>) -> RemoteError {
    match r {
        Err(TransferError::Remote(e)) => e,
        other => panic!("expected a remote error, got {other:?}"),
    }
}

fn url(dir: &Path) -> String {
    format!("dir://{}", dir.display())
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[test]
fn round_trip_contains_missing_and_layout() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let store = from_url(&url(tmp.path()), "rt")?;
    let keys: Vec<u128> = (0..4).map(|i| (i as u128) << 120 | 0xabc).collect();
    for (i, &k) in keys.iter().enumerate() {
        store.put(SequenceHash(k), &block(i as u64, MIB2))?;
    }
    for (i, &k) in keys.iter().enumerate() {
        let mut out = vec![0u8; MIB2];
        store.get(SequenceHash(k), &mut out)?;
        assert!(out == block(i as u64, MIB2), "block {i} differs");
    }
    assert_eq!(
        store.contains(&[
            SequenceHash(keys[1]),
            SequenceHash(5),
            SequenceHash(keys[3])
        ])?,
        vec![true, false, true]
    );
    assert_eq!(store.contains(&[])?, Vec::<bool>::new());
    let mut out = vec![0u8; MIB2];
    assert_eq!(
        remote_err(store.get(SequenceHash(5), &mut out)),
        RemoteError::Missing {
            key: SequenceHash(5)
        }
    );

    // Documented layout and permissions; no temporary file is left behind.
    let hex = format!("{:032x}", keys[1]);
    let file = tmp.path().join("kvtier-v1/rt").join(&hex[..2]).join(&hex);
    assert_eq!(
        std::fs::read(&file)?,
        encode_value("rt", keys[1], &block(1, MIB2))
    );
    assert_eq!(mode(&file), 0o600);
    assert_eq!(mode(file.parent().unwrap()), 0o700);
    assert_eq!(mode(&tmp.path().join("kvtier-v1/rt")), 0o700);
    let leftovers: Vec<_> = std::fs::read_dir(file.parent().unwrap())?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // Namespaces are separate; a second store on the same directory sees the values.
    let other = from_url(&url(tmp.path()), "rt2")?;
    assert_eq!(other.contains(&[SequenceHash(keys[1])])?, vec![false]);
    let same = DirStore::open(tmp.path(), "rt", DirOptions { fsync: true })?;
    assert_eq!(same.contains(&[SequenceHash(keys[1])])?, vec![true]);
    same.put(SequenceHash(77), b"synced")?;
    let mut small = [0u8; 6];
    store.get(SequenceHash(77), &mut small)?;
    assert_eq!(&small, b"synced");
    Ok(())
}

#[test]
fn damaged_and_truncated_files_are_errors() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let store = DirStore::open(tmp.path(), "bad", DirOptions::default())?;
    let good = block(9, 5000);
    let mut out = vec![0u8; 5000];
    store.put(SequenceHash(1), &good)?;
    let path = store.path_of(1);

    // Garbage over the file.
    std::fs::write(&path, vec![0xa5u8; HEADER_LEN + 5000])?;
    assert!(matches!(
        remote_err(store.get(SequenceHash(1), &mut out)),
        RemoteError::Corrupt {
            key: SequenceHash(1),
            ..
        }
    ));

    // One flipped payload bit.
    let mut v = encode_value("bad", 1, &good);
    v[HEADER_LEN + 4321] ^= 1;
    std::fs::write(&path, &v)?;
    let e = remote_err(store.get(SequenceHash(1), &mut out));
    assert!(
        matches!(&e, RemoteError::Corrupt { reason, .. } if reason.contains("tag mismatch")),
        "{e:?}"
    );

    // Truncated in the payload and in the header.
    store.put(SequenceHash(1), &good)?;
    let f = std::fs::OpenOptions::new().write(true).open(&path)?;
    f.set_len((HEADER_LEN + 4000) as u64)?;
    assert_eq!(
        remote_err(store.get(SequenceHash(1), &mut out)),
        RemoteError::Short {
            key: SequenceHash(1),
            expected: HEADER_LEN + 5000,
            got: HEADER_LEN + 4000
        }
    );
    f.set_len(10)?;
    assert_eq!(
        remote_err(store.get(SequenceHash(1), &mut out)),
        RemoteError::Short {
            key: SequenceHash(1),
            expected: HEADER_LEN + 5000,
            got: 10
        }
    );
    f.set_len(0)?;
    assert!(matches!(
        remote_err(store.get(SequenceHash(1), &mut out)),
        RemoteError::Short { got: 0, .. }
    ));

    // Trailing bytes after a valid value.
    let mut long = encode_value("bad", 1, &good);
    long.extend_from_slice(b"junk");
    std::fs::write(&path, &long)?;
    assert!(matches!(
        remote_err(store.get(SequenceHash(1), &mut out)),
        RemoteError::Corrupt { .. }
    ));

    // A valid value of another key copied under this name.
    std::fs::write(&path, encode_value("bad", 2, &good))?;
    assert!(matches!(
        remote_err(store.get(SequenceHash(1), &mut out)),
        RemoteError::Corrupt {
            key: SequenceHash(1),
            ..
        }
    ));

    // Another block size.
    store.put(SequenceHash(3), &good[..100])?;
    assert_eq!(
        remote_err(store.get(SequenceHash(3), &mut out)),
        RemoteError::SizeMismatch {
            key: SequenceHash(3),
            expected: 5000,
            stored: 100
        }
    );

    // A put repairs the key.
    store.put(SequenceHash(1), &good)?;
    store.get(SequenceHash(1), &mut out)?;
    assert_eq!(out, good);
    Ok(())
}

#[test]
fn concurrent_writers_of_one_key_never_mix() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let store: Arc<dyn RemoteStore> = from_url(&url(tmp.path()), "race")?;
    const LEN: usize = 256 << 10;
    let a = Arc::new(block(1, LEN));
    let b = Arc::new(block(2, LEN));
    store.put(SequenceHash(42), &a)?;
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = [Arc::clone(&a), Arc::clone(&b)]
        .into_iter()
        .map(|data| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || -> Result<()> {
                for _ in 0..150 {
                    store.put(SequenceHash(42), &data)?;
                }
                Ok(())
            })
        })
        .collect();
    let reader = {
        let (store, a, b, stop) = (
            Arc::clone(&store),
            Arc::clone(&a),
            Arc::clone(&b),
            Arc::clone(&stop),
        );
        std::thread::spawn(move || -> Result<(usize, usize)> {
            let (mut seen_a, mut seen_b) = (0, 0);
            let mut out = vec![0u8; LEN];
            while !stop.load(Ordering::Relaxed) {
                store.get(SequenceHash(42), &mut out)?;
                if out == *a {
                    seen_a += 1;
                } else if out == *b {
                    seen_b += 1;
                } else {
                    anyhow::bail!("reader saw a value that is neither A nor B");
                }
            }
            Ok((seen_a, seen_b))
        })
    };
    for w in writers {
        w.join().expect("writer panicked")?;
    }
    stop.store(true, Ordering::Relaxed);
    let (seen_a, seen_b) = reader.join().expect("reader panicked")?;
    assert!(seen_a + seen_b > 0);
    let mut out = vec![0u8; LEN];
    store.get(SequenceHash(42), &mut out)?;
    assert!(out == *a || out == *b);
    // Every temporary file was renamed away.
    let hex = format!("{:032x}", 42u128);
    let dir = tmp.path().join("kvtier-v1/race").join(&hex[..2]);
    let names: Vec<String> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec![hex]);
    Ok(())
}

#[test]
fn unwritable_directory_is_an_error_not_a_panic() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let store = DirStore::open(tmp.path(), "ro", DirOptions::default())?;
    // A regular file where the key's fan-out directory must go.
    let path = store.path_of(0xff << 120);
    std::fs::write(path.parent().unwrap(), b"not a dir")?;
    assert!(matches!(
        remote_err(store.put(SequenceHash(0xff << 120), b"x")),
        RemoteError::Unavailable { op: "put", .. }
    ));
    let mut out = [0u8; 1];
    let e = remote_err(store.get(SequenceHash(0xff << 120), &mut out));
    assert!(
        matches!(
            e,
            RemoteError::Missing { .. } | RemoteError::Unavailable { .. }
        ),
        "{e:?}"
    );
    Ok(())
}
