//! Priority-aware LRU order of the evictable blocks of one pool.
//!
//! One intrusive doubly-linked list per priority (the links live in the blocks' [`Slot`]s), plus
//! a small sorted vector of (priority, list ends) for the non-empty lists. Blocks are appended
//! when they become evictable (their last pin is released), so within one list the order is the
//! order of last use; the victim is the head of the lowest priority's list, i.e. the minimum of
//! (priority, last use).
//!
//! Invariants: a block is in at most one list; `lists` is sorted by priority and holds exactly
//! the non-empty lists; `len` is the number of linked blocks.
use super::slot::{Slot, NIL};
use super::Priority;

#[derive(Clone, Copy, Debug)]
struct Ends {
    head: u32,
    tail: u32,
}

#[derive(Debug, Default)]
pub(crate) struct PriorityLru {
    lists: Vec<(Priority, Ends)>,
    len: usize,
}

impl PriorityLru {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.lists.capacity() * std::mem::size_of::<(Priority, Ends)>()
    }

    #[inline]
    fn find(&self, p: Priority) -> Result<usize, usize> {
        // Few distinct priorities: a linear scan of a short sorted vector beats a tree.
        for (i, (q, _)) in self.lists.iter().enumerate() {
            if *q == p {
                return Ok(i);
            }
            if *q > p {
                return Err(i);
            }
        }
        Err(self.lists.len())
    }

    /// Append `block` as the most recently used block of its priority.
    pub(crate) fn push_back(&mut self, slots: &mut [Slot], block: u32) {
        let b = block as usize;
        let priority = slots[b].priority;
        match self.find(priority) {
            Ok(i) => {
                let ends = &mut self.lists[i].1;
                let old_tail = ends.tail;
                ends.tail = block;
                slots[b].prev = old_tail;
                slots[b].next = NIL;
                slots[old_tail as usize].next = block;
            }
            Err(i) => {
                self.lists.insert(
                    i,
                    (
                        priority,
                        Ends {
                            head: block,
                            tail: block,
                        },
                    ),
                );
                slots[b].prev = NIL;
                slots[b].next = NIL;
            }
        }
        self.len += 1;
    }

    /// Unlink `block`, which must be linked (in the list of its current priority).
    pub(crate) fn remove(&mut self, slots: &mut [Slot], block: u32) {
        let b = block as usize;
        let (prev, next, priority) = (slots[b].prev, slots[b].next, slots[b].priority);
        let Ok(i) = self.find(priority) else {
            debug_assert!(false, "block {block} not in list {priority:?}");
            return;
        };
        let ends = &mut self.lists[i].1;
        if prev == NIL {
            ends.head = next;
        } else {
            slots[prev as usize].next = next;
        }
        if next == NIL {
            ends.tail = prev;
        } else {
            slots[next as usize].prev = prev;
        }
        if ends.head == NIL {
            self.lists.remove(i);
        }
        slots[b].prev = NIL;
        slots[b].next = NIL;
        self.len -= 1;
    }

    /// Remove and return the next victim: least recently used block of the lowest priority.
    pub(crate) fn pop_victim(&mut self, slots: &mut [Slot]) -> Option<u32> {
        let block = self.lists.first()?.1.head;
        self.remove(slots, block);
        Some(block)
    }

    /// Every linked block in eviction order (first = next victim). For tests and inspection.
    pub(crate) fn eviction_order(&self, slots: &[Slot]) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len);
        for (_, ends) in &self.lists {
            let mut b = ends.head;
            while b != NIL {
                out.push(b);
                b = slots[b as usize].next;
            }
        }
        out
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn slots(prios: &[u32]) -> Vec<Slot> {
        prios
            .iter()
            .map(|p| {
                let mut s = Slot::FREE;
                s.priority = Priority(*p);
                s
            })
            .collect()
    }

    #[test]
    fn victims_by_priority_then_age() {
        let mut s = slots(&[5, 1, 5, 1, 9, 9]);
        let mut l = PriorityLru::default();
        for b in 0..5 {
            l.push_back(&mut s, b);
        }
        assert_eq!(l.eviction_order(&s), vec![1, 3, 0, 2, 4]);
        l.remove(&mut s, 3);
        l.remove(&mut s, 0);
        assert_eq!(l.eviction_order(&s), vec![1, 2, 4]);
        assert_eq!(l.pop_victim(&mut s), Some(1));
        assert_eq!(l.pop_victim(&mut s), Some(2));
        l.push_back(&mut s, 5);
        assert_eq!(l.pop_victim(&mut s), Some(4));
        assert_eq!(l.pop_victim(&mut s), Some(5));
        assert_eq!(l.pop_victim(&mut s), None);
        assert_eq!(l.len(), 0);
    }
}
