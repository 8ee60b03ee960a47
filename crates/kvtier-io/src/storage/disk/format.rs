//! The on-disk block format: each slot is one 4 KiB header page followed by the payload padded
//! to 4 KiB. The header binds the payload to its file set, its slot, its key (the block's
//! sequence hash) and the generation of the write.
//!
//! Invariant: `verify` accepts a slot only if the header's own checksum, magic, version, set id,
//! slot, key, generation and length all match what the reader expects and the payload's xxh3-64
//! (seeded with the generation) matches; anything torn, truncated, stale, foreign, flipped or
//! holding another key's block is rejected.
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

pub(crate) const HEADER_BYTES: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"KVTBLK02");
const VERSION: u32 = 2;
/// Bytes covered by the header checksum (which follows them).
const FIELDS: usize = 64;
/// Offset of the key field (tests patch it).
pub const KEY_OFFSET: usize = 48;

/// Header fields written in front of every block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub slot: u32,
    pub generation: u64,
    pub len: u64,
    pub payload_hash: u64,
    /// The file set the block was written into (foreign files carry another id).
    pub set_id: u64,
    /// The block's key: the sequence hash (per rank) it was stored under; 0 = unkeyed.
    pub key: u128,
}

pub(crate) fn payload_hash(payload: &[u8], generation: u64) -> u64 {
    xxh3_64_with_seed(payload, generation)
}

/// What a reader expects a slot to hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Expect {
    pub slot: u32,
    pub generation: u64,
    pub set_id: u64,
    pub key: u128,
    pub len: u64,
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
        out[40..48].copy_from_slice(&self.set_id.to_le_bytes());
        out[KEY_OFFSET..KEY_OFFSET + 16].copy_from_slice(&self.key.to_le_bytes());
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
        let mut k = [0u8; 16];
        k.copy_from_slice(&buf[KEY_OFFSET..KEY_OFFSET + 16]);
        Ok(Header {
            slot: u32_at(12),
            generation: u64_at(16),
            len: u64_at(24),
            payload_hash: u64_at(32),
            set_id: u64_at(40),
            key: u128::from_le_bytes(k),
        })
    }
}

/// Check a slot read back from disk against what the reader expects there.
pub(crate) fn verify(header_buf: &[u8], payload: &[u8], want: &Expect) -> Result<(), String> {
    let h = Header::decode(header_buf)?;
    if h.set_id != want.set_id {
        return Err(format!(
            "foreign data: file set {:#x} on disk, {:#x} expected (file replaced?)",
            h.set_id, want.set_id
        ));
    }
    if h.slot != want.slot {
        return Err(format!(
            "header names slot {}, expected {}",
            h.slot, want.slot
        ));
    }
    if h.key != want.key {
        return Err(format!(
            "header names key {:#034x}, expected {:#034x} (another block's data)",
            h.key, want.key
        ));
    }
    if h.generation != want.generation {
        return Err(format!(
            "stale data: generation {} on disk, {} expected (a write was lost)",
            h.generation, want.generation
        ));
    }
    if h.len != want.len || h.len != payload.len() as u64 {
        return Err(format!("length {} on disk, {} expected", h.len, want.len));
    }
    if payload_hash(payload, want.generation) != h.payload_hash {
        return Err("payload checksum mismatch (torn or corrupted data)".into());
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const KEY: u128 = 0x1234_5678_9abc_def0_0fed_cba9_8765_4321;

    fn want() -> Expect {
        Expect {
            slot: 3,
            generation: 9,
            set_id: 77,
            key: KEY,
            len: 10000,
        }
    }

    fn sample() -> (Vec<u8>, Vec<u8>) {
        let payload: Vec<u8> = (0..10000u32).map(|i| (i % 251) as u8).collect();
        let mut hdr = vec![0u8; HEADER_BYTES];
        Header {
            slot: 3,
            generation: 9,
            len: payload.len() as u64,
            payload_hash: payload_hash(&payload, 9),
            set_id: 77,
            key: KEY,
        }
        .encode(&mut hdr);
        (hdr, payload)
    }

    #[test]
    fn good_slot_verifies() {
        let (h, p) = sample();
        verify(&h, &p, &want()).unwrap();
    }

    #[test]
    fn every_kind_of_damage_is_rejected() {
        let (h, p) = sample();
        let w = want();
        let e = |x: Expect| verify(&h, &p, &x).unwrap_err();
        assert!(e(Expect { slot: 4, ..w }).contains("slot"));
        assert!(e(Expect { generation: 8, ..w }).contains("stale"));
        assert!(e(Expect { set_id: 78, ..w }).contains("foreign"));
        assert!(e(Expect { key: KEY ^ 1, ..w }).contains("key"));
        let mut p2 = p.clone();
        p2[5000] ^= 1;
        assert!(verify(&h, &p2, &w)
            .unwrap_err()
            .contains("payload checksum"));
        let mut h2 = h.clone();
        h2[20] ^= 0x80;
        assert!(verify(&h2, &p, &w).unwrap_err().contains("header checksum"));
        // A patched key field fails the header checksum too.
        let mut h3 = h.clone();
        h3[KEY_OFFSET] ^= 1;
        assert!(verify(&h3, &p, &w).unwrap_err().contains("header checksum"));
        assert!(verify(&h, &p[..9999], &w).is_err(), "length");
        assert!(
            verify(&vec![0u8; HEADER_BYTES], &p, &w).is_err(),
            "zeroed header"
        );
    }

    /// Regression (#13): a header re-sealed with another key (a block's bytes copied over
    /// another's slot by a buggy or hostile writer) is refused for the key it does not hold.
    #[test]
    fn resealed_header_with_another_key_is_refused() {
        let (mut h, p) = sample();
        let mut hd = Header::decode(&h).unwrap();
        hd.key = KEY ^ 0xff;
        hd.encode(&mut h);
        assert!(verify(&h, &p, &want())
            .unwrap_err()
            .contains("another block"));
    }
}
