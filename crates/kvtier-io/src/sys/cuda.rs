//! CUDA driver calls through cudarc's run-time-loaded bindings: the primary context, host memory
//! registration (pinning), streams, events, copies and kernel launches.
//!
//! Invariants: no function here is called before [`Driver::open`] succeeded (which checks that
//! libcuda loads and initialises, so cudarc's loader never panics on a machine without CUDA);
//! every handle created here is destroyed exactly once by its owner's `Drop`.
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;

/// A CUDA error as text (kept as a string so callers need no cudarc types).
pub(crate) type CuResult<T> = Result<T, String>;

fn check(r: sys::CUresult, what: &str) -> CuResult<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed: {r:?}"))
    }
}

/// True if libcuda can be loaded on this machine.
pub(crate) fn library_present() -> bool {
    // SAFETY: only tries to dlopen the library by name.
    unsafe { sys::is_culib_present() }
}

#[allow(dead_code)] // used by the CUDA mover
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
    #[allow(dead_code)]
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
