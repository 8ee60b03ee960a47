//! [`CpuKvPool`]: a zeroed CPU KV cache that kvtier-io allocates for an engine that forbids
//! `unsafe` (the reference engine), with its element types ([`KvElem`]). Re-exported from
//! `transfer::memory`, where [`EngineMemory::from_cpu_pool`](crate::EngineMemory::from_cpu_pool)
//! registers it.
//!
//! Invariant: the allocation is freed once, when the pool's handle and every engine memory
//! registered over it dropped; the handle borrows only the element range asked for, inside the
//! allocation (checked, panicking like slice indexing).
use std::marker::PhantomData;
use std::ops::{Index, IndexMut, Range};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::transfer::memory::{DevicePtr, KeepAlive, MemoryError};

mod sealed {
    pub trait Sealed {}
}

/// Element types of a [`CpuKvPool`]: plain numbers, valid for every bit pattern (zeroed memory
/// and bytes kvtier copied in are valid values).
pub trait KvElem: Copy + Send + Sync + 'static + sealed::Sealed {}

macro_rules! kv_elems {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl KvElem for $t {}
    )*};
}
kv_elems!(u8, u16, u32, u64, i8, i16, i32, i64, f32, f64);

/// One zeroed CPU allocation, shared by a [`CpuKvPool`] and the engines registered over it.
struct PoolAlloc {
    ptr: NonNull<u8>,
    bytes: usize,
    layout: std::alloc::Layout,
}

// SAFETY: `PoolAlloc` only owns the allocation (freed once, in `drop`); every access to the bytes
// goes through `CpuKvPool`'s borrows or kvtier's copies under `EngineMemory`'s protocol.
unsafe impl Send for PoolAlloc {}
// SAFETY: as for `Send`; `&PoolAlloc` gives no access to the bytes.
unsafe impl Sync for PoolAlloc {}

impl Drop for PoolAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated in `CpuKvPool::zeroed` with exactly this layout, freed only here.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// A CPU KV cache that kvtier-io allocates (zeroed, 64-byte aligned) so that an engine which
/// forbids `unsafe` (the reference engine) can register it without one
/// ([`EngineMemory::from_cpu_pool`](crate::EngineMemory::from_cpu_pool)). The engine reads and
/// writes it through this handle, one element range at a time (`pool[a..b]`, panicking like
/// slice indexing when out of range);
/// the allocation lives until this handle and every engine registered over it dropped.
pub struct CpuKvPool<T: KvElem> {
    alloc: Arc<PoolAlloc>,
    base: DevicePtr,
    len: usize,
    _elem: PhantomData<T>,
}

impl<T: KvElem> CpuKvPool<T> {
    /// A pool of `len` zeroed elements (`len > 0`).
    pub fn zeroed(len: usize) -> Result<Self, MemoryError> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .filter(|&b| b > 0)
            .ok_or_else(|| MemoryError::Invalid(format!("a CPU pool of {len} elements")))?;
        let align = std::mem::align_of::<T>().max(64);
        let layout = std::alloc::Layout::from_size_align(bytes, align)
            .map_err(|_| MemoryError::Alloc { bytes })?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or(MemoryError::Alloc { bytes })?;
        let alloc = Arc::new(PoolAlloc { ptr, bytes, layout });
        let base = DevicePtr::from_host(ptr.as_ptr()).ok_or(MemoryError::Alloc { bytes })?;
        Ok(CpuKvPool {
            alloc,
            base,
            len,
            _elem: PhantomData,
        })
    }
    /// Elements of the pool.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the pool has no elements (never, for a built pool).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Address of element 0.
    pub fn base(&self) -> DevicePtr {
        self.base
    }
    /// Holders of the allocation (this handle and the engine memories registered over it); for
    /// tests and diagnostics.
    pub fn holders(&self) -> usize {
        Arc::strong_count(&self.alloc)
    }
    /// Bytes of the allocation.
    pub(crate) fn bytes(&self) -> usize {
        self.alloc.bytes
    }
    /// What keeps the allocation alive, for an [`EngineMemory`](crate::EngineMemory) over it.
    pub(crate) fn owner(&self) -> KeepAlive {
        self.alloc.clone()
    }
    fn check(&self, r: &Range<usize>) {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "range {r:?} out of a CPU KV pool of {} elements",
            self.len
        );
    }
}

impl<T: KvElem> Index<Range<usize>> for CpuKvPool<T> {
    type Output = [T];
    fn index(&self, r: Range<usize>) -> &[T] {
        self.check(&r);
        // SAFETY: `r` lies inside the allocation of `len` elements of `T` (checked), aligned for
        // `T`, initialised (zeroed, and every bit pattern is a valid `T`: `KvElem`). `&self`
        // excludes a `&mut` borrow of the pool for the returned lifetime; kvtier's own copies
        // never write a block the engine reads (`EngineMemory`'s protocol).
        unsafe {
            std::slice::from_raw_parts(
                self.alloc.ptr.as_ptr().cast::<T>().add(r.start),
                r.end - r.start,
            )
        }
    }
}

impl<T: KvElem> IndexMut<Range<usize>> for CpuKvPool<T> {
    fn index_mut(&mut self, r: Range<usize>) -> &mut [T] {
        self.check(&r);
        // SAFETY: as for `index`; `&mut self` makes this the only borrow of the pool's bytes for
        // the returned lifetime (the handle is not `Clone`; the engines hold the allocation only).
        unsafe {
            std::slice::from_raw_parts_mut(
                self.alloc.ptr.as_ptr().cast::<T>().add(r.start),
                r.end - r.start,
            )
        }
    }
}

impl<T: KvElem> std::fmt::Debug for CpuKvPool<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuKvPool")
            .field("base", &self.base())
            .field("len", &self.len)
            .finish()
    }
}
