//! Pools, one per tier: block ids, a content-addressed registry, reference-counted pins,
//! priority-aware LRU eviction, capacity accounting. Pure data structures: no I/O.
//!
//! API CONTRACT (implemented by the core work; the connector codes against it):
//! - `BlockPool::new(tier, capacity_blocks)`
//! - `peek_prefix(&self, &[SequenceHash]) -> usize`  side-effect free longest contiguous prefix
//! - `match_prefix(&mut self, &[SequenceHash]) -> Vec<BlockId>`  pins each matched block, touches LRU
//! - `allocate(&mut self, n) -> Result<Vec<BlockId>, PoolError>`  all-or-nothing, pinned, evicts
//!   unpinned registered blocks in (priority, last use) order
//! - `register(&mut self, block, hash, priority) -> BlockId`  publish a written block; if the hash is
//!   already registered the given block is freed and the existing one returned (pinned instead)
//! - `pin(&mut self, block)`, `release(&mut self, block)`  refcount +1 / -1
//! - `lookup(&self, hash) -> Option<BlockId>`, `hash_of(&self, block) -> Option<SequenceHash>`
//! - `capacity()`, `num_free()` (free + evictable), `num_registered()`, `take_events() -> Vec<PoolEvent>`
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    #[error("pool exhausted: {0}")]
    Exhausted(String),
}
