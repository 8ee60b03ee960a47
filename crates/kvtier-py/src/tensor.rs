//! Tensor descriptors: what kvtier needs to know about an engine-owned tensor (address, shape,
//! strides in bytes, element size, dtype, device), and the checks that turn a descriptor of
//! TensorRT-LLM's primary pool tensor into block geometry.
//!
//! Invariant: a descriptor that passes [`TensorDesc::trtllm_pool`] describes memory in which block
//! `b` occupies exactly `[data_ptr + b * bytes_per_block, data_ptr + (b + 1) * bytes_per_block)`,
//! contiguous across layers and K/V planes; anything else is a `LayoutError` (a `ValueError` in
//! Python) naming the dimension that does not fit. Descriptors hold addresses only: the engine owns
//! the memory and keeps the tensor alive (TensorRT-LLM and vLLM keep their caches for the process
//! lifetime).
use pyo3::prelude::*;

use crate::errors::{BridgeError, BridgeResult, Family};

/// Where a tensor's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

impl DeviceKind {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "cpu" => Some(DeviceKind::Cpu),
            "cuda" => Some(DeviceKind::Cuda),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        }
    }
}

/// A plain description of one tensor. Built in Python by `kvtier._tensors.describe(obj)` from a
/// torch tensor, a numpy array (`__array_interface__`) or a CUDA array (`__cuda_array_interface__`).
#[pyclass(frozen, module = "kvtier._native", from_py_object)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    /// Address of element `[0, 0, ...]`.
    #[pyo3(get)]
    pub data_ptr: u64,
    #[pyo3(get)]
    pub shape: Vec<usize>,
    /// Strides in BYTES (numpy convention; torch's element strides times the element size).
    #[pyo3(get)]
    pub strides: Vec<i64>,
    #[pyo3(get)]
    pub itemsize: usize,
    /// Element type name, e.g. "bfloat16", "float16", "float32", "uint8", "float8_e4m3fn".
    #[pyo3(get)]
    pub dtype: String,
    pub device: DeviceKind,
    /// CUDA ordinal; 0 for CPU.
    #[pyo3(get)]
    pub device_index: u32,
}

/// Geometry of TensorRT-LLM's primary pool `[num_blocks, num_layers, kv_factor, inner...]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolGeometry {
    pub num_blocks: usize,
    pub num_layers: usize,
    /// 2 for K/V, 1 for MLA.
    pub kv_factor: usize,
    /// Bytes of one (layer, plane) chunk of one block: `tokens_per_block * kv_heads * head_dim * itemsize`.
    pub bytes_per_plane: usize,
    /// Bytes of one whole block (all layers, all planes).
    pub bytes_per_block: usize,
}

impl TensorDesc {
    /// Validates the descriptor itself (lengths agree, sizes are positive).
    pub fn validate(&self, name: &str) -> BridgeResult<()> {
        let bad = |reason: String| {
            Err(BridgeError::local(
                Family::Layout,
                format!("tensor {name}: {reason}"),
            ))
        };
        if self.shape.len() != self.strides.len() {
            return bad(format!(
                "shape has {} dimensions but strides has {}",
                self.shape.len(),
                self.strides.len()
            ));
        }
        if self.itemsize == 0 {
            return bad("element size is 0".into());
        }
        if self.data_ptr == 0 && self.shape.iter().product::<usize>() > 0 {
            return bad("data pointer is null".into());
        }
        Ok(())
    }

    /// Byte strides of a C-contiguous tensor of this shape and element size.
    pub fn contiguous_strides(shape: &[usize], itemsize: usize) -> Vec<i64> {
        let mut out = vec![0i64; shape.len()];
        let mut acc = itemsize as i64;
        for (i, d) in shape.iter().enumerate().rev() {
            out[i] = acc;
            acc = acc.saturating_mul(*d as i64);
        }
        out
    }

    /// Checks that this is a TensorRT-LLM primary pool tensor for `tokens_per_block` tokens per
    /// block (and `num_layers` layers when known) and returns its block geometry.
    pub fn trtllm_pool(
        &self,
        tokens_per_block: usize,
        num_layers: Option<usize>,
    ) -> BridgeResult<PoolGeometry> {
        const NAME: &str = "kv_cache_tensor";
        self.validate(NAME)?;
        let bad = |reason: String| {
            Err(BridgeError::local(
                Family::Layout,
                format!(
                    "tensor {NAME} with shape {:?}: {reason} (expected [num_blocks, num_layers, kv_factor, tokens_per_block*kv_heads*head_dim])",
                    self.shape
                ),
            ))
        };
        if self.shape.len() < 4 {
            return bad(format!("has {} dimensions, expected 4", self.shape.len()));
        }
        let (num_blocks, layers, kv_factor) = (self.shape[0], self.shape[1], self.shape[2]);
        let inner: usize = self.shape[3..].iter().product();
        if num_blocks == 0 {
            return bad("num_blocks (dim 0) is 0".into());
        }
        if layers == 0 {
            return bad("num_layers (dim 1) is 0".into());
        }
        if let Some(expected) = num_layers {
            if layers != expected {
                return bad(format!(
                    "num_layers (dim 1) is {layers} but the model has {expected} layers"
                ));
            }
        }
        if kv_factor != 1 && kv_factor != 2 {
            return bad(format!(
                "kv_factor (dim 2) is {kv_factor}, expected 2 (K and V) or 1 (MLA)"
            ));
        }
        if tokens_per_block == 0 {
            return bad("tokens_per_block is 0".into());
        }
        if inner == 0 || !inner.is_multiple_of(tokens_per_block) {
            return bad(format!(
                "inner size {inner} (dims 3..) is not a positive multiple of tokens_per_block {tokens_per_block}"
            ));
        }
        let want = Self::contiguous_strides(&self.shape, self.itemsize);
        for (dim, (have, want)) in self.strides.iter().zip(&want).enumerate() {
            // A dimension of size 1 can carry any stride without changing the addresses.
            if have != want && self.shape[dim] != 1 {
                return bad(format!(
                    "stride of dim {dim} is {have} bytes, expected {want} (the pool must be contiguous so each block is contiguous across layers)"
                ));
            }
        }
        let bytes_per_plane = inner * self.itemsize;
        Ok(PoolGeometry {
            num_blocks,
            num_layers: layers,
            kv_factor,
            bytes_per_plane,
            bytes_per_block: bytes_per_plane * kv_factor * layers,
        })
    }
}

