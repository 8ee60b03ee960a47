//! CUDA copies between the engine's GPU blocks and the pinned host tier.
use kvtier::transfer::{Fence, TransferError};

use crate::error::IoError;
use crate::host::HostStorage;
use crate::layout::{BlockChunks, Chunk};

pub(crate) struct CudaMover {}

impl CudaMover {
    pub(crate) fn new(
        _ordinal: i32,
        _layout: &dyn BlockChunks,
        _host: Option<&HostStorage>,
    ) -> Result<Self, IoError> {
        Err(IoError::Cuda("CUDA transfers are not built yet".into()))
    }
    pub(crate) fn fence(&self, _s: Option<u64>) -> Result<Fence, TransferError> {
        Ok(Fence::none())
    }
    pub(crate) fn copy(
        &self,
        _items: &[(usize, Vec<Chunk>, usize)],
        _to_host: bool,
        _fence: &Fence,
    ) -> Vec<(usize, String)> {
        Vec::new()
    }
}
