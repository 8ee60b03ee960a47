//! The only modules of kvtier that contain `unsafe`: raw memory (`mem`), file I/O system calls
//! (`file`), io_uring submission (`uring`), CUDA driver calls (`cuda`), shared memory (`shm`),
//! Unix-socket credentials and descriptor passing (`sock`) and, for the transfer
//! benchmark only, cuBLAS (`cublas`, feature `transfer-bench`).
//!
//! Invariant: every function here either takes plain safe arguments or is an `unsafe fn` whose
//! `# Safety` section names what the caller must guarantee; every `unsafe` block has a
//! `// SAFETY:` note. Code outside `sys` never dereferences a raw pointer.
#[cfg(test)]
pub(crate) mod count_alloc;
#[cfg(feature = "transfer-bench")]
pub(crate) mod cublas;
pub(crate) mod cuda;
pub(crate) mod file;
pub(crate) mod job;
pub(crate) mod mem;
pub(crate) mod pool;
pub(crate) mod shm;
pub(crate) mod sock;
pub(crate) mod uring;
