//! The only modules of kvtier that contain `unsafe`: raw memory (`mem`), file I/O system calls
//! (`file`), io_uring submission (`uring`) and CUDA driver calls (`cuda`).
//!
//! Invariant: every function here either takes plain safe arguments or is an `unsafe fn` whose
//! `# Safety` section names what the caller must guarantee; every `unsafe` block has a
//! `// SAFETY:` note. Code outside `sys` never dereferences a raw pointer.
pub(crate) mod cuda;
pub(crate) mod file;
pub(crate) mod mem;
pub(crate) mod uring;
