//! The only modules of kvtier that contain `unsafe` blocks: raw memory (`mem`), file I/O system
//! calls and the O_DIRECT probe (`file`), io_uring submission (`uring`), CUDA driver calls
//! (`cuda`), shared memory (`shm`), Unix-socket credentials and descriptor passing (`sock`), the
//! reference engine's CPU pool (`pool`), the safe entry points of a transfer job's raw copies
//! (`job`, under the job contract its module comment states) and, for the transfer benchmark
//! only, cuBLAS (`cublas`, feature `transfer-bench`).
//!
//! Invariant: every function here either takes plain safe arguments, or is a crate-private safe
//! wrapper whose contract is stated in its module (`job`), or is an `unsafe fn` whose `# Safety`
//! section names what the caller must guarantee and whose callers are in `sys` too; every
//! `unsafe` block has a `// SAFETY:` note. Code outside `sys` never dereferences a raw pointer
//! and holds no `unsafe` block (the one `unsafe` item outside is the declaration of the public
//! `EngineMemory::new`).
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
