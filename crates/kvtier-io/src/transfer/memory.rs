//! The `unsafe` boundary of kvtier: registering the engine's KV memory (G1) with a
//! [`TransferEngine`](crate::TransferEngine).
//!
//! kvtier copies into and out of memory the engine allocated, named by raw addresses. Whether an
//! address is live engine memory cannot be checked, so a [`TransferEngineBuilder`] takes its
//! device side only as an [`EngineMemory`], made by
//! - [`EngineMemory::new`], an `unsafe fn` whose `# Safety` section is the whole precondition;
//! - [`EngineMemory::from_tensors`] (kvtier-py: the Python tensors' owners) and
//!   [`EngineMemory::from_cpu_pool`] (the reference engine: a [`CpuKvPool`] of kvtier-io's), safe
//!   constructors that hold what keeps the memory allocated and check every region of the layout
//!   against its owners' bounds. What they cannot check is stated on each of them.
//!
//! Invariants: an `EngineMemory` holds its owners (keep-alives) until it drops, and a
//! `TransferEngine` holds its `EngineMemory` for its whole life; a safe constructor never returns
//! a layout with a region (first byte of block 0 to last byte of the last block) outside the
//! bytes of one owner of the layout's device; addresses are [`DevicePtr`]s (never null) up to the
//! registration boundary, integers inside the copy arithmetic.
//!
//! [`TransferEngineBuilder`]: crate::TransferEngineBuilder
use std::any::Any;
use std::num::NonZeroU64;
use std::sync::Arc;

use kvtier::layout::{DeviceKind, DeviceLayout, TensorDesc};

use crate::transfer::layout::BlockChunks;

pub use crate::sys::pool::{CpuKvPool, KvElem};

/// An address in the engine's KV memory: a CUDA device pointer (`CUdeviceptr`, an integer in the
/// driver API) or a CPU address. Never null.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DevicePtr(NonZeroU64);

impl DevicePtr {
    /// The address `addr` (a `CUdeviceptr`, a tensor's `data_ptr()`); `None` for null.
    pub const fn new(addr: u64) -> Option<Self> {
        match NonZeroU64::new(addr) {
            Some(a) => Some(DevicePtr(a)),
            None => None,
        }
    }
    /// The address of CPU memory at `p`; `None` for null.
    pub fn from_host<T>(p: *const T) -> Option<Self> {
        Self::new(p as usize as u64)
    }
    /// The address as an integer.
    pub const fn get(self) -> u64 {
        self.0.get()
    }
    /// `self + bytes`, `None` on overflow.
    pub fn checked_add(self, bytes: u64) -> Option<Self> {
        self.get().checked_add(bytes).and_then(Self::new)
    }
}

impl std::fmt::Debug for DevicePtr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevicePtr({:#x})", self.get())
    }
}

/// Why engine memory cannot be registered safely.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// A region of the layout reaches outside the bytes of every owner of its device.
    #[error(
        "engine memory: layout region {region} ({start:#x}..{end:#x}, all blocks) lies outside \
         every registered tensor's bytes"
    )]
    OutOfBounds {
        /// Index of the region in the layout's canonical order.
        region: usize,
        /// First byte of block 0's chunk.
        start: u64,
        /// One past the last byte of the last block's chunk.
        end: u64,
    },
    /// The bytes holding a region belong to memory of another device than the layout's.
    #[error(
        "engine memory: layout region {region} is {layout:?} memory but its tensor is {tensor:?}"
    )]
    WrongDevice {
        /// Index of the region in the layout's canonical order.
        region: usize,
        /// The layout's device.
        layout: DeviceKind,
        /// The device of the tensor whose bytes hold the region.
        tensor: DeviceKind,
    },
    /// A tensor or pool that spans no bytes, or whose end overflows.
    #[error("engine memory: {0}")]
    Invalid(String),
    /// A CPU tensor's bytes are not mapped readable and writable in this process (a bogus data
    /// pointer: kvtier's copies would fault inside the engine's process).
    #[error(
        "engine memory: CPU tensor {start:#x}..+{len} is not mapped readable and writable in this process"
    )]
    Unmapped {
        /// The tensor's first byte.
        start: u64,
        /// Its length in bytes.
        len: u64,
    },
    /// A CUDA tensor's bytes are not memory of its device, as the CUDA driver knows it (a
    /// bogus, freed or host data pointer: a copy kernel would fault and poison the engine's CUDA
    /// context).
    #[error("engine memory: CUDA tensor {start:#x}..+{len} on device {device} is not its device's memory: {reason}")]
    NotDeviceMemory {
        /// The tensor's first byte.
        start: u64,
        /// Its length in bytes.
        len: u64,
        /// The device the tensor claims.
        device: u32,
        /// What the driver said.
        reason: String,
    },
    /// The CPU pool could not be allocated.
    #[error("CPU KV pool: cannot allocate {bytes} bytes")]
    Alloc {
        /// Bytes asked for.
        bytes: usize,
    },
}

