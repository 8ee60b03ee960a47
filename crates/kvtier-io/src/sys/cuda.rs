//! CUDA driver calls through cudarc's run-time-loaded bindings: the primary context, host memory
//! registration (pinning), streams, events, copies and kernel launches.
//!
//! Invariants: no function here is called before [`Driver::open`] succeeded (which checks that
//! libcuda loads and initialises, so cudarc's loader never panics on a machine without CUDA);
//! every handle created here is destroyed exactly once by its owner's `Drop`.
// Some wrappers (stream and event timing, device allocations, synchronous copies) serve only the
// transfer benchmark (feature `transfer-bench`).
#![cfg_attr(not(feature = "transfer-bench"), allow(dead_code))]
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;

/// A CUDA error as text (kept as a string so callers need no cudarc types).
pub(crate) type CuResult<T> = Result<T, String>;

pub(crate) fn check(r: sys::CUresult, what: &str) -> CuResult<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed: {r:?}"))
    }
}

/// [`device_ranges_ok`]'s answer: `Err` names the first range refused and the driver's reason.
pub(crate) type RangeCheck = Result<(), ((u64, u64), String)>;

/// Whether each `(start, len)` of `ranges` is memory of CUDA device `ordinal`
/// ([`Driver::check_device_range`], one driver handle for all of them): the first range that is
/// not, with the driver's reason; `None` when libcuda is not installed (the caller cannot tell,
/// and no copy to that device can run either).
pub(crate) fn device_ranges_ok(ordinal: u32, ranges: &[(u64, u64)]) -> Option<RangeCheck> {
    if !library_present() {
        return None;
    }
    let first = ranges.first().copied().unwrap_or((0, 0));
    let driver = i32::try_from(ordinal)
        .map_err(|_| format!("CUDA device {ordinal} does not exist"))
        .and_then(Driver::open);
    Some(match driver {
        Err(reason) => Err((first, reason)),
        Ok(d) => ranges.iter().try_for_each(|&(start, len)| {
            d.check_device_range(start, len)
                .map_err(|reason| ((start, len), reason))
        }),
    })
}

/// True if libcuda can be loaded on this machine.
pub(crate) fn library_present() -> bool {
    // SAFETY: only tries to dlopen the library by name.
    unsafe { sys::is_culib_present() }
}

/// True if the loaded driver exports `symbol` (newer entry points such as the batched copy).
pub(crate) fn has_symbol(symbol: &str) -> bool {
    if !library_present() {
        return false;
    }
    // SAFETY: culib() is only reached once the library is known to load; looking a symbol up
    // does not call it.
    unsafe { sys::culib().get::<*const c_void>(symbol.as_bytes()).is_ok() }
}

/// The primary context of one device (the one torch and the engines use), retained.
#[derive(Debug)]
pub(crate) struct Driver {
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    pub(crate) ordinal: i32,
}

// SAFETY: CUDA contexts and devices are process-wide handles usable from any thread once made
// current there (`make_current`).
unsafe impl Send for Driver {}
// SAFETY: as above; the driver API is thread-safe.
unsafe impl Sync for Driver {}

