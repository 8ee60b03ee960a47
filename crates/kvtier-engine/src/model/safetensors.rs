//! A minimal safetensors reader: header parsing and F32/BF16/F16 -> f32 conversion.
//!
//! Invariant: a tensor is returned only if its dtype is known, its byte range lies inside the
//! file's data section and its length equals the product of its shape times the element size;
//! anything else is a `ModelError::Weights` naming the tensor.
use std::collections::HashMap;

use serde::Deserialize;

use crate::model::ModelError;

#[derive(Deserialize)]
struct Entry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [usize; 2],
}

/// One parsed safetensors file held in memory.
pub struct SafeTensors {
    data: Vec<u8>,
    data_start: usize,
    entries: HashMap<String, Entry>,
}

impl SafeTensors {
    /// Parse a `.safetensors` file (`what` names it in errors).
    pub fn parse(data: Vec<u8>, what: &str) -> Result<Self, ModelError> {
        let err = |r: String| ModelError::Weights(format!("{what}: {r}"));
        if data.len() < 8 {
            return Err(err("file shorter than its 8-byte header length".into()));
        }
        let mut len_bytes = [0u8; 8];
        len_bytes.copy_from_slice(&data[..8]);
        let hlen = u64::from_le_bytes(len_bytes) as usize;
        let data_start = 8usize
            .checked_add(hlen)
            .filter(|&e| e <= data.len())
            .ok_or_else(|| err(format!("header length {hlen} exceeds the file")))?;
        let header: HashMap<String, serde_json::Value> =
            serde_json::from_slice(&data[8..data_start])
                .map_err(|e| err(format!("header: {e}")))?;
        let mut entries = HashMap::new();
        for (name, v) in header {
            if name == "__metadata__" {
                continue;
            }
            let e: Entry =
                serde_json::from_value(v).map_err(|e| err(format!("tensor {name}: {e}")))?;
            entries.insert(name, e);
        }
        Ok(SafeTensors {
            data,
            data_start,
            entries,
        })
    }

    /// The tensor names of the file.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(|s| s.as_str())
    }

    /// The tensor `name` as f32, checked against `shape`.
    pub fn get_f32(&self, name: &str, shape: &[usize]) -> Result<Option<Vec<f32>>, ModelError> {
        let Some(e) = self.entries.get(name) else {
            return Ok(None);
        };
        let err = |r: String| ModelError::Weights(format!("tensor {name}: {r}"));
        if e.shape != shape {
            return Err(err(format!("shape {:?}, expected {:?}", e.shape, shape)));
        }
        let n: usize = shape.iter().product();
        let esize = match e.dtype.as_str() {
            "F32" => 4,
            "BF16" | "F16" => 2,
            other => return Err(err(format!("dtype {other} not supported (F32, BF16, F16)"))),
        };
        let [s, t] = e.data_offsets;
        let (s, t) = (self.data_start + s, self.data_start + t);
        if s > t || t > self.data.len() || t - s != n * esize {
            return Err(err(format!(
                "data range {:?} does not hold {n} x {esize} bytes",
                e.data_offsets
            )));
        }
        let bytes = &self.data[s..t];
        let out = match e.dtype.as_str() {
            "F32" => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            "BF16" => bytes
                .chunks_exact(2)
                .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
                .collect(),
            _ => bytes
                .chunks_exact(2)
                .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
        };
        Ok(Some(out))
    }
}

/// IEEE half -> single, exact (every f16 is representable as f32).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // subnormal: normalise
            let mut e: i32 = -14;
            let mut m = m;
            while m & 0x400 == 0 {
                m <<= 1;
                e -= 1;
            }
            sign | (((e + 127) as u32) << 23) | ((m & 0x3ff) << 13)
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// Serialise f32 tensors into a safetensors file image (used by tests and tools).
pub fn write_f32(tensors: &[(&str, Vec<usize>, &[f32])]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    for (name, shape, data) in tensors {
        let len = data.len() * 4;
        header.insert(
            (*name).to_owned(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [off, off + len]}),
        );
        off += len;
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + off);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    for (_, _, data) in tensors {
        for v in *data {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_f32() {
        let a = [1.5f32, -2.0, 3.25, 0.0, 7.0, 8.0];
        let img = write_f32(&[("a", vec![2, 3], &a)]);
        let st = SafeTensors::parse(img, "t").unwrap();
        assert_eq!(st.get_f32("a", &[2, 3]).unwrap().unwrap(), a.to_vec());
        assert!(st.get_f32("missing", &[1]).unwrap().is_none());
        assert!(matches!(
            st.get_f32("a", &[3, 2]),
            Err(ModelError::Weights(_))
        ));
    }

    #[test]
    fn truncated_file_is_an_error() {
        let a = [1.0f32; 4];
        let mut img = write_f32(&[("a", vec![4], &a)]);
        img.truncate(img.len() - 3);
        let st = SafeTensors::parse(img, "t").unwrap();
        assert!(matches!(st.get_f32("a", &[4]), Err(ModelError::Weights(_))));
        assert!(SafeTensors::parse(vec![1, 2, 3], "t").is_err());
    }

    #[test]
    fn f16_conversion_known_values() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert!(f16_to_f32(0x7c00).is_infinite());
    }
}