/// What keeps a piece of engine memory allocated (a Python tensor, a pool's allocation): held,
/// never looked into, dropped when the last `TransferEngine` over it drops.
pub type KeepAlive = Arc<dyn Any + Send + Sync>;

/// The bytes of one engine tensor and what keeps them allocated, for
/// [`EngineMemory::from_tensors`].
#[derive(Clone)]
pub struct TensorMemory {
    start: DevicePtr,
    /// Bytes from `start` to one past the tensor's last element.
    len: u64,
    kind: DeviceKind,
    owner: Option<KeepAlive>,
}

impl std::fmt::Debug for TensorMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorMemory")
            .field("start", &self.start)
            .field("len", &self.len)
            .field("kind", &self.kind)
            .field("owner", &self.owner.is_some())
            .finish()
    }
}

impl TensorMemory {
    /// The bytes `desc` spans (element `[0, ..]` to one past its last element, from its shape and
    /// element strides) on `desc.device`, kept by `owner` (the tensor object); `owner` is `None`
    /// where the engine keeps the memory itself and hands over addresses only (TensorRT-LLM's
    /// `KvCacheLayout` regions).
    pub fn of(desc: &TensorDesc, owner: Option<KeepAlive>) -> Result<Self, MemoryError> {
        let bad = |why: &str| MemoryError::Invalid(format!("tensor {}: {why}", desc.name));
        let start = DevicePtr::new(desc.data_ptr).ok_or_else(|| bad("null data pointer"))?;
        if desc.shape.is_empty() || desc.shape.contains(&0) || desc.elem_size == 0 {
            return Err(bad("spans no bytes"));
        }
        if desc.strides.len() != desc.shape.len() {
            return Err(bad("strides do not match the shape"));
        }
        // Offset of the last element, in elements, then one element more.
        let last = desc
            .shape
            .iter()
            .zip(&desc.strides)
            .try_fold(0u64, |acc, (&n, &s)| {
                (n as u64 - 1)
                    .checked_mul(s as u64)
                    .and_then(|v| acc.checked_add(v))
            });
        let len = last
            .and_then(|l| l.checked_add(1))
            .and_then(|l| l.checked_mul(desc.elem_size as u64))
            .filter(|&l| start.get().checked_add(l).is_some())
            .ok_or_else(|| bad("its extent overflows"))?;
        Ok(TensorMemory {
            start,
            len,
            kind: desc.device,
            owner,
        })
    }

    fn contains(&self, start: u64, end: u64) -> bool {
        start >= self.start.get() && end <= self.start.get() + self.len
    }
}

/// The engine's KV memory, registered: where each device block's chunks are, what memory they
/// are, and what keeps them allocated. The only way to give a
/// [`TransferEngineBuilder`](crate::TransferEngineBuilder) a device side.
pub struct EngineMemory {
    layout: Arc<dyn BlockChunks>,
    kind: DeviceKind,
    /// Held, never read: they keep the memory allocated while any engine over it lives.
    _owners: Vec<KeepAlive>,
}

impl std::fmt::Debug for EngineMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineMemory")
            .field("kind", &self.kind)
            .field("num_blocks", &self.layout.num_blocks())
            .field("bytes_per_block", &self.layout.bytes_per_block())
            .field("owners", &self._owners.len())
            .finish()
    }
}

impl EngineMemory {
    /// Register the memory `layout` names as memory of `kind`.
    ///
    /// # Safety
    ///
    /// Every chunk of every block of `layout` is memory of `kind` (CPU memory of this process, or
    /// memory of CUDA device `n` in its primary context) that stays allocated at the same address
    /// for as long as this `EngineMemory` or any `TransferEngine` built from it lives. kvtier
    /// reads a block while a job stores it and writes it while a job loads it, from its own
    /// threads and streams: nothing else may write a block while kvtier's books give it to a job
    /// (the engine writes a block only while no job holds it, and only after `fence`), nor read a
    /// block a load is writing. Chunks of distinct blocks do not overlap.
    pub unsafe fn new(layout: Arc<dyn BlockChunks>, kind: DeviceKind) -> Self {
        EngineMemory {
            layout,
            kind,
            _owners: Vec::new(),
        }
    }

