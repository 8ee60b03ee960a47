//! kvtier-io: host memory, disk, CUDA and the transfer engine. All `unsafe` of kvtier lives here.
pub mod remote;
