//! The books' self-check ([`Books::check`]): every invariant of `books.rs` tested over the whole
//! state at once, for the tests and the `node_books` fuzz target. Reads only; linear in the
//! books' size.
use foldhash::{HashMap, HashMapExt};

use super::{Books, NsId, GRANT_SHARE, MAX_GRANTS};

impl Books {
    /// Checks the books against the module invariants, as a whole: every byte of the arena is
    /// free, a block's or a reservation's, exactly once; the index, the LRU, the per-namespace
    /// byte counts, the leases and the counters agree with the blocks; no namespace is held
    /// unused and at most `max_namespaces` are. For tests and the `node_books` fuzz target
    /// (linear in the books' size). Feature `testing`.
    pub fn check(&self) -> Result<(), String> {
        let mut ranges: Vec<(u64, u64, &str)> = self
            .space
            .extents()
            .into_iter()
            .map(|(o, l)| (o, l, "free"))
            .collect();
        ranges.extend(self.blocks.values().map(|b| (b.offset, b.bytes, "block")));
        ranges.extend(
            self.reservations
                .values()
                .map(|r| (r.offset, r.bytes, "reservation")),
        );
        ranges.sort_unstable();
        let mut at = 0u64;
        for (o, l, what) in &ranges {
            if *o != at || *l == 0 {
                return Err(format!(
                    "{what} {o}+{l} where byte {at} was expected (overlap or hole)"
                ));
            }
            at = o.checked_add(*l).ok_or("range overflows")?;
        }
        if at != self.capacity {
            return Err(format!(
                "ranges end at {at}, the arena at {}",
                self.capacity
            ));
        }
        let mut ns_bytes: HashMap<NsId, u64> = HashMap::new();
        let mut leases: HashMap<u64, u32> = HashMap::new();
        for c in self.clients.values() {
            if !self.namespaces.contains_key(&c.ns) {
                return Err("a client's namespace is forgotten".into());
            }
            for (l, n) in &c.leases {
                *leases.entry(*l).or_default() += n;
            }
            let mut grants = 0u32;
            for r in &c.reservations {
                match self.reservations.get(r) {
                    None => return Err(format!("client lists reservation {r} the books lack")),
                    Some(res) => grants += u32::from(res.key.is_none()),
                }
            }
            if grants != c.grants || grants > MAX_GRANTS {
                return Err(format!(
                    "a client counts {} grants, holds {grants} (at most {MAX_GRANTS})",
                    c.grants
                ));
            }
        }
        let mut granted = 0u64;
        for (id, r) in &self.reservations {
            let listed = self
                .clients
                .get(&r.client)
                .is_some_and(|c| c.reservations.contains(id));
            let writing = r.key.map(|k| self.writing.get(&(r.ns, k)) == Some(id));
            if !listed || writing == Some(false) {
                return Err(format!(
                    "reservation {id}: listed {listed}, writing {writing:?}"
                ));
            }
            if r.key.is_none() {
                granted += r.bytes;
            }
        }
        if self.writing.len()
            + self
                .reservations
                .values()
                .filter(|r| r.key.is_none())
                .count()
            != self.reservations.len()
        {
            return Err("the keys being written and the named reservations differ".into());
        }
        if granted != self.stats.bytes_granted || granted > self.capacity / GRANT_SHARE {
            return Err(format!(
                "grants hold {granted} bytes, counted {} (at most {})",
                self.stats.bytes_granted,
                self.capacity / GRANT_SHARE
            ));
        }
        for (id, b) in &self.blocks {
            *ns_bytes.entry(b.ns).or_default() += b.bytes;
            if leases.get(id).copied().unwrap_or(0) != b.leases {
                return Err(format!(
                    "block {id} counts {} leases, its clients {:?}",
                    b.leases,
                    leases.get(id)
                ));
            }
            let indexed = self.index.get(&(b.ns, b.key)) == Some(id);
            let in_lru = self.lru.contains_key(&(b.tick, *id));
            if b.dead == indexed || b.dead == in_lru {
                return Err(format!(
                    "block {id}: dead {}, indexed {indexed}, in LRU {in_lru}",
                    b.dead
                ));
            }
            if b.dead && b.leases == 0 {
                return Err(format!("dead block {id} with no lease is not freed"));
            }
        }
        if self.index.len() + self.blocks.values().filter(|b| b.dead).count() != self.blocks.len()
            || self.lru.len() != self.index.len()
        {
            return Err("index or LRU names blocks that are not live".into());
        }
        for (ns, n) in &self.namespaces {
            let held = ns_bytes.get(ns).copied().unwrap_or(0);
            if self.ns_bytes.get(ns).copied().unwrap_or(0) != held {
                return Err(format!(
                    "namespace {} counts {:?} bytes, holds {held}",
                    n.name,
                    self.ns_bytes.get(ns)
                ));
            }
            let clients = self.clients.values().filter(|c| c.ns == *ns).count() as u32;
            if n.clients != clients || (clients == 0 && held == 0) {
                return Err(format!(
                    "namespace {}: {} clients counted, {clients} attached, {held} bytes",
                    n.name, n.clients
                ));
            }
        }
        if self.namespaces.len() > self.max_namespaces {
            return Err("more namespaces than allowed".into());
        }
        let used: u64 = self.blocks.values().map(|b| b.bytes).sum();
        if self.stats.bytes_used != used || self.stats.blocks != self.blocks.len() as u64 {
            return Err(format!(
                "counters say {} bytes in {} blocks, the books {used} in {}",
                self.stats.bytes_used,
                self.stats.blocks,
                self.blocks.len()
            ));
        }
        Ok(())
    }
}
