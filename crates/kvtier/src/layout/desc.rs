//! The vocabulary of layouts: tensors as the engine reports them, element types, the shape of one
//! block's KV, the engines' tensor conventions, and the byte ranges a layout is made of. Plain
//! data: nothing here computes an address beyond a tensor's own shape and strides.
use serde::{Deserialize, Serialize};

use super::LayoutError;

/// Where a tensor lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DeviceKind {
    /// Host memory.
    Cpu,
    /// A CUDA device, by ordinal.
    Cuda(u32),
}

/// An engine tensor as the engine reports it. `strides` are in elements (torch's convention).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorDesc {
    /// The tensor's name in errors (e.g. `layer.3`).
    pub name: String,
    /// Address of element `[0, 0, ...]`.
    pub data_ptr: u64,
    /// Extent of each dimension, outermost first.
    pub shape: Vec<usize>,
    /// Strides in elements, per dimension.
    pub strides: Vec<usize>,
    /// Bytes per element.
    pub elem_size: usize,
    /// Where the memory lives.
    pub device: DeviceKind,
}

impl TensorDesc {
    /// A tensor with row-major (contiguous) strides.
    pub fn contiguous(
        name: impl Into<String>,
        data_ptr: u64,
        shape: Vec<usize>,
        elem_size: usize,
        device: DeviceKind,
    ) -> Self {
        let mut strides = vec![0; shape.len()];
        let mut acc = 1usize;
        for (i, n) in shape.iter().enumerate().rev() {
            strides[i] = acc;
            acc = acc.saturating_mul(*n);
        }
        TensorDesc {
            name: name.into(),
            data_ptr,
            shape,
            strides,
            elem_size,
            device,
        }
    }

    /// `Ok` if this tensor has `first`'s shape, strides, element size and device, as every layer
    /// tensor of one layout must; else the first difference, naming both tensors (and saying so
    /// when dimension `block_dim`, the block count, is what differs).
    pub(super) fn check_same_as(
        &self,
        first: &TensorDesc,
        block_dim: usize,
    ) -> Result<(), LayoutError> {
        if self.shape != first.shape {
            return Err(self.mismatch(format!(
                "shape {:?} differs from {}'s {:?}{}",
                self.shape,
                first.name,
                first.shape,
                if self.shape.get(block_dim) != first.shape.get(block_dim) {
                    " (block counts do not match)"
                } else {
                    ""
                }
            )));
        }
        if self.strides != first.strides {
            return Err(self.mismatch(format!(
                "strides {:?} differ from {}'s {:?}",
                self.strides, first.name, first.strides
            )));
        }
        if self.elem_size != first.elem_size {
            return Err(self.mismatch(format!(
                "element size {} differs from {}'s {}",
                self.elem_size, first.name, first.elem_size
            )));
        }
        if self.device != first.device {
            return Err(self.mismatch(format!(
                "device {:?} differs from {}'s {:?}",
                self.device, first.name, first.device
            )));
        }
        Ok(())
    }

    pub(super) fn mismatch(&self, reason: impl Into<String>) -> LayoutError {
        LayoutError::Mismatch {
            tensor: self.name.clone(),
            reason: reason.into(),
        }
    }
}

/// Element type of the KV cache. Informational for kvtier (blocks are opaque bytes) but part of
/// the layout's identity, so blocks never move between caches of different types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    BF16,
    /// 8-bit float, 4 exponent bits.
    F8E4M3,
    /// 8-bit float, 5 exponent bits.
    F8E5M2,
    /// Unsigned byte (e.g. quantized caches).
    U8,
    /// Signed byte.
    I8,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F8E4M3 | DType::F8E5M2 | DType::U8 | DType::I8 => 1,
        }
    }

    /// Parse torch / numpy style names: `torch.bfloat16`, `bfloat16`, `bf16`, `float16`, `half`,
    /// `float32`, `float`, `float8_e4m3fn`, `fp8`, `uint8`, `int8`.
    pub fn parse(name: &str) -> Option<DType> {
        let n = name
            .trim()
            .trim_start_matches("torch.")
            .to_ascii_lowercase();
        Some(match n.as_str() {
            "float32" | "float" | "f32" | "fp32" => DType::F32,
            "float16" | "half" | "f16" | "fp16" => DType::F16,
            "bfloat16" | "bf16" => DType::BF16,
            "float8_e4m3fn" | "float8_e4m3" | "fp8" | "fp8_e4m3" | "f8e4m3" => DType::F8E4M3,
            "float8_e5m2" | "fp8_e5m2" | "f8e5m2" => DType::F8E5M2,
            "uint8" | "u8" => DType::U8,
            "int8" | "i8" => DType::I8,
            _ => return None,
        })
    }
}

/// The shape of one block's KV, independent of where the engine keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvGeometry {
    /// Layers of the model.
    pub num_layers: usize,
    /// K/V planes: 2, or 1 for MLA (one latent plane).
    pub kv_planes: usize,
    /// Tokens per block.
    pub tokens_per_block: usize,
    /// Bytes of one token in one plane of one layer (e.g. kv_heads * head_dim * elem size).
    pub bytes_per_token_plane: usize,
    /// Element type.
    pub dtype: DType,
}

