//! A request's device block table (the slot's): block ids in request order with a membership
//! index, and holes for positions the engine holds no block for.
//!
//! Invariant: a hole ([`HOLE`]) is never recognised as a known id and never counts as a
//! duplicate: an engine that leaves positions empty (vLLM's null block in a sliding-window group,
//! before the window) or frees blocks the window has left (`forget_before`) may hand the same id
//! out again for a later position of the same request, and it is then appended, not skipped.
use crate::connector::fasthash::FastSet;
use crate::ids::DeviceBlockId;

/// The id of a position without a device block (never an engine's id: the leader refuses ids
/// beyond the engine's table before mapping its null block to it).
pub const HOLE: DeviceBlockId = DeviceBlockId(u32::MAX);

/// A request's device block table: the ids in request order, and a membership index that is
/// built only once the table outgrows a linear scan (most requests never need it). Until then a
/// 1024-bit filter of the ids answers most "not in the table" questions without a scan.
#[derive(Clone, Debug, Default)]
pub(super) struct DeviceTable {
    pub(super) ids: Vec<DeviceBlockId>,
    /// A bit per id of `ids` (`IdFilter`), while there is no `index`.
    filter: IdFilter,
    /// Every id of `ids`, once `ids` is longer than `LINEAR_MAX`; `None` before.
    pub(super) index: Option<FastSet<DeviceBlockId>>,
}

/// A 1024-bit set of id fingerprints: a clear bit proves an id absent; a set bit means "scan".
/// (A table of up to `LINEAR_MAX` ids sets at most an eighth of the bits.)
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct IdFilter([u64; 16]);

impl IdFilter {
    #[inline]
    fn bit(b: DeviceBlockId) -> (usize, u64) {
        let h = (b.0.wrapping_mul(0x9E37_79B1) >> 22) as usize;
        (h >> 6, 1u64 << (h & 63))
    }

    #[inline]
    pub(super) fn may_contain(&self, b: DeviceBlockId) -> bool {
        let (w, m) = Self::bit(b);
        self.0[w] & m != 0
    }

    #[inline]
    pub(super) fn insert(&mut self, b: DeviceBlockId) {
        let (w, m) = Self::bit(b);
        self.0[w] |= m;
    }
}

impl DeviceTable {
    /// Up to this many ids, membership is a scan of `ids` (a few cache lines, no hashing).
    const LINEAR_MAX: usize = 128;

    pub(super) fn len(&self) -> usize {
        self.ids.len()
    }

    pub(super) fn contains(&self, b: DeviceBlockId) -> bool {
        if b == HOLE {
            return false;
        }
        match &self.index {
            Some(set) => set.contains(&b),
            None => self.filter.may_contain(b) && scan(&self.ids, b),
        }
    }

    pub(super) fn push(&mut self, b: DeviceBlockId) {
        self.ids.push(b);
        if b == HOLE {
            return;
        }
        match &mut self.index {
            Some(set) => {
                set.insert(b);
            }
            None if self.ids.len() > Self::LINEAR_MAX => {
                self.index = Some(self.ids.iter().copied().collect());
            }
            None => self.filter.insert(b),
        }
    }

    /// Positions before `end` hold no block any more (the engine freed them): their ids become
    /// holes and are no longer recognised. Returns how many ids were forgotten.
    pub(super) fn forget_before(&mut self, end: usize) -> usize {
        let end = end.min(self.ids.len());
        let mut n = 0;
        for i in 0..end {
            let b = self.ids[i];
            if b != HOLE {
                self.ids[i] = HOLE;
                if let Some(set) = &mut self.index {
                    set.remove(&b);
                }
                n += 1;
            }
        }
        // The filter keeps their bits: a set bit only means "scan", and the scan finds no id.
        n
    }

    pub(super) fn clear(&mut self) {
        self.ids.clear();
        self.filter = IdFilter::default();
        self.index = None;
    }
}

/// Whether `ids` holds `b`: a branch-free compare of 8 ids at a time (vectorised), which beats
/// hashing for the short lists it is used on.
#[inline]
pub(super) fn scan(ids: &[DeviceBlockId], b: DeviceBlockId) -> bool {
    let mut chunks = ids.chunks_exact(8);
    for c in &mut chunks {
        if c.iter().fold(false, |hit, x| hit | (x.0 == b.0)) {
            return true;
        }
    }
    chunks.remainder().iter().any(|x| x.0 == b.0)
}
