//! cuBLAS, for the transfer benchmark only (feature `transfer-bench`): a bf16 GEMM that stands
//! in for the engine's compute next to kvtier's copies.
//!
//! Invariant: like every `sys` module, each handle is destroyed exactly once by its owner's
//! `Drop`, and nothing here runs before `Driver::open` succeeded.
use std::ffi::c_void;

use cudarc::driver::sys;

use super::cuda::{check, CuResult, DeviceAlloc, Stream};

/// A bf16 GEMM through cuBLAS (benchmarks: the engine's compute next to kvtier's copies).
pub(crate) struct Gemm {
    handle: cudarc::cublas::sys::cublasHandle_t,
    a: DeviceAlloc,
    b: DeviceAlloc,
    c: DeviceAlloc,
    n: i32,
}

// SAFETY: the handle is used by one thread at a time (`&mut self` for `run`).
unsafe impl Send for Gemm {}

impl Gemm {
    /// Square `n x n` bf16 matrices (inputs zero-filled: the rate does not depend on values
    /// enough to matter for a ratio measured on the same data).
    pub(crate) fn new(n: usize, stream: &Stream) -> CuResult<Gemm> {
        use cudarc::cublas::sys as cb;
        // SAFETY: only dlopen.
        if !unsafe { cb::is_culib_present() } {
            return Err("libcublas not found".into());
        }
        let bytes = n * n * 2;
        let a = DeviceAlloc::new(bytes)?;
        let b = DeviceAlloc::new(bytes)?;
        let c = DeviceAlloc::new(bytes)?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: fresh allocations of `bytes`; local out-pointer; the stream is live.
        unsafe {
            check(sys::cuMemsetD8_v2(a.addr(), 0x3c, bytes), "cuMemsetD8")?;
            check(sys::cuMemsetD8_v2(b.addr(), 0x3c, bytes), "cuMemsetD8")?;
            let st = cb::cublasCreate_v2(&mut handle);
            if st != cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(format!("cublasCreate: {st:?}"));
            }
            let st = cb::cublasSetStream_v2(handle, stream.raw() as cb::cudaStream_t);
            if st != cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                let _ = cb::cublasDestroy_v2(handle);
                return Err(format!("cublasSetStream: {st:?}"));
            }
        }
        Ok(Gemm {
            handle,
            a,
            b,
            c,
            n: i32::try_from(n).map_err(|e| e.to_string())?,
        })
    }

    /// Enqueue one GEMM; returns its FLOPs.
    pub(crate) fn run(&mut self) -> CuResult<f64> {
        use cudarc::cublas::sys as cb;
        let alpha = 1f32;
        let beta = 0f32;
        let n = self.n;
        // SAFETY: the matrices are live allocations of n*n bf16; scalars are locals.
        let st = unsafe {
            cb::cublasGemmEx(
                self.handle,
                cb::cublasOperation_t::CUBLAS_OP_N,
                cb::cublasOperation_t::CUBLAS_OP_N,
                n,
                n,
                n,
                (&alpha as *const f32).cast(),
                self.a.addr() as *const c_void,
                cb::cudaDataType::CUDA_R_16BF,
                n,
                self.b.addr() as *const c_void,
                cb::cudaDataType::CUDA_R_16BF,
                n,
                (&beta as *const f32).cast(),
                self.c.addr() as *mut c_void,
                cb::cudaDataType::CUDA_R_16BF,
                n,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        if st != cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(format!("cublasGemmEx: {st:?}"));
        }
        Ok(2.0 * f64::from(n).powi(3))
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once here.
        unsafe {
            let _ = cudarc::cublas::sys::cublasDestroy_v2(self.handle);
        }
    }
}
