//! Checksums of arena slots and other per-block work of a batch, in parallel: the node
//! re-hashes the slots of a `Finish` (outside the books' lock); the client's staged paths
//! (`staged.rs`) copy and hash each block of a slice; each hash only where the trust model asks
//! for it (docs/arch/node.md, Trust).
//!
//! Invariants: one result per item, in the items' order ([`slot_checksums`]: each
//! [`Arena::checksum`] of that slot, `protocol::block_checksum` of its bytes bound to its key);
//! at most [`MAX_THREADS`] threads, all joined before the call returns; a thread that cannot be
//! started leaves its share to the caller's thread, one that panicked fails its share (never a
//! panic).
use std::io;
use std::sync::OnceLock;

use crate::sys::shm::Arena;

/// Most threads one batch is hashed on.
pub(crate) const MAX_THREADS: usize = 16;

/// Below this many bytes in all, one thread hashes the batch (starting threads costs more).
const PARALLEL_FROM: usize = 4 << 20;

/// One slot to hash: `(key, offset, bytes)`.
pub(crate) type Slot = (u128, u64, usize);

/// The checksum of each slot, in order (see the module docs).
pub(crate) fn slot_checksums(arena: &Arena, slots: &[Slot]) -> Vec<io::Result<u64>> {
    let total: usize = slots.iter().map(|s| s.2).sum();
    par_map(slots, total, |&(key, offset, bytes)| {
        arena.checksum(key, offset, bytes)
    })
}

/// `f` of each item, in order: on up to [`MAX_THREADS`] threads when the items cover at least
/// [`PARALLEL_FROM`] bytes in all (`total`), else on the caller's thread. A share whose thread
/// panicked is an error for each of its items; a thread that cannot be started leaves its share
/// to the caller's thread.
pub(crate) fn par_map<T: Sync, R: Send>(
    items: &[T],
    total: usize,
    f: impl Fn(&T) -> io::Result<R> + Sync,
) -> Vec<io::Result<R>> {
    let threads = cores().min(items.len());
    if threads <= 1 || total < PARALLEL_FROM {
        return items.iter().map(&f).collect();
    }
    let per = items.len().div_ceil(threads);
    let f = &f;
    std::thread::scope(|s| {
        let mut parts = Vec::new();
        // The first share runs here, the others on their own threads.
        let mut chunks = items.chunks(per);
        let first = chunks.next().unwrap_or(&[]);
        for c in chunks {
            let h = std::thread::Builder::new()
                .name("kvtier-node-hash".into())
                .spawn_scoped(s, move || c.iter().map(f).collect::<Vec<_>>());
            parts.push((c, h));
        }
        let mut out: Vec<io::Result<R>> = first.iter().map(f).collect();
        for (c, h) in parts {
            match h {
                Ok(h) => match h.join() {
                    Ok(v) => out.extend(v),
                    Err(_) => out.extend(
                        c.iter()
                            .map(|_| Err(io::Error::other("a node worker thread panicked"))),
                    ),
                },
                Err(_) => out.extend(c.iter().map(f)),
            }
        }
        out
    })
}

/// Threads a batch may use: the cores this process may run on, at most [`MAX_THREADS`] (read
/// once: std reads the cgroup's quota files each time).
fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(MAX_THREADS)
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::storage::node::block_checksum;

    #[test]
    fn parallel_checksums_are_the_blocks_checksums_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let block = 1 << 20;
        let n = 12;
        let a = Arena::create(&dir.path().join("arena"), n * block, false).unwrap();
        let mut slots = Vec::new();
        let mut want = Vec::new();
        for i in 0..n {
            let data: Vec<u8> = (0..block).map(|b| (b * 7 + i * 13) as u8).collect();
            a.write((i * block) as u64, &data).unwrap();
            // Reversed order and keys that differ from the offsets: results follow the slots.
            let key = 1000 + i as u128;
            slots.push((key, (i * block) as u64, block));
            want.push(block_checksum(key, &data));
        }
        slots.reverse();
        want.reverse();
        // A slot outside the arena is an error in its place, not a panic.
        slots.insert(3, (1, (n * block) as u64, block));
        let got = slot_checksums(&a, &slots);
        assert_eq!(got.len(), slots.len());
        assert!(got[3].is_err());
        let ok: Vec<u64> = got
            .into_iter()
            .enumerate()
            .filter(|(i, _)| *i != 3)
            .map(|(_, r)| r.unwrap())
            .collect();
        assert_eq!(ok, want);
        assert!(slot_checksums(&a, &[]).is_empty());
    }
}
