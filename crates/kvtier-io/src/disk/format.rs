//! The on-disk block format: each slot is one 4 KiB header page followed by the payload padded
//! to 4 KiB. The header binds the payload to its slot and to the generation of the write.
//!
//! Invariant: `verify` accepts a slot only if the header's own checksum, magic, version, slot,
//! generation and length all match and the payload's xxh3-64 (seeded with the generation)
//! matches; anything torn, truncated, stale or flipped is rejected.
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

pub(crate) const HEADER_BYTES: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"KVTBLK01");
const VERSION: u32 = 1;
const FIELDS: usize = 48;

/// Header fields written in front of every block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub slot: u32,
    pub generation: u64,
    pub len: u64,
    pub payload_hash: u64,
}

pub(crate) fn payload_hash(payload: &[u8], generation: u64) -> u64 {
    xxh3_64_with_seed(payload, generation)
}

impl Header {
    pub(crate) fn encode(&self, out: &mut [u8]) {
        let n = HEADER_BYTES.min(out.len());
        out[..n].fill(0);
        out[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        out[8..12].copy_from_slice(&VERSION.to_le_bytes());
        out[12..16].copy_from_slice(&self.slot.to_le_bytes());
        out[16..24].copy_from_slice(&self.generation.to_le_bytes());
        out[24..32].copy_from_slice(&self.len.to_le_bytes());
        out[32..40].copy_from_slice(&self.payload_hash.to_le_bytes());
        // bytes 40..48 reserved (zero)
        let h = xxh3_64(&out[..FIELDS]);
        out[FIELDS..FIELDS + 8].copy_from_slice(&h.to_le_bytes());
    }

    pub(crate) fn decode(buf: &[u8]) -> Result<Header, String> {
        if buf.len() < FIELDS + 8 {
            return Err("header too short".into());
        }
        let u64_at = |o: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&buf[o..o + 8]);
            u64::from_le_bytes(b)
        };
        let u32_at = |o: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&buf[o..o + 4]);
            u32::from_le_bytes(b)
        };
        if u64_at(FIELDS) != xxh3_64(&buf[..FIELDS]) {
            return Err("header checksum mismatch (torn or corrupted header)".into());
        }
        if u64_at(0) != MAGIC {
            return Err("bad magic".into());
        }
        if u32_at(8) != VERSION {
            return Err(format!("unknown format version {}", u32_at(8)));
        }
        Ok(Header {
            slot: u32_at(12),
            generation: u64_at(16),
            len: u64_at(24),
            payload_hash: u64_at(32),
        })
    }
}

/// Check a slot read back from disk against what kvtier last wrote there.
pub(crate) fn verify(
    header_buf: &[u8],
    payload: &[u8],
    slot: u32,
    generation: u64,
) -> Result<(), String> {
    let h = Header::decode(header_buf)?;
    if h.slot != slot {
        return Err(format!("header names slot {}, expected {slot}", h.slot));
    }
    if h.generation != generation {
        return Err(format!(
            "stale data: generation {} on disk, {generation} expected (a write was lost)",
            h.generation
        ));
    }
    if h.len != payload.len() as u64 {
        return Err(format!(
            "length {} on disk, {} expected",
            h.len,
            payload.len()
        ));
    }
    if payload_hash(payload, generation) != h.payload_hash {
        return Err("payload checksum mismatch (torn or corrupted data)".into());
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn sample() -> (Vec<u8>, Vec<u8>) {
        let payload: Vec<u8> = (0..10000u32).map(|i| (i % 251) as u8).collect();
        let mut hdr = vec![0u8; HEADER_BYTES];
        Header {
            slot: 3,
            generation: 9,
            len: payload.len() as u64,
            payload_hash: payload_hash(&payload, 9),
        }
        .encode(&mut hdr);
        (hdr, payload)
    }

    #[test]
    fn good_slot_verifies() {
        let (h, p) = sample();
        verify(&h, &p, 3, 9).unwrap();
    }

    #[test]
    fn every_kind_of_damage_is_rejected() {
        let (h, p) = sample();
        assert!(verify(&h, &p, 4, 9).is_err(), "wrong slot");
        assert!(verify(&h, &p, 3, 8).is_err(), "stale generation");
        let mut p2 = p.clone();
        p2[5000] ^= 1;
        assert!(verify(&h, &p2, 3, 9)
            .unwrap_err()
            .contains("payload checksum"));
        let mut h2 = h.clone();
        h2[20] ^= 0x80;
        assert!(verify(&h2, &p, 3, 9)
            .unwrap_err()
            .contains("header checksum"));
        assert!(verify(&h, &p[..9999], 3, 9).is_err(), "length");
        assert!(
            verify(&vec![0u8; HEADER_BYTES], &p, 3, 9).is_err(),
            "zeroed header"
        );
    }
}
