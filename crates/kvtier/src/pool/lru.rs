//! Priority-aware LRU order of the evictable blocks of one pool.
//!
//! One intrusive doubly-linked list per priority (links live in a per-block array, 8 bytes per
//! block), plus an ordered map from priority to the ends of its non-empty list. Blocks are
//! appended when they become evictable (their last pin is released), so within one list the
//! order is the order of last use; the victim is the head of the lowest priority's list, i.e.
//! the minimum of (priority, last use).
//!
//! Invariants: a block is in at most one list; `lists` holds exactly the non-empty lists;
//! `len` is the number of linked blocks.
use std::collections::BTreeMap;

use super::Priority;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Link {
    prev: u32,
    next: u32,
}

#[derive(Clone, Copy, Debug)]
struct Ends {
    head: u32,
    tail: u32,
}

#[derive(Debug)]
pub(crate) struct PriorityLru {
    links: Vec<Link>,
    lists: BTreeMap<Priority, Ends>,
    len: usize,
}

impl PriorityLru {
    pub(crate) fn new(capacity: usize) -> Self {
        PriorityLru {
            links: vec![
                Link {
                    prev: NIL,
                    next: NIL
                };
                capacity
            ],
            lists: BTreeMap::new(),
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.links.capacity() * std::mem::size_of::<Link>()
            + self.lists.len() * (std::mem::size_of::<(Priority, Ends)>() + 8)
    }

    /// Append `block` as the most recently used block of `priority`.
    pub(crate) fn push_back(&mut self, block: u32, priority: Priority) {
        let b = block as usize;
        match self.lists.get_mut(&priority) {
            Some(ends) => {
                let old_tail = ends.tail;
                ends.tail = block;
                self.links[b] = Link {
                    prev: old_tail,
                    next: NIL,
                };
                self.links[old_tail as usize].next = block;
            }
            None => {
                self.lists.insert(
                    priority,
                    Ends {
                        head: block,
                        tail: block,
                    },
                );
                self.links[b] = Link {
                    prev: NIL,
                    next: NIL,
                };
            }
        }
        self.len += 1;
    }

    /// Unlink `block`, which must be in the list of `priority`.
    pub(crate) fn remove(&mut self, block: u32, priority: Priority) {
        let Link { prev, next } = self.links[block as usize];
        let Some(ends) = self.lists.get_mut(&priority) else {
            debug_assert!(false, "block {block} not in list {priority:?}");
            return;
        };
        if prev == NIL {
            ends.head = next;
        } else {
            self.links[prev as usize].next = next;
        }
        if next == NIL {
            ends.tail = prev;
        } else {
            self.links[next as usize].prev = prev;
        }
        if ends.head == NIL {
            self.lists.remove(&priority);
        }
        self.links[block as usize] = Link {
            prev: NIL,
            next: NIL,
        };
        self.len -= 1;
    }

    /// The next victim: least recently used block of the lowest priority.
    pub(crate) fn peek_victim(&self) -> Option<(u32, Priority)> {
        self.lists.iter().next().map(|(&p, ends)| (ends.head, p))
    }

    /// Remove and return the next victim.
    pub(crate) fn pop_victim(&mut self) -> Option<u32> {
        let (block, priority) = self.peek_victim()?;
        self.remove(block, priority);
        Some(block)
    }

    /// Every linked block in eviction order (first = next victim). For tests and inspection.
    pub(crate) fn eviction_order(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len);
        for ends in self.lists.values() {
            let mut b = ends.head;
            while b != NIL {
                out.push(b);
                b = self.links[b as usize].next;
            }
        }
        out
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn victims_by_priority_then_age() {
        let mut l = PriorityLru::new(8);
        l.push_back(0, Priority(5));
        l.push_back(1, Priority(1));
        l.push_back(2, Priority(5));
        l.push_back(3, Priority(1));
        l.push_back(4, Priority(9));
        assert_eq!(l.eviction_order(), vec![1, 3, 0, 2, 4]);
        l.remove(3, Priority(1));
        l.remove(0, Priority(5));
        assert_eq!(l.eviction_order(), vec![1, 2, 4]);
        assert_eq!(l.pop_victim(), Some(1));
        assert_eq!(l.pop_victim(), Some(2));
        l.push_back(0, Priority(9));
        assert_eq!(l.pop_victim(), Some(4));
        assert_eq!(l.pop_victim(), Some(0));
        assert_eq!(l.pop_victim(), None);
        assert_eq!(l.len(), 0);
    }
}
