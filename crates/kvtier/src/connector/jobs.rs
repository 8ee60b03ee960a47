//! The leader's jobs in flight, by id: a slab whose ids carry a generation.
//!
//! Invariants: an id names at most one live job; a job's id is never handed out again while it
//! is live, and after it completes its entry's next id differs (the generation, in the id's high
//! 32 bits, moves on), so a late or duplicate report for a finished job finds nothing instead of
//! reaching a later job that reuses the entry. Lookups index a vector: no hashing.
use crate::ids::JobId;

#[derive(Debug)]
struct Entry<T> {
    generation: u32,
    job: Option<T>,
}

#[derive(Debug)]
pub(crate) struct JobTable<T> {
    entries: Vec<Entry<T>>,
    /// Entries with no job and no claimed id, reused most recent first.
    free: Vec<u32>,
    live: usize,
}

impl<T> Default for JobTable<T> {
    fn default() -> Self {
        JobTable {
            entries: Vec::new(),
            free: Vec::new(),
            live: 0,
        }
    }
}

fn split(id: JobId) -> (usize, u32) {
    ((id.0 & 0xFFFF_FFFF) as usize, (id.0 >> 32) as u32)
}

impl<T> JobTable<T> {
    /// Claim the id of a new job; `insert` must follow with the job itself.
    pub(crate) fn claim(&mut self) -> JobId {
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                self.entries.push(Entry {
                    generation: 0,
                    job: None,
                });
                (self.entries.len() - 1) as u32
            }
        };
        let e = &mut self.entries[index as usize];
        // Generation 0 is never handed out, so JobId(0..2^32) never names a job.
        e.generation = e.generation.wrapping_add(1).max(1);
        JobId(((e.generation as u64) << 32) | index as u64)
    }

    /// Store the job of a claimed id.
    pub(crate) fn insert(&mut self, id: JobId, job: T) {
        let (i, generation) = split(id);
        if let Some(e) = self.entries.get_mut(i) {
            if e.generation == generation && e.job.is_none() {
                e.job = Some(job);
                self.live += 1;
                return;
            }
        }
        debug_assert!(false, "job {id:?} was not claimed");
    }

    pub(crate) fn get_mut(&mut self, id: JobId) -> Option<&mut T> {
        let (i, generation) = split(id);
        self.entries
            .get_mut(i)
            .filter(|e| e.generation == generation)
            .and_then(|e| e.job.as_mut())
    }

    /// Take a job out; its entry is free for a later job (under a new id).
    pub(crate) fn remove(&mut self, id: JobId) -> Option<T> {
        let (i, generation) = split(id);
        let e = self
            .entries
            .get_mut(i)
            .filter(|e| e.generation == generation)?;
        let job = e.job.take()?;
        self.live -= 1;
        self.free.push(i as u32);
        Some(job)
    }

    /// Jobs in flight.
    pub(crate) fn len(&self) -> usize {
        self.live
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_never_reused_for_a_later_job() {
        let mut t: JobTable<&str> = JobTable::default();
        let a = t.claim();
        t.insert(a, "a");
        let b = t.claim();
        t.insert(b, "b");
        assert_ne!(a, b);
        assert_eq!(t.len(), 2);
        assert_eq!(t.remove(a), Some("a"));
        assert_eq!(
            t.remove(a),
            None,
            "a second report of a finished job finds nothing"
        );
        let c = t.claim();
        t.insert(c, "c");
        assert_ne!(c, a, "the entry is reused under a new id");
        assert_eq!(t.get_mut(a), None);
        assert_eq!(t.get_mut(c).copied(), Some("c"));
        assert_eq!(t.get_mut(JobId(0)), None);
        assert_eq!(t.get_mut(JobId(u64::MAX)), None);
        assert_eq!(t.len(), 2);
    }
}