impl Driver {
    /// Load libcuda, initialise it, and retain device `ordinal`'s primary context.
    pub(crate) fn open(ordinal: i32) -> CuResult<Arc<Driver>> {
        if !library_present() {
            return Err("libcuda is not installed (no NVIDIA driver found)".into());
        }
        // SAFETY: the library is present, so cudarc's loader resolves these symbols; all
        // out-pointers are local variables.
        unsafe {
            check(sys::cuInit(0), "cuInit")?;
            let mut count = 0;
            check(sys::cuDeviceGetCount(&mut count), "cuDeviceGetCount")?;
            if ordinal < 0 || ordinal >= count {
                return Err(format!(
                    "CUDA device {ordinal} does not exist ({count} devices)"
                ));
            }
            let mut dev = 0;
            check(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
            let mut ctx = std::ptr::null_mut();
            check(
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                "cuDevicePrimaryCtxRetain",
            )?;
            let d = Driver { dev, ctx, ordinal };
            d.make_current()?;
            Ok(Arc::new(d))
        }
    }

    /// Make this context current on the calling thread (cheap when it already is).
    pub(crate) fn make_current(&self) -> CuResult<()> {
        // SAFETY: `ctx` is a retained primary context, valid until `Drop`.
        unsafe { check(sys::cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent") }
    }

    /// Whether kernels on this device may read host memory registered with
    /// [`Self::host_register`] at its host address (unified addressing and
    /// `CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`): kvtier's layered loads read the host tier
    /// from the scatter kernel only then.
    pub(crate) fn host_pointers_usable(&self) -> bool {
        use sys::CUdevice_attribute as A;
        let attr = |a: A| {
            let mut v = 0i32;
            // SAFETY: `dev` is a valid device handle; local out-pointer.
            let r = unsafe { sys::cuDeviceGetAttribute(&mut v, a, self.dev) };
            r == sys::CUresult::CUDA_SUCCESS && v == 1
        };
        attr(A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)
            && attr(A::CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM)
    }

    /// Pin `len` bytes at `addr` (page-locked, mapped for the device).
    pub(crate) fn host_register(&self, addr: usize, len: usize) -> CuResult<()> {
        self.make_current()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller passes a live mapping it owns; registration does not move or
        // free it, and `host_unregister` undoes it before the mapping is unmapped.
        unsafe {
            check(
                sys::cuMemHostRegister_v2(addr as *mut c_void, len, flags),
                "cuMemHostRegister",
            )
        }
    }

    /// Checks that the `len` bytes from device address `start` are memory the driver knows on
    /// this device: each byte inside an allocation (or adjacent mappings, as expandable
    /// segments make) whose device ordinal is this one. Refuses a host address, a freed or
    /// invented one, and memory of another device.
    pub(crate) fn check_device_range(&self, start: u64, len: u64) -> CuResult<()> {
        use sys::CUpointer_attribute as A;
        self.make_current()?;
        let end = start
            .checked_add(len)
            .ok_or_else(|| format!("{start:#x}+{len} overflows"))?;
        let mut at = start;
        // At most one query per mapping; a KV cache of hundreds of GB in 2 MiB mappings stays
        // far below this bound.
        for _ in 0..(1u32 << 20) {
            if at >= end {
                return Ok(());
            }
            let mut base: sys::CUdeviceptr = 0;
            let mut size: usize = 0;
            let mut ordinal: i32 = -1;
            // SAFETY: each out-pointer is a local of the type the attribute's documentation
            // names (CUdeviceptr, size_t, int); the driver only reads `at` as an address.
            unsafe {
                check(
                    sys::cuPointerGetAttribute(
                        (&mut base as *mut sys::CUdeviceptr).cast(),
                        A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                        at,
                    ),
                    "cuPointerGetAttribute(RANGE_START_ADDR)",
                )?;
                check(
                    sys::cuPointerGetAttribute(
                        (&mut size as *mut usize).cast(),
                        A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                        at,
                    ),
                    "cuPointerGetAttribute(RANGE_SIZE)",
                )?;
                check(
                    sys::cuPointerGetAttribute(
                        (&mut ordinal as *mut i32).cast(),
                        A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                        at,
                    ),
                    "cuPointerGetAttribute(DEVICE_ORDINAL)",
                )?;
            }
            if ordinal != self.ordinal {
                return Err(format!(
                    "address {at:#x} is memory of device {ordinal}, not of device {}",
                    self.ordinal
                ));
            }
            let next = base.saturating_add(size as u64);
            if next <= at {
                return Err(format!("the driver gave address {at:#x} an empty range"));
            }
            at = next;
        }
        Err(format!("{start:#x}+{len} spans too many mappings"))
    }

    /// Undo [`Driver::host_register`].
    pub(crate) fn host_unregister(&self, addr: usize) -> CuResult<()> {
        self.make_current()?;
        // SAFETY: `addr` was registered by `host_register`.
        unsafe {
            check(
                sys::cuMemHostUnregister(addr as *mut c_void),
                "cuMemHostUnregister",
            )
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // SAFETY: retained once in `open`, released once here.
        unsafe {
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

/// A stream owned by kvtier.
#[derive(Debug)]
pub(crate) struct Stream {
    raw: sys::CUstream,
}

// SAFETY: CUDA streams may be used from any thread of the process.
unsafe impl Send for Stream {}
// SAFETY: as above; the driver serialises operations on one stream.
unsafe impl Sync for Stream {}

impl Stream {
    /// A non-blocking stream; `lowest_priority` makes its kernels yield to the engine's.
    pub(crate) fn new(lowest_priority: bool) -> CuResult<Stream> {
        let (mut least, mut greatest) = (0, 0);
        let mut raw = std::ptr::null_mut();
        // SAFETY: local out-pointers; a context is current (the caller made it so).
        unsafe {
            check(
                sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest),
                "cuCtxGetStreamPriorityRange",
            )?;
            let prio = if lowest_priority { least } else { 0 };
            check(
                sys::cuStreamCreateWithPriority(
                    &mut raw,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                    prio,
                ),
                "cuStreamCreateWithPriority",
            )?;
        }
        Ok(Stream { raw })
    }

    pub(crate) fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// Make the stream wait (on the GPU) for `ev`.
    pub(crate) fn wait(&self, ev: &Event) -> CuResult<()> {
        // SAFETY: both handles are live.
        unsafe {
            check(
                sys::cuStreamWaitEvent(self.raw, ev.raw, 0),
                "cuStreamWaitEvent",
            )
        }
    }

    pub(crate) fn synchronize(&self) -> CuResult<()> {
        // SAFETY: live handle.
        unsafe { check(sys::cuStreamSynchronize(self.raw), "cuStreamSynchronize") }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once here.
        unsafe {
            let _ = sys::cuStreamDestroy_v2(self.raw);
        }
    }
}

/// A CUDA event.
#[derive(Debug)]
pub(crate) struct Event {
    raw: sys::CUevent,
}

// SAFETY: events are process-wide handles usable from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

/// How often [`Event::wait`] asks the driver (a 2 MiB block crosses PCIe Gen5 in about 40 us).
const POLL_GAP: std::time::Duration = std::time::Duration::from_micros(10);
/// The first sleep of [`Event::wait_asleep`] between two polls.
const FIRST_NAP: std::time::Duration = std::time::Duration::from_micros(20);
/// The longest sleep of [`Event::wait_asleep`] between two polls: the most a fence's completion
/// can go unseen before the copies behind it are issued.
const MAX_NAP: std::time::Duration = std::time::Duration::from_micros(200);

impl Event {
    /// `timing`: usable with `elapsed_ms`; otherwise cheaper and waited for by blocking (not
    /// spinning) the host thread.
    pub(crate) fn new(timing: bool) -> CuResult<Event> {
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT as u32
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
                | sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
        };
        let mut raw = std::ptr::null_mut();
        // SAFETY: local out-pointer.
        unsafe { check(sys::cuEventCreate(&mut raw, flags), "cuEventCreate")? };
        Ok(Event { raw })
    }

    pub(crate) fn record(&self, stream: &Stream) -> CuResult<()> {
        // SAFETY: live handles.
        unsafe { check(sys::cuEventRecord(self.raw, stream.raw), "cuEventRecord") }
    }

    /// Record on a stream the engine owns, given as its raw handle (0 = legacy default stream).
    ///
    /// # Safety
    /// `stream` must be a live stream of the current context, or 0.
    pub(crate) unsafe fn record_raw(&self, stream: u64) -> CuResult<()> {
        // SAFETY: forwarded to the caller.
        unsafe {
            check(
                sys::cuEventRecord(self.raw, stream as usize as sys::CUstream),
                "cuEventRecord",
            )
        }
    }

    /// Make a stream the engine owns (raw handle, 0 = legacy default stream) wait on the device
    /// for this event's latest record: the engine's later work on it runs after that record.
    ///
    /// # Safety
    /// `stream` must be a live stream of the current context, or 0.
    pub(crate) unsafe fn make_raw_stream_wait(&self, stream: u64) -> CuResult<()> {
        // SAFETY: forwarded to the caller; the event is live.
        unsafe {
            check(
                sys::cuStreamWaitEvent(stream as usize as sys::CUstream, self.raw, 0),
                "cuStreamWaitEvent",
            )
        }
    }

    pub(crate) fn synchronize(&self) -> CuResult<()> {
        // SAFETY: live handle (a never-recorded event counts as complete).
        unsafe { check(sys::cuEventSynchronize(self.raw), "cuEventSynchronize") }
    }

    /// Wait for a short event (copies in flight) by polling it every `POLL_GAP`, yielding the
    /// CPU in between: wakes up within microseconds of completion, unlike a blocking wait, which
    /// costs a per-job bubble, and asks the driver at most once per gap (a tight
    /// `cuEventQuery` loop competes with the engine thread's own driver calls).
    pub(crate) fn wait(&self) -> CuResult<()> {
        loop {
            if self.query()? {
                return Ok(());
            }
            let t = std::time::Instant::now();
            while t.elapsed() < POLL_GAP {
                std::thread::yield_now();
            }
        }
    }

    /// Wait for a long event (the engine's forward pass before a store) asleep: polls, sleeping
    /// from `FIRST_NAP` doubling to `MAX_NAP` between polls. On the H200 an executor spinning on
    /// the driver while the forward pass ran slowed vLLM's launch of the next prompt's first
    /// forward pass by 15-20 ms.
    pub(crate) fn wait_asleep(&self) -> CuResult<()> {
        let mut nap = FIRST_NAP;
        while !self.query()? {
            std::thread::sleep(nap);
            nap = (nap * 2).min(MAX_NAP);
        }
        Ok(())
    }

    /// Whether the event's latest record completed (a never-recorded event has).
    fn query(&self) -> CuResult<bool> {
        // SAFETY: live handle.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(format!("cuEventQuery failed: {e:?}")),
        }
    }

    /// Milliseconds between two recorded, completed timing events.
    pub(crate) fn elapsed_ms(start: &Event, end: &Event) -> CuResult<f32> {
        let mut ms = 0f32;
        // SAFETY: live handles, local out-pointer.
        unsafe {
            check(
                sys::cuEventElapsedTime_v2(&mut ms, start.raw, end.raw),
                "cuEventElapsedTime",
            )?
        };
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once here.
        unsafe {
            let _ = sys::cuEventDestroy_v2(self.raw);
        }
    }
}

/// Enqueue a copy of `len` bytes between two addresses (device or registered host memory,
/// distinguished by unified addressing).
///
/// # Safety
/// Both ranges must stay valid until the stream has executed the copy, and nobody may write
/// them meanwhile.
pub(crate) unsafe fn memcpy_async(dst: u64, src: u64, len: usize, stream: &Stream) -> CuResult<()> {
    // SAFETY: forwarded to the caller.
    unsafe {
        check(
            sys::cuMemcpyAsync(dst, src, len, stream.raw),
            "cuMemcpyAsync",
        )
    }
}

/// Enqueue a 2D copy: `height` rows of `width` bytes, row `i` from `src + i * spitch` to
/// `dst + i * dpitch` (addresses by unified addressing: device or registered host memory). The
/// copy engine walks the rows itself: one call, not one per row.
///
/// # Safety
/// As [`memcpy_async`] for every row.
pub(crate) unsafe fn memcpy_2d_async(
    dst: u64,
    dpitch: usize,
    src: u64,
    spitch: usize,
    (width, height): (usize, usize),
    stream: &Stream,
) -> CuResult<()> {
    let p = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcPitch: spitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: dpitch,
        WidthInBytes: width,
        Height: height,
    };
    // SAFETY: `p` is a live local the driver reads during the call; memory validity is
    // forwarded to the caller.
    unsafe { check(sys::cuMemcpy2DAsync_v2(&p, stream.raw), "cuMemcpy2DAsync") }
}

/// Synchronous copy (tests and benchmarks).
///
/// # Safety
/// As [`memcpy_async`], for the duration of the call.
pub(crate) unsafe fn memcpy_sync(dst: u64, src: u64, len: usize) -> CuResult<()> {
    // SAFETY: forwarded to the caller.
    unsafe { check(sys::cuMemcpy(dst, src, len), "cuMemcpy") }
}

/// Enqueue many copies in one call (`cuMemcpyBatchAsync`, CUDA >= 12.8). `device_is_src`
/// gives the location hints.
///
/// # Safety
/// As [`memcpy_async`] for every (dst, src, size) triple.
pub(crate) unsafe fn memcpy_batch_async(
    dsts: &mut [u64],
    srcs: &mut [u64],
    sizes: &mut [usize],
    device_is_src: bool,
    ordinal: i32,
    stream: &Stream,
) -> CuResult<()> {
    if dsts.len() != srcs.len() || dsts.len() != sizes.len() {
        return Err("batch arrays differ in length".into());
    }
    if dsts.is_empty() {
        return Ok(());
    }
    let dev = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal,
    };
    let host = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
        id: 0,
    };
    let mut attrs = [sys::CUmemcpyAttributes {
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: if device_is_src { dev } else { host },
        dstLocHint: if device_is_src { host } else { dev },
        flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
    }];
    let mut idx = [0usize];
    // SAFETY: the arrays are live locals/caller slices of equal length; memory validity is
    // forwarded to the caller.
    unsafe {
        check(
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                dsts.len(),
                attrs.as_mut_ptr(),
                idx.as_mut_ptr(),
                1,
                stream.raw,
            ),
            "cuMemcpyBatchAsync",
        )
    }
}

