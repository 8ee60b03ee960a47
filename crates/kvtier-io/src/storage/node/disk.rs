//! The node's own disk tier (G3 behind the arena): blocks evicted from the arena are written to
//! a locked, journaled file set of the disk tier (`crate::storage::disk`, set `node-<block bytes>` under
//! `<dir>/kvtier-g3/`), and a lookup or read that misses the arena is served from it (the node
//! promotes the block into an arena slot, then leases it as usual). The set is kept across
//! restarts (`persist`): a node started again on the same directory serves what its journal
//! kept, each block verified by the disk tier on read.
//!
//! Definitions: a block's *disk key* is `xxh3_128(namespace, key)`, so namespaces stay apart on
//! disk as in the arena; the disk holds blocks of one size (the set's), the first size spilled
//! (or the one a restart found); blocks of another size are not spilled.
//!
//! Invariants: a block is written to disk only after its arena bytes verified against the
//! checksum its writer committed; a disk read that fails (torn, truncated, another key's bytes)
//! forgets the block and is a miss, never bytes; when the disk is full the least recently
//! spilled or read block's slot is reused. Not thread-safe by itself: the node's books lock
//! guards it.
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use crate::error::IoError;
use crate::storage::disk::{DiskOptions, DiskStorage, SUBDIR};

/// The node's disk tier (see the module docs).
#[derive(Debug)]
pub(crate) struct NodeDisk {
    dir: PathBuf,
    bytes: u64,
    store: Option<DiskStorage>,
    index: HashMap<u128, u32>,
    /// Per slot: its disk key and last use tick (None = free).
    slots: Vec<Option<(u128, u64)>>,
    lru: BTreeMap<u64, u32>,
    free: Vec<u32>,
    tick: u64,
    pub(crate) spilled: u64,
    pub(crate) hits: u64,
}

/// The disk key of `key` in namespace `ns`.
pub(crate) fn disk_key(ns: &str, key: u128) -> u128 {
    let mut b = Vec::with_capacity(ns.len() + 17);
    b.extend_from_slice(ns.as_bytes());
    b.push(0);
    b.extend_from_slice(&key.to_le_bytes());
    xxhash_rust::xxh3::xxh3_128(&b)
}

/// Block sizes of the node file sets in `dir` (`node-<bytes>.index`).
fn existing_sets(dir: &Path) -> Vec<usize> {
    let Ok(rd) = std::fs::read_dir(dir.join(SUBDIR)) else {
        return Vec::new();
    };
    let mut v: Vec<usize> = rd
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.strip_prefix("node-")?
                .strip_suffix(".index")?
                .parse()
                .ok()
        })
        .collect();
    v.sort_unstable();
    v
}

impl NodeDisk {
    /// The disk tier of `bytes` under `dir`; re-opens a file set a previous node left there.
    pub(crate) fn open(dir: &Path, bytes: u64) -> Result<NodeDisk, IoError> {
        let mut d = NodeDisk {
            dir: dir.to_owned(),
            bytes,
            store: None,
            index: HashMap::new(),
            slots: Vec::new(),
            lru: BTreeMap::new(),
            free: Vec::new(),
            tick: 0,
            spilled: 0,
            hits: 0,
        };
        if let Some(&block) = existing_sets(dir).first() {
            d.create(block)?;
        }
        Ok(d)
    }

