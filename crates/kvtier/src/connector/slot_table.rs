//! The leader's slots by request id: a slab of entries, an id -> entry index, and, per record
//! position, the entry that position named in the last step. Engines list their running
//! requests in a stable order step after step, so most records find their slot with one id
//! comparison instead of a hash lookup.
//!
//! Invariants: `index[id] == i` exactly when `entries[i]` holds `id`'s value; a position hint is
//! only a guess, used after the entry's id compared equal to the record's.
use crate::connector::fasthash::FastMap;
use crate::ids::RequestId;

#[derive(Debug)]
pub(crate) struct SlotTable<V> {
    entries: Vec<Option<(RequestId, V)>>,
    index: FastMap<RequestId, u32>,
    /// Entries without a value, reused most recent first.
    free: Vec<u32>,
    /// The entry that record position `k` named last.
    hints: Vec<u32>,
}

impl<V> Default for SlotTable<V> {
    fn default() -> Self {
        SlotTable {
            entries: Vec::new(),
            index: FastMap::default(),
            free: Vec::new(),
            hints: Vec::new(),
        }
    }
}

impl<V> SlotTable<V> {
    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    pub(crate) fn contains_key(&self, id: &RequestId) -> bool {
        self.index.contains_key(id)
    }

    pub(crate) fn get(&self, id: &RequestId) -> Option<&V> {
        let i = *self.index.get(id)?;
        self.entries[i as usize].as_ref().map(|(_, v)| v)
    }

    pub(crate) fn get_mut(&mut self, id: &RequestId) -> Option<&mut V> {
        let i = *self.index.get(id)?;
        self.entries[i as usize].as_mut().map(|(_, v)| v)
    }

    /// [`SlotTable::get_mut`] for the record at position `pos` of a step: tries the entry that
    /// position named last time first.
    pub(crate) fn get_mut_at(&mut self, pos: usize, id: &RequestId) -> Option<&mut V> {
        let hinted =
            self.hints
                .get(pos)
                .copied()
                .and_then(|i| match self.entries.get(i as usize) {
                    Some(Some((key, _))) if key == id => Some(i),
                    _ => None,
                });
        let i = match hinted {
            Some(i) => i,
            None => {
                let i = *self.index.get(id)?;
                self.hint(pos, i);
                i
            }
        };
        self.entries[i as usize].as_mut().map(|(_, v)| v)
    }

    fn hint(&mut self, pos: usize, i: u32) {
        if pos >= self.hints.len() {
            self.hints.resize(pos + 1, u32::MAX);
        }
        self.hints[pos] = i;
    }

    /// Insert (or replace) `id`'s value; `pos`: the record position that created it, if any.
    pub(crate) fn insert(&mut self, id: RequestId, value: V, pos: Option<usize>) -> &mut V {
        let i = match self.index.get(&id) {
            Some(&i) => i,
            None => {
                let i = match self.free.pop() {
                    Some(i) => i,
                    None => {
                        self.entries.push(None);
                        (self.entries.len() - 1) as u32
                    }
                };
                self.index.insert(id.clone(), i);
                i
            }
        };
        if let Some(pos) = pos {
            self.hint(pos, i);
        }
        let (_, v) = self.entries[i as usize].insert((id, value));
        v
    }

    pub(crate) fn remove(&mut self, id: &RequestId) -> Option<V> {
        let i = self.index.remove(id)?;
        self.free.push(i);
        self.entries[i as usize].take().map(|(_, v)| v)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn hints_never_return_another_requests_value() {
        let mut t: SlotTable<u32> = SlotTable::default();
        let (a, b, c) = (
            RequestId::from("a"),
            RequestId::from("b"),
            RequestId::from("c"),
        );
        t.insert(a.clone(), 1, Some(0));
        t.insert(b.clone(), 2, Some(1));
        assert_eq!(t.get_mut_at(0, &a).copied(), Some(1));
        assert_eq!(t.get_mut_at(1, &b).copied(), Some(2));
        // Order changes: position 0 now names b (the hint for 0 points at a's entry).
        assert_eq!(t.get_mut_at(0, &b).copied(), Some(2));
        // a leaves; c reuses its entry: a's stale hints must not find c, nor c's find a.
        assert_eq!(t.remove(&a), Some(1));
        assert_eq!(t.get_mut_at(5, &a), None);
        t.insert(c.clone(), 3, None);
        assert_eq!(t.get(&a), None);
        assert_eq!(t.get_mut_at(1, &a), None);
        assert_eq!(t.get_mut_at(1, &c).copied(), Some(3));
        assert_eq!(t.len(), 2);
        // Replacing keeps one entry.
        t.insert(c.clone(), 4, Some(0));
        assert_eq!(t.len(), 2);
        assert_eq!(t.get(&c).copied(), Some(4));
    }

    #[test]
    fn long_ids_are_compared_in_full() {
        // 39 bytes (vLLM-like, on the heap) and 60 bytes, differing in the last byte.
        for n in [39usize, 60] {
            let id = |last: char| RequestId::from(format!("{}{last}", "x".repeat(n - 1)));
            let mut t: SlotTable<u32> = SlotTable::default();
            t.insert(id('a'), 1, Some(0));
            assert_eq!(t.get_mut_at(0, &id('a')).copied(), Some(1));
            assert_eq!(t.get_mut_at(0, &id('b')), None, "len {n}");
            t.insert(id('b'), 2, Some(1));
            assert_eq!(t.get_mut_at(0, &id('b')).copied(), Some(2), "len {n}");
            assert_eq!(t.get_mut_at(0, &id('a')).copied(), Some(1), "len {n}");
        }
    }
}