/// Device memory owned by kvtier (staging buffers, benchmark caches).
#[derive(Debug)]
pub(crate) struct DeviceAlloc {
    ptr: u64,
    len: usize,
}

impl DeviceAlloc {
    pub(crate) fn new(len: usize) -> CuResult<DeviceAlloc> {
        let mut ptr = 0;
        // SAFETY: local out-pointer; a context is current.
        unsafe { check(sys::cuMemAlloc_v2(&mut ptr, len.max(1)), "cuMemAlloc")? };
        Ok(DeviceAlloc { ptr, len })
    }
    pub(crate) fn addr(&self) -> u64 {
        self.ptr
    }
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Copy `data` to byte `offset` of this allocation (synchronous).
    pub(crate) fn upload(&self, offset: usize, data: &[u8]) -> CuResult<()> {
        if offset.checked_add(data.len()).is_none_or(|e| e > self.len) {
            return Err("upload out of bounds".into());
        }
        // SAFETY: bounds checked above; `data` is a live slice; the copy is synchronous.
        unsafe { memcpy_sync(self.ptr + offset as u64, data.as_ptr() as u64, data.len()) }
    }

    /// Copy byte `offset..offset+out.len()` of this allocation into `out` (synchronous).
    pub(crate) fn download(&self, offset: usize, out: &mut [u8]) -> CuResult<()> {
        if offset.checked_add(out.len()).is_none_or(|e| e > self.len) {
            return Err("download out of bounds".into());
        }
        // SAFETY: bounds checked above; `out` is exclusively borrowed; synchronous copy.
        unsafe { memcpy_sync(out.as_mut_ptr() as u64, self.ptr + offset as u64, out.len()) }
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`, freed once here.
        unsafe {
            let _ = sys::cuMemFree_v2(self.ptr);
        }
    }
}

/// Page-locked host memory from `cuMemHostAlloc` (kernel descriptors; the baseline that the
/// host tier's pinning is compared with).
#[derive(Debug)]
pub(crate) struct PinnedAlloc {
    ptr: usize,
    len: usize,
}

// SAFETY: plain memory owned by this value.
unsafe impl Send for PinnedAlloc {}
// SAFETY: only addresses are handed out.
unsafe impl Sync for PinnedAlloc {}

impl PinnedAlloc {
    pub(crate) fn new(len: usize) -> CuResult<PinnedAlloc> {
        let mut p = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: local out-pointer; a context is current.
        unsafe {
            check(
                sys::cuMemHostAlloc(&mut p, len.max(1), flags),
                "cuMemHostAlloc",
            )?
        };
        Ok(PinnedAlloc {
            ptr: p as usize,
            len,
        })
    }
    pub(crate) fn addr(&self) -> usize {
        self.ptr
    }
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for PinnedAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`, freed once here.
        unsafe {
            let _ = sys::cuMemFreeHost(self.ptr as *mut c_void);
        }
    }
}