    /// The engine tensors `tensors` (each with what keeps it allocated), laid out as `layout`,
    /// on the layout's device. Checks that every region of `layout` (block 0's chunk to the last
    /// block's) lies inside the bytes of one tensor of that device, and holds every owner until
    /// the last `TransferEngine` built from the result drops.
    ///
    /// Not checked, because it cannot be: that each [`TensorMemory`] describes its tensor
    /// truthfully (its address, shape and strides are those of memory its owner keeps
    /// allocated, or, for a tensor without an owner, memory the engine keeps for the process's
    /// life, as TensorRT-LLM and vLLM do with their KV caches); and that the engine writes a
    /// block only while kvtier's books do not give it to a job (the protocol of
    /// [`EngineMemory::new`]'s `# Safety`, kept by the connector's scheduler side).
    pub fn from_tensors(
        layout: DeviceLayout,
        tensors: Vec<TensorMemory>,
    ) -> Result<Self, MemoryError> {
        check_regions(&layout, &tensors)?;
        // #28: a bogus pointer is refused here rather than faulting in a copy thread (CPU) or
        // in a copy kernel that would poison the engine's CUDA context (CUDA, checked with the
        // driver).
        let mut cuda: std::collections::BTreeMap<u32, Vec<(u64, u64)>> = Default::default();
        for t in tensors.iter().filter(|t| t.len > 0) {
            let start = t.start.get();
            match t.kind {
                DeviceKind::Cpu => {
                    if crate::sys::mem::mapped_rw(start, t.len) == Some(false) {
                        return Err(MemoryError::Unmapped { start, len: t.len });
                    }
                }
                DeviceKind::Cuda(device) => cuda.entry(device).or_default().push((start, t.len)),
            }
        }
        for (device, ranges) in cuda {
            if let Some(Err(((start, len), reason))) =
                crate::sys::cuda::device_ranges_ok(device, &ranges)
            {
                return Err(MemoryError::NotDeviceMemory {
                    start,
                    len,
                    device,
                    reason,
                });
            }
        }
        let kind = layout.device();
        Ok(EngineMemory {
            layout: Arc::new(layout),
            kind,
            _owners: tensors.into_iter().filter_map(|t| t.owner).collect(),
        })
    }

    /// The reference engine's pool `pool`, laid out as `layout` (CPU memory). Checks that every
    /// region of `layout` lies inside the pool and holds the pool's allocation until the last
    /// `TransferEngine` built from the result drops (the pool's handle may drop first).
    ///
    /// Not checked: that the engine touches a block only while kvtier's books do not give it to
    /// a job (the protocol of [`EngineMemory::new`]'s `# Safety`). The pool's accessors borrow
    /// only the range asked for, so kvtier's copies of other blocks never overlap a live borrow.
    pub fn from_cpu_pool<T: KvElem>(
        layout: DeviceLayout,
        pool: &CpuKvPool<T>,
    ) -> Result<Self, MemoryError> {
        let t = TensorMemory {
            start: pool.base(),
            len: pool.bytes() as u64,
            kind: DeviceKind::Cpu,
            owner: Some(pool.owner()),
        };
        Self::from_tensors(layout, vec![t])
    }

    /// Where each device block's chunks are.
    pub fn layout(&self) -> &Arc<dyn BlockChunks> {
        &self.layout
    }
    /// CPU or CUDA memory (by ordinal).
    pub fn kind(&self) -> DeviceKind {
        self.kind
    }
    /// Bytes of one block.
    pub fn bytes_per_block(&self) -> usize {
        self.layout.bytes_per_block()
    }
}

/// Every region of `layout`, over all its blocks, inside one tensor of the layout's device.
fn check_regions(layout: &DeviceLayout, tensors: &[TensorMemory]) -> Result<(), MemoryError> {
    let last = layout.num_blocks().saturating_sub(1) as u64;
    for (i, r) in layout.regions().iter().enumerate() {
        // Cannot overflow for a built DeviceLayout (checked in `DeviceLayout::new`).
        let end = r
            .block_stride
            .checked_mul(last)
            .and_then(|v| v.checked_add(r.base))
            .and_then(|v| v.checked_add(r.len as u64));
        let Some(end) = end else {
            return Err(MemoryError::Invalid(format!(
                "region {i}: address overflow"
            )));
        };
        match tensors.iter().find(|t| t.contains(r.base, end)) {
            Some(t) if t.kind == layout.device() => {}
            Some(t) => {
                return Err(MemoryError::WrongDevice {
                    region: i,
                    layout: layout.device(),
                    tensor: t.kind,
                })
            }
            None => {
                return Err(MemoryError::OutOfBounds {
                    region: i,
                    start: r.base,
                    end,
                })
            }
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "memory_tests.rs"]
mod tests;
