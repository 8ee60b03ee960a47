//! Tensor descriptors: what kvtier needs to know about an engine-owned tensor (address, shape,
//! strides in bytes, element size, dtype, device), as Python hands them over, and their
//! conversion into the core's `kvtier::layout::TensorDesc` (strides in elements).
//!
//! Invariants: a descriptor's own fields agree (as many strides as dimensions, a positive element
//! size, a non-null address for a non-empty tensor); whether tensors fit an engine layout is
//! decided by the core's `DeviceLayout` alone, whose errors name the tensor and the mismatch (a
//! `LayoutError`, also a `ValueError` in Python). A descriptor made by `kvtier.describe(obj)` holds
//! `obj` (its [`Owner`]): the Worker registers the tensors' bytes with kvtier-io's checked
//! `EngineMemory::from_tensors`, which keeps the owners alive while the transfer engine lives. A
//! descriptor built from raw integers (TensorRT-LLM's `KvCacheLayout` regions) has no owner: the
//! engine keeps that memory (TensorRT-LLM and vLLM keep their caches for the process lifetime).
use std::sync::Arc;

use pyo3::prelude::*;

use kvtier::layout::{self, DType, DeviceLayout, EngineLayoutKind};

use crate::errors::{BridgeError, BridgeResult, Family};

/// Where a tensor's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// Host memory (a CPU tensor or a numpy array).
    Cpu,
    /// CUDA device memory (its ordinal is `TensorDesc::device_index`).
    Cuda,
}

impl DeviceKind {
    /// The Python-side name (`"cpu"`, `"cuda"`); `None` for any other device.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "cpu" => Some(DeviceKind::Cpu),
            "cuda" => Some(DeviceKind::Cuda),
            _ => None,
        }
    }
    /// The Python-side name, [`DeviceKind::parse`]'s inverse.
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        }
    }
}

/// The Python object a descriptor was made from (a torch tensor, a numpy or CUDA array), held so
/// the memory it owns stays allocated while kvtier copies into it. Equal only to itself.
#[derive(Clone)]
pub struct Owner(Arc<Py<PyAny>>);

impl Owner {
    /// Holds `obj`.
    pub fn new(obj: Py<PyAny>) -> Self {
        Owner(Arc::new(obj))
    }
    /// The keep-alive kvtier-io's `TensorMemory` holds.
    pub fn keep_alive(&self) -> kvtier_io::transfer::memory::KeepAlive {
        self.0.clone()
    }
}

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Owner(..)")
    }
}

