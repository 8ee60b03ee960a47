//! Fast, non-cryptographic hashing for the connector's in-memory maps (request ids, job ids,
//! device block ids, sequence hashes) on the per-step hot path, where SipHash's DoS resistance
//! buys nothing: every key comes from the engine or from kvtier itself. The hasher is
//! `rustc-hash`'s FxHasher.
//!
//! Invariant: equal keys hash equally within one process; nothing here is persisted or sent.
use std::collections::{HashMap, HashSet};

pub(crate) type FastBuild = rustc_hash::FxBuildHasher;
pub(crate) type FastMap<K, V> = HashMap<K, V, FastBuild>;
pub(crate) type FastSet<K> = HashSet<K, FastBuild>;