#[pymethods]
impl TensorDesc {
    #[new]
    #[pyo3(signature = (data_ptr, shape, strides, itemsize, dtype, device = "cpu", device_index = 0))]
    fn py_new(
        data_ptr: u64,
        shape: Vec<usize>,
        strides: Vec<i64>,
        itemsize: usize,
        dtype: String,
        device: &str,
        device_index: u32,
    ) -> PyResult<Self> {
        let device = DeviceKind::parse(device).ok_or_else(|| {
            crate::errors::new_err(
                Family::Layout,
                format!("device {device:?} is not supported (expected \"cpu\" or \"cuda\")"),
            )
        })?;
        let desc = TensorDesc {
            data_ptr,
            shape,
            strides,
            itemsize,
            dtype,
            device,
            device_index,
        };
        desc.validate("tensor")?;
        Ok(desc)
    }

    /// Byte strides of a C-contiguous tensor of `shape` with elements of `itemsize` bytes.
    #[staticmethod]
    #[pyo3(name = "contiguous_strides")]
    fn py_contiguous_strides(shape: Vec<usize>, itemsize: usize) -> Vec<i64> {
        Self::contiguous_strides(&shape, itemsize)
    }

    /// Checks this as TensorRT-LLM's primary pool tensor and returns its geometry as a dict
    /// (num_blocks, num_layers, kv_factor, bytes_per_plane, bytes_per_block). Raises LayoutError
    /// (a ValueError) naming the dimension that does not fit.
    #[pyo3(signature = (tokens_per_block, num_layers = None))]
    fn trtllm_pool_geometry(
        &self,
        tokens_per_block: usize,
        num_layers: Option<usize>,
    ) -> PyResult<std::collections::BTreeMap<&'static str, usize>> {
        let g = self.trtllm_pool(tokens_per_block, num_layers)?;
        Ok([
            ("num_blocks", g.num_blocks),
            ("num_layers", g.num_layers),
            ("kv_factor", g.kv_factor),
            ("bytes_per_plane", g.bytes_per_plane),
            ("bytes_per_block", g.bytes_per_block),
        ]
        .into_iter()
        .collect())
    }

    #[getter]
    fn device(&self) -> &'static str {
        self.device.as_str()
    }

    /// Total bytes spanned by the elements (0 for an empty tensor).
    #[getter]
    fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.itemsize
    }

    fn __repr__(&self) -> String {
        format!(
            "TensorDesc(data_ptr=0x{:x}, shape={:?}, strides={:?}, itemsize={}, dtype={:?}, device=\"{}:{}\")",
            self.data_ptr,
            self.shape,
            self.strides,
            self.itemsize,
            self.dtype,
            self.device.as_str(),
            self.device_index
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(shape: Vec<usize>, itemsize: usize) -> TensorDesc {
        TensorDesc {
            data_ptr: 0x1000,
            strides: TensorDesc::contiguous_strides(&shape, itemsize),
            shape,
            itemsize,
            dtype: "bfloat16".into(),
            device: DeviceKind::Cuda,
            device_index: 0,
        }
    }

    #[test]
    fn trtllm_pool_geometry() {
        // 10 blocks, 4 layers, K/V, 16 tokens * 2 heads * 8 dims, bf16.
        let g = pool(vec![10, 4, 2, 256], 2)
            .trtllm_pool(16, Some(4))
            .unwrap();
        assert_eq!(g.num_blocks, 10);
        assert_eq!(g.bytes_per_plane, 512);
        assert_eq!(g.bytes_per_block, 512 * 2 * 4);
    }

    #[test]
    fn trtllm_pool_rejects_mismatches() {
        let err = |d: TensorDesc, tpb, layers| d.trtllm_pool(tpb, layers).unwrap_err().to_string();
        assert!(err(pool(vec![10, 4, 256], 2), 16, None).contains("3 dimensions"));
        assert!(err(pool(vec![10, 4, 3, 256], 2), 16, None).contains("kv_factor"));
        assert!(err(pool(vec![10, 4, 2, 250], 2), 16, None).contains("tokens_per_block 16"));
        assert!(err(pool(vec![10, 4, 2, 256], 2), 16, Some(5)).contains("model has 5 layers"));
        let mut strided = pool(vec![10, 4, 2, 256], 2);
        strided.strides[0] *= 2;
        assert!(err(strided, 16, None).contains("stride of dim 0"));
        let mut lengths = pool(vec![10, 4, 2, 256], 2);
        lengths.strides.pop();
        assert!(err(lengths, 16, None).contains("strides has 3"));
    }
}