impl PartialEq for Owner {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
impl Eq for Owner {}

/// A plain description of one tensor. Built in Python by `kvtier._tensors.describe(obj)` from a
/// torch tensor, a numpy array (`__array_interface__`) or a CUDA array (`__cuda_array_interface__`).
#[pyclass(frozen, module = "kvtier._native", from_py_object)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    /// Address of element `[0, 0, ...]`.
    #[pyo3(get)]
    pub data_ptr: u64,
    /// Extent of each dimension, outermost first.
    #[pyo3(get)]
    pub shape: Vec<usize>,
    /// Strides in BYTES (numpy convention; torch's element strides times the element size).
    #[pyo3(get)]
    pub strides: Vec<i64>,
    /// Bytes per element.
    #[pyo3(get)]
    pub itemsize: usize,
    /// Element type name, e.g. "bfloat16", "float16", "float32", "uint8", "float8_e4m3fn".
    #[pyo3(get)]
    pub dtype: String,
    /// Where the memory lives.
    pub device: DeviceKind,
    /// CUDA ordinal; 0 for CPU.
    #[pyo3(get)]
    pub device_index: u32,
    /// The object described, kept alive by a Worker registered over it; `None` for a descriptor
    /// of memory the engine keeps by itself.
    pub owner: Option<Owner>,
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
        // #28: a bogus pointer reached the transfer engine; an unaligned one is refused here.
        if !self.data_ptr.is_multiple_of(self.itemsize as u64) {
            return bad(format!(
                "data pointer 0x{:x} is not aligned to the element size {}",
                self.data_ptr, self.itemsize
            ));
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

    /// The core's descriptor of this tensor (strides in elements), named `name`.
    pub fn to_core(&self, name: &str) -> BridgeResult<layout::TensorDesc> {
        self.validate(name)?;
        let mut strides = Vec::with_capacity(self.strides.len());
        for (dim, s) in self.strides.iter().enumerate() {
            if *s < 0 || !(*s as usize).is_multiple_of(self.itemsize) {
                return Err(BridgeError::local(
                    Family::Layout,
                    format!(
                        "tensor {name}: stride of dim {dim} is {s} bytes, not a non-negative multiple of the element size {}",
                        self.itemsize
                    ),
                ));
            }
            strides.push(*s as usize / self.itemsize);
        }
        Ok(layout::TensorDesc {
            name: name.to_string(),
            data_ptr: self.data_ptr,
            shape: self.shape.clone(),
            strides,
            elem_size: self.itemsize,
            device: match self.device {
                DeviceKind::Cpu => layout::DeviceKind::Cpu,
                DeviceKind::Cuda => layout::DeviceKind::Cuda(self.device_index),
            },
        })
    }

    /// The element type, by name (`dtype` overrides the descriptor's own).
    pub fn dtype(&self, dtype: Option<&str>) -> BridgeResult<DType> {
        let name = dtype.unwrap_or(&self.dtype);
        DType::parse(name).ok_or_else(|| {
            BridgeError::local(
                Family::Layout,
                format!("dtype {name:?} is not a KV cache type kvtier knows"),
            )
        })
    }

    /// This tensor as TensorRT-LLM's primary pool with `tokens_per_block` tokens per block.
    pub fn trtllm_layout(&self, tokens_per_block: usize) -> BridgeResult<DeviceLayout> {
        let core = self.to_core("kv_cache_tensor")?;
        Ok(DeviceLayout::new(
            EngineLayoutKind::TrtllmPool { tokens_per_block },
            &[core],
            self.dtype(None)?,
        )?)
    }
}

#[pymethods]
impl TensorDesc {
    #[new]
    #[pyo3(signature = (data_ptr, shape, strides, itemsize, dtype, device = "cpu", device_index = None, owner = None))]
    #[allow(clippy::too_many_arguments)]
    fn py_new(
        data_ptr: &Bound<'_, PyAny>,
        shape: &Bound<'_, PyAny>,
        strides: &Bound<'_, PyAny>,
        itemsize: &Bound<'_, PyAny>,
        dtype: String,
        device: &str,
        device_index: Option<&Bound<'_, PyAny>>,
        owner: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        // Negative or oversized numbers are LayoutErrors naming the argument (a bare
        // OverflowError before); sequences are read with a bound (`crate::seq`).
        let l = Family::Layout;
        let data_ptr: u64 = crate::errors::extract_arg(l, "data_ptr", data_ptr)?;
        let shape: Vec<usize> = crate::seq::extract_seq(l, "shape", shape)?;
        let strides: Vec<i64> = crate::seq::extract_seq(l, "strides", strides)?;
        let itemsize: usize = crate::errors::extract_arg(l, "itemsize", itemsize)?;
        let device_index: u32 =
            crate::errors::extract_opt_arg(l, "device_index", device_index)?.unwrap_or(0);
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
            owner: owner.map(Owner::new),
        };
        desc.validate("tensor")?;
        Ok(desc)
    }