    fn create(&mut self, block: usize) -> Result<(), IoError> {
        let n = u32::try_from(self.bytes / block.max(1) as u64).unwrap_or(u32::MAX);
        if n == 0 {
            return Err(IoError::Config(format!(
                "node disk of {} bytes holds no block of {block} bytes",
                self.bytes
            )));
        }
        let mut o = DiskOptions::new(self.dir.clone(), n, block);
        o.name = format!("node-{block}");
        o.persist = true;
        let store = DiskStorage::create(&o)?;
        self.slots = vec![None; n as usize];
        for &(h, slot) in store.recovered() {
            if let Some(s) = self.slots.get_mut(slot.0 as usize) {
                self.tick += 1;
                *s = Some((h.0, self.tick));
                self.index.insert(h.0, slot.0);
                self.lru.insert(self.tick, slot.0);
            }
        }
        self.free = (0..n)
            .rev()
            .filter(|s| self.slots[*s as usize].is_none())
            .collect();
        if !self.index.is_empty() {
            tracing::info!(blocks = self.index.len(), dir = %self.dir.display(), "kvtier node: disk tier warm restart");
        }
        self.store = Some(store);
        Ok(())
    }

    /// Blocks held.
    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether `dkey` is held (of `bytes`, when given).
    pub(crate) fn contains(&self, dkey: u128, bytes: Option<u64>) -> bool {
        self.index.contains_key(&dkey)
            && self
                .store
                .as_ref()
                .is_some_and(|s| bytes.is_none_or(|b| s.block_bytes() as u64 == b))
    }

    /// The size of `dkey`'s block, when held.
    pub(crate) fn block_bytes_of(&self, dkey: u128) -> Option<usize> {
        let s = self.store.as_ref()?;
        self.index.contains_key(&dkey).then(|| s.block_bytes())
    }

    fn touch(&mut self, slot: u32, dkey: u128) {
        if let Some(Some((_, t))) = self.slots.get(slot as usize) {
            self.lru.remove(t);
        }
        self.tick += 1;
        self.slots[slot as usize] = Some((dkey, self.tick));
        self.lru.insert(self.tick, slot);
    }

    fn forget(&mut self, dkey: u128) {
        if let Some(slot) = self.index.remove(&dkey) {
            if let Some(Some((_, t))) = self.slots.get(slot as usize).copied() {
                self.lru.remove(&t);
            }
            self.slots[slot as usize] = None;
            self.free.push(slot);
        }
    }

    /// Write a verified block evicted from the arena.
    pub(crate) fn spill(&mut self, dkey: u128, data: &[u8]) {
        if self.store.is_none() {
            if let Err(e) = self.create(data.len()) {
                tracing::warn!("kvtier node: no disk tier ({e})");
                self.bytes = 0;
                return;
            }
        }
        let Some(store) = &self.store else { return };
        if store.block_bytes() != data.len() || self.index.contains_key(&dkey) {
            return;
        }
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let Some((_, s)) = self.lru.pop_first() else {
                    return;
                };
                if let Some(Some((old, _))) = self.slots.get(s as usize).copied() {
                    self.index.remove(&old);
                }
                self.slots[s as usize] = None;
                s
            }
        };
        match store.write_block_keyed(slot, dkey, data) {
            Ok(()) => {
                self.index.insert(dkey, slot);
                self.touch(slot, dkey);
                self.spilled += 1;
            }
            Err(e) => {
                kvtier::warn_limited!(error = %e, "kvtier node: spilling a block to disk failed");
                self.free.push(slot);
            }
        }
    }

    /// Read `dkey`'s block into `out` (verified by the disk tier); a failure forgets it.
    pub(crate) fn read(&mut self, dkey: u128, out: &mut [u8]) -> bool {
        let (Some(store), Some(&slot)) = (&self.store, self.index.get(&dkey)) else {
            return false;
        };
        match store.read_block_keyed(slot, dkey, out) {
            Ok(()) => {
                self.touch(slot, dkey);
                self.hits += 1;
                true
            }
            Err(e) => {
                kvtier::warn_limited!(error = %e, "kvtier node: a disk block failed its check; dropped");
                self.forget(dkey);
                false
            }
        }
    }

    /// Make every spilled block durable and journaled (shutdown).
    pub(crate) fn sync(&self) {
        if let Some(s) = &self.store {
            if let Err(e) = s.sync() {
                tracing::warn!("kvtier node: syncing the disk tier: {e}");
            }
        }
    }
}