impl KvGeometry {
    /// Bytes of one (layer, plane) piece of a block.
    pub fn bytes_per_piece(&self) -> usize {
        self.tokens_per_block * self.bytes_per_token_plane
    }

    /// Bytes of one block on one rank: all layers, all planes.
    pub fn bytes_per_block(&self) -> usize {
        self.num_layers * self.kv_planes * self.bytes_per_piece()
    }

    /// Offset of (layer, plane) inside a block in kvtier's canonical host/disk format.
    pub fn canonical_offset(&self, layer: usize, plane: usize) -> usize {
        (layer * self.kv_planes + plane) * self.bytes_per_piece()
    }
}

/// Which engine tensor convention the tensors follow (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EngineLayoutKind {
    /// TensorRT-LLM's single pool tensor (see the module docs).
    TrtllmPool {
        /// Tokens per block of the pool.
        tokens_per_block: usize,
    },
    /// vLLM per-layer `[2, num_blocks, block_size, heads, head_dim]`.
    VllmCudaKvFirst,
    /// vLLM per-layer `[num_blocks, 2, block_size, heads, head_dim]`.
    VllmCudaBlockFirst,
    /// vLLM per-layer MLA `[num_blocks, block_size, head_size]` (one plane).
    VllmMla,
    /// vLLM's CPU per-layer `[num_blocks, kv_heads, block_size, 2 * head_size]`.
    VllmCpu,
    /// vLLM >= 0.32's 4-D views in any `KVCacheLayout`; `kernel_blocks` kernel blocks (rows
    /// of the view) per logical block (1 unless vLLM splits blocks for its kernels).
    VllmPaged {
        /// Kernel blocks (rows of the view) per logical block.
        kernel_blocks: usize,
    },
}

impl EngineLayoutKind {
    /// Pick the vLLM convention from a per-layer tensor's rank: 4-D views are
    /// [`EngineLayoutKind::VllmPaged`] (vLLM >= 0.32, any `KVCacheLayout`), 5-D shapes the
    /// K/V-first or block-first tensors of earlier releases, 3-D MLA tensors `[n, tokens, dim]`.
    /// `num_blocks` (vLLM's logical block count, if known) detects kernel-block splitting.
    pub fn detect_vllm(
        tensor: &TensorDesc,
        num_blocks: Option<usize>,
    ) -> Result<Self, LayoutError> {
        match tensor.shape.len() {
            4 => {
                let rows = tensor.shape[0];
                let kernel_blocks = match num_blocks {
                    Some(n) if n > 0 && rows > n && rows.is_multiple_of(n) => rows / n,
                    _ => 1,
                };
                Ok(EngineLayoutKind::VllmPaged { kernel_blocks })
            }
            5 => Self::detect_vllm_cuda(tensor),
            3 => Ok(EngineLayoutKind::VllmMla),
            _ => Err(tensor.mismatch(format!(
                "shape {:?} is none of vLLM's KV cache tensors: a 4-D view [num_blocks, \
                 num_kv_heads, block_size, content] (vLLM >= 0.32), [2, num_blocks, block_size, \
                 heads, head_dim] or [num_blocks, 2, ...] (earlier releases), or MLA's \
                 [num_blocks, block_size, head_size]",
                tensor.shape
            ))),
        }
    }

    /// Pick the vLLM CUDA convention from a per-layer shape: `[2, n, ...]` is KV-first,
    /// `[n, 2, ...]` block-first. With exactly 2 blocks the shape is ambiguous: an error.
    pub fn detect_vllm_cuda(tensor: &TensorDesc) -> Result<Self, LayoutError> {
        match tensor.shape.as_slice() {
            [2, n, _, _, _] if *n != 2 => Ok(EngineLayoutKind::VllmCudaKvFirst),
            [n, 2, _, _, _] if *n != 2 => Ok(EngineLayoutKind::VllmCudaBlockFirst),
            [2, 2, _, _, _] => Err(tensor.mismatch(
                "shape [2, 2, ...] is ambiguous between [2, num_blocks, ...] and [num_blocks, 2, ...]; \
                 name the layout kind explicitly",
            )),
            s => Err(tensor.mismatch(format!(
                "shape {s:?} is neither [2, num_blocks, block_size, heads, head_dim] nor \
                 [num_blocks, 2, block_size, heads, head_dim]"
            ))),
        }
    }
}

/// One contiguous range of device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Chunk {
    /// Address of its first byte.
    pub addr: u64,
    /// Its length in bytes.
    pub len: usize,
}

/// A strided region holding one piece of every block: block `b`'s piece is
/// `[base + b * block_stride, + len)`. The regions of a layout, in canonical order, are what a
/// block is made of (before coalescing).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DeviceRegion {
    /// Address of block 0's piece.
    pub base: u64,
    /// Bytes from one block's piece to the next one's.
    pub block_stride: u64,
    /// Bytes of the piece.
    pub len: usize,
}