    /// Byte strides of a C-contiguous tensor of `shape` with elements of `itemsize` bytes.
    #[staticmethod]
    #[pyo3(name = "contiguous_strides")]
    fn py_contiguous_strides(
        shape: &Bound<'_, PyAny>,
        itemsize: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<i64>> {
        let shape: Vec<usize> = crate::seq::extract_seq(Family::Layout, "shape", shape)?;
        let itemsize: usize = crate::errors::extract_arg(Family::Layout, "itemsize", itemsize)?;
        Ok(Self::contiguous_strides(&shape, itemsize))
    }

    /// Checks this as TensorRT-LLM's primary pool tensor and returns its geometry as a dict
    /// (num_blocks, num_layers, kv_factor, bytes_per_plane, bytes_per_block). Raises LayoutError
    /// (a ValueError) naming the mismatch, also when `num_layers` is given and differs.
    #[pyo3(signature = (tokens_per_block, num_layers = None))]
    fn trtllm_pool_geometry(
        &self,
        tokens_per_block: usize,
        num_layers: Option<usize>,
    ) -> PyResult<std::collections::BTreeMap<&'static str, usize>> {
        let dl = self.trtllm_layout(tokens_per_block)?;
        let g = dl.geometry();
        if let Some(expected) = num_layers {
            if g.num_layers != expected {
                return Err(BridgeError::local(
                    Family::Layout,
                    format!(
                        "tensor kv_cache_tensor: num_layers (dim 1) is {} but the model has {expected} layers",
                        g.num_layers
                    ),
                )
                .into());
            }
        }
        Ok([
            ("num_blocks", dl.num_blocks()),
            ("num_layers", g.num_layers),
            ("kv_factor", g.kv_planes),
            ("bytes_per_plane", g.bytes_per_piece()),
            ("bytes_per_block", dl.bytes_per_block()),
        ]
        .into_iter()
        .collect())
    }

    #[getter]
    fn device(&self) -> &'static str {
        self.device.as_str()
    }

    /// Whether the descriptor holds the object it describes (see `owner` in `__init__`).
    #[getter]
    fn has_owner(&self) -> bool {
        self.owner.is_some()
    }

    /// Total bytes spanned by the elements (0 for an empty tensor); a shape whose bytes overflow
    /// 64 bits is a `LayoutError` (it panicked, and wrapped in release builds).
    #[getter]
    fn nbytes(&self) -> PyResult<usize> {
        if self.shape.contains(&0) {
            return Ok(0);
        }
        self.shape
            .iter()
            .try_fold(self.itemsize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| {
                crate::errors::new_err(
                    crate::errors::Family::Layout,
                    format!(
                        "shape {:?} of {}-byte items is more than 2**64 bytes",
                        self.shape, self.itemsize
                    ),
                )
            })
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
            owner: None,
        }
    }

    #[test]
    fn trtllm_pool_layout() {
        // 10 blocks, 4 layers, K/V, 16 tokens * 2 heads * 8 dims, bf16.
        let dl = pool(vec![10, 4, 2, 256], 2).trtllm_layout(16).unwrap();
        assert_eq!(dl.num_blocks(), 10);
        assert_eq!(dl.bytes_per_block(), 512 * 2 * 4);
    }

    #[test]
    fn descriptor_field_checks() {
        let mut d = pool(vec![10, 4, 2, 256], 2);
        d.strides.pop();
        assert!(d
            .to_core("t")
            .unwrap_err()
            .to_string()
            .contains("strides has 3"));
        let mut d = pool(vec![10, 4, 2, 256], 2);
        d.strides[0] = 3;
        assert!(d
            .to_core("t")
            .unwrap_err()
            .to_string()
            .contains("multiple of the element size"));
        let d = pool(vec![10, 4, 3, 256], 2);
        assert!(d
            .trtllm_layout(16)
            .unwrap_err()
            .to_string()
            .contains("kv_factor"));
        let mut d = pool(vec![10, 4, 2, 256], 2);
        d.data_ptr = 0x1001;
        assert!(d
            .to_core("t")
            .unwrap_err()
            .to_string()
            .contains("not aligned"));
        let mut d = pool(vec![10, 4, 2, 256], 2);
        d.data_ptr = 0;
        assert!(d.to_core("t").unwrap_err().to_string().contains("null"));
        let mut d = pool(vec![10, 4, 2, 256], 2);
        d.dtype = "complex64".into();
        assert!(d
            .trtllm_layout(16)
            .unwrap_err()
            .to_string()
            .contains("complex64"));
    }
}