/// True if NVRTC (the run-time compiler) can be loaded.
pub(crate) fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// A kernel `f(const Desc* descs, unsigned n)` loaded from PTX.
#[derive(Debug)]
pub(crate) struct Kernel {
    module: sys::CUmodule,
    func: sys::CUfunction,
}

// SAFETY: modules and functions are context-wide handles usable from any thread.
unsafe impl Send for Kernel {}
// SAFETY: launching is thread-safe.
unsafe impl Sync for Kernel {}

impl Kernel {
    pub(crate) fn load(ptx: &str, name: &str) -> CuResult<Kernel> {
        let ptx = std::ffi::CString::new(ptx).map_err(|e| e.to_string())?;
        let cname = std::ffi::CString::new(name).map_err(|e| e.to_string())?;
        let mut module = std::ptr::null_mut();
        let mut func = std::ptr::null_mut();
        // SAFETY: NUL-terminated PTX and name; local out-pointers.
        unsafe {
            check(
                sys::cuModuleLoadData(&mut module, ptx.as_ptr().cast()),
                "cuModuleLoadData",
            )?;
            if let Err(e) = check(
                sys::cuModuleGetFunction(&mut func, module, cname.as_ptr()),
                "cuModuleGetFunction",
            ) {
                let _ = sys::cuModuleUnload(module);
                return Err(e);
            }
        }
        Ok(Kernel { module, func })
    }

    /// Launch with `grid` blocks of `block` threads and arguments `(descs, n)`.
    ///
    /// # Safety
    /// `descs` must point to `n` descriptors readable by the device until the kernel has run,
    /// and every address in them must be valid device-accessible memory that nobody else
    /// accesses meanwhile.
    pub(crate) unsafe fn launch(
        &self,
        grid: u32,
        block: u32,
        stream: &Stream,
        descs: u64,
        n: u32,
    ) -> CuResult<()> {
        let mut a0 = descs;
        let mut a1 = n;
        let mut params = [
            (&mut a0 as *mut u64).cast::<c_void>(),
            (&mut a1 as *mut u32).cast::<c_void>(),
        ];
        // SAFETY: `params` points at two live locals matching the kernel's signature; the rest
        // is forwarded to the caller.
        unsafe {
            check(
                sys::cuLaunchKernel(
                    self.func,
                    grid,
                    1,
                    1,
                    block,
                    1,
                    1,
                    0,
                    stream.raw,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
                "cuLaunchKernel",
            )
        }
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        // SAFETY: loaded in `load`, unloaded once here.
        unsafe {
            let _ = sys::cuModuleUnload(self.module);
        }
    }
}
