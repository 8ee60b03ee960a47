//! Byte-range allocation of the node's arena: the free space is a set of extents, so a range
//! freed by blocks of one size is reusable by blocks of any other (two models with different
//! block sizes share the capacity).
//!
//! Invariants (checked by the tests and the books' property test): free extents never overlap,
//! never touch (neighbours are merged on free) and never exceed the arena; a range handed out is
//! not free until given back; `take` is best fit (the smallest extent that holds the request).
use std::collections::{BTreeMap, BTreeSet};

/// The free extents of an arena (see the module docs).
#[derive(Debug)]
pub(super) struct Extents {
    /// offset -> length.
    by_offset: BTreeMap<u64, u64>,
    /// (length, offset), for best fit.
    by_len: BTreeSet<(u64, u64)>,
}

impl Extents {
    /// All of `capacity` bytes free.
    pub(super) fn new(capacity: u64) -> Self {
        let mut e = Extents {
            by_offset: BTreeMap::new(),
            by_len: BTreeSet::new(),
        };
        if capacity > 0 {
            e.insert(0, capacity);
        }
        e
    }

    fn insert(&mut self, off: u64, len: u64) {
        self.by_offset.insert(off, len);
        self.by_len.insert((len, off));
    }

    fn remove(&mut self, off: u64, len: u64) {
        self.by_offset.remove(&off);
        self.by_len.remove(&(len, off));
    }

    /// A range of `len` bytes (its offset), from the smallest free extent that holds it.
    pub(super) fn take(&mut self, len: u64) -> Option<u64> {
        if len == 0 {
            return None;
        }
        let &(have, off) = self.by_len.range((len, 0)..).next()?;
        self.remove(off, have);
        if have > len {
            self.insert(off + len, have - len);
        }
        Some(off)
    }

    /// Give `off..off + len` back, merged with free neighbours.
    pub(super) fn give(&mut self, off: u64, len: u64) {
        if len == 0 {
            return;
        }
        let (mut start, mut end) = (off, off + len);
        if let Some((&p, &pl)) = self.by_offset.range(..off).next_back() {
            if p + pl == off {
                self.remove(p, pl);
                start = p;
            }
        }
        if let Some(&nl) = self.by_offset.get(&end) {
            self.remove(end, nl);
            end += nl;
        }
        self.insert(start, end - start);
    }

    /// The free extents, in offset order (tests, `Books::check`).
    #[cfg(any(test, feature = "testing"))]
    pub(super) fn extents(&self) -> Vec<(u64, u64)> {
        self.by_offset.iter().map(|(o, l)| (*o, *l)).collect()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn ranges_freed_by_one_size_serve_another_and_neighbours_merge() {
        let mut e = Extents::new(40);
        let a: Vec<u64> = (0..4).map(|_| e.take(10).unwrap()).collect();
        assert_eq!(a, vec![0, 10, 20, 30]);
        assert_eq!(e.take(1), None);
        e.give(10, 10);
        e.give(30, 10);
        assert_eq!(e.take(20), None, "two free 10s apart are not 20");
        e.give(20, 10);
        assert_eq!(e.extents(), vec![(10, 30)]);
        assert_eq!(e.take(20), Some(10));
        assert_eq!(e.take(5), Some(30), "best fit");
        assert_eq!(e.extents(), vec![(35, 5)]);
    }
}
