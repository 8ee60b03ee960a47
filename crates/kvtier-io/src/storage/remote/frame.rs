//! The on-the-wire (and on-disk) format of one remote value: a fixed 40-byte header followed by
//! the block's bytes.
//!
//! ```text
//! offset size field
//!      0    4 magic        b"KVT4"
//!      4    2 version      2 (little-endian)
//!      6    2 flags        0; 2 = keyed (the tag is a MAC); 1 = keyed with HMAC-SHA256 (written
//!                          by kvtier before BLAKE3, read as a miss); other bits are rejected
//!      8    8 payload_len  bytes of payload (little-endian)
//!     16   16 key          the 128-bit sequence hash the value was stored under (little-endian)
//!     32    8 tag          xxh3-64, seeded by the namespace, of bytes 0..32 || payload;
//!                          keyed: the first 8 bytes of keyed BLAKE3 (key derived from the secret
//!                          with BLAKE3's KDF) of namespace || bytes 0..32 || payload
//!     40    n payload
//! ```
//!
//! Invariants:
//! - [`decode_into`] and [`check_header`] + [`verify_payload`] accept a value only if the magic,
//!   version, flags, key, length and tag all match; otherwise they return the [`RemoteError`] that
//!   says why (missing bytes -> `Short`, other length -> `SizeMismatch`, a value of an older format
//!   version -> `Missing`, anything else -> `Corrupt`).
//! - The tag covers the key, the length and the format fields as well as the payload, and is seeded
//!   by the namespace ([`FrameSeal`]): a value copied from another key, with its key field patched,
//!   or from another namespace (another model or tenant), fails verification. Format version 1
//!   checksummed the payload only, which accepted exactly that forgery; version-1 values are
//!   therefore never trusted and read as a clean miss (they are overwritten by the next store).
//! - Unkeyed, the tag is an integrity check, not a MAC: a writer that can store arbitrary values in
//!   the remote store can compute it. Keyed ([`FrameSeal::keyed`], `remote.mac_key_file`), the tag
//!   is a MAC under a secret the cluster's engines share, and the flags say so: a keyed store
//!   serves only values whose MAC verifies under its key; a value without the keyed flag (written
//!   by an unkeyed writer, or forged with a recomputed unkeyed tag) reads as a clean miss, never
//!   bytes; a keyed value whose MAC fails (another key, forged) is `Corrupt`.
use kvtier::hash::SequenceHash;
use kvtier::transfer::RemoteError;
use xxhash_rust::xxh3::Xxh3;

pub(crate) const MAGIC: [u8; 4] = *b"KVT4";
pub(crate) const FORMAT_VERSION: u16 = 2;
/// Bytes of the header that precedes every payload.
pub const HEADER_LEN: usize = 40;
/// Bytes of the header covered by the tag (everything before it).
const SEALED_LEN: usize = 32;
/// The flag of a value whose tag is a keyed MAC (keyed BLAKE3).
pub(crate) const FLAG_KEYED: u16 = 2;
/// The flag of a value keyed with HMAC-SHA256 by an earlier kvtier (3x slower: docs/bench/remote.md):
/// no longer verified, read as a miss and overwritten by the next put.
pub(crate) const FLAG_KEYED_HMAC: u16 = 1;
/// BLAKE3's key-derivation context of the MAC key (its documentation: a hard-coded, unique string).
const MAC_KEY_CONTEXT: &str = "kvtier 2026-12 remote frame v2 MAC key";
/// The shortest MAC key accepted.
pub const MIN_MAC_KEY_LEN: usize = 16;

/// What a value's tag is bound to besides its key: the namespace it is stored in, and, keyed, a
/// secret.
#[derive(Clone)]
pub struct FrameSeal {
    seed: u64,
    /// Keyed BLAKE3 state after the namespace (keyed seals only).
    mac: Option<blake3::Hasher>,
}

impl std::fmt::Debug for FrameSeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameSeal")
            .field("keyed", &self.mac.is_some())
            .finish_non_exhaustive()
    }
}

impl FrameSeal {
    /// The seal of values stored in `namespace`.
    pub fn for_namespace(namespace: &str) -> Self {
        let mut h = Xxh3::new();
        h.update(b"kvtier remote frame v2\0");
        h.update(namespace.as_bytes());
        FrameSeal {
            seed: h.digest(),
            mac: None,
        }
    }

    /// The seal of values stored in `namespace` whose tag is a MAC under `secret` (at least
    /// [`MIN_MAC_KEY_LEN`] bytes).
    pub fn keyed(namespace: &str, secret: &[u8]) -> Result<Self, RemoteError> {
        if secret.len() < MIN_MAC_KEY_LEN {
            return Err(RemoteError::Config(format!(
                "the remote MAC key has {} bytes, at least {MIN_MAC_KEY_LEN} are needed",
                secret.len()
            )));
        }
        let mut mac = blake3::Hasher::new_keyed(&blake3::derive_key(MAC_KEY_CONTEXT, secret));
        mac.update(namespace.as_bytes());
        mac.update(b"\0");
        Ok(FrameSeal {
            mac: Some(mac),
            ..Self::for_namespace(namespace)
        })
    }

    /// Whether the tag is a keyed MAC.
    pub fn is_keyed(&self) -> bool {
        self.mac.is_some()
    }

    /// The header a store writes before `payload` under `key` (the tag pass over the payload
    /// included): what a put costs beyond the copy, measured by `benches/remote.rs`.
    pub fn header(&self, key: u128, payload: &[u8]) -> [u8; HEADER_LEN] {
        encode_header(self, key, payload)
    }

    fn flags(&self) -> u16 {
        if self.is_keyed() {
            FLAG_KEYED
        } else {
            0
        }
    }

    fn tag(&self, sealed: &[u8], payload: &[u8]) -> u64 {
        if let Some(mac) = &self.mac {
            let mut m = mac.clone();
            m.update(sealed);
            m.update(payload);
            let mut t = [0u8; 8];
            t.copy_from_slice(&m.finalize().as_bytes()[..8]);
            return u64::from_le_bytes(t);
        }
        let mut h = Xxh3::with_seed(self.seed);
        h.update(sealed);
        h.update(payload);
        h.digest()
    }
}

/// The header of one value, as built by [`encode_header`].
pub(crate) fn encode_header(seal: &FrameSeal, key: u128, payload: &[u8]) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[6..8].copy_from_slice(&seal.flags().to_le_bytes());
    h[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    h[16..32].copy_from_slice(&key.to_le_bytes());
    let tag = seal.tag(&h[..SEALED_LEN], payload);
    h[32..40].copy_from_slice(&tag.to_le_bytes());
    h
}

/// A header that passed [`check_header`]; carries what the payload's tag must match.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CheckedHeader {
    sealed: [u8; SEALED_LEN],
    tag: u64,
}

fn field<const N: usize>(h: &[u8; HEADER_LEN], at: usize) -> [u8; N] {
    let mut b = [0u8; N];
    b.copy_from_slice(&h[at..at + N]);
    b
}

/// Validates a header read for `key` when the caller expects a payload of `expected_len` bytes,
/// for a store sealed with `seal`.
pub(crate) fn check_header(
    seal: &FrameSeal,
    key: u128,
    h: &[u8; HEADER_LEN],
    expected_len: usize,
) -> Result<CheckedHeader, RemoteError> {
    let corrupt = |reason: String| RemoteError::Corrupt {
        key: SequenceHash(key),
        reason,
    };
    if field::<4>(h, 0) != MAGIC {
        return Err(corrupt(format!("bad magic {:02x?}", &h[0..4])));
    }
    let version = u16::from_le_bytes(field(h, 4));
    if version == 1 {
        // Written by an older kvtier whose checksum did not bind the key: never trusted.
        tracing::debug!(
            key = format_args!("{key:032x}"),
            "remote value of format version 1 ignored"
        );
        return Err(RemoteError::Missing {
            key: SequenceHash(key),
        });
    }
    if version != FORMAT_VERSION {
        return Err(corrupt(format!("unknown format version {version}")));
    }
    let flags = u16::from_le_bytes(field(h, 6));
    if flags & !(FLAG_KEYED | FLAG_KEYED_HMAC) != 0 || flags == FLAG_KEYED | FLAG_KEYED_HMAC {
        return Err(corrupt(format!("unknown flags {flags:#06x}")));
    }
    if flags != seal.flags() {
        // Keyed store, unkeyed value (an unkeyed writer, or a forgery with a recomputed unkeyed
        // tag): never trusted. Unkeyed store, keyed value, or a value keyed with the retired
        // HMAC: it cannot be verified here. Either way a miss, overwritten by the next put.
        tracing::debug!(
            key = format_args!("{key:032x}"),
            flags,
            "remote value sealed otherwise (keyed or not) ignored"
        );
        return Err(RemoteError::Missing {
            key: SequenceHash(key),
        });
    }
    let stored_key = u128::from_le_bytes(field(h, 16));
    if stored_key != key {
        return Err(corrupt(format!("value belongs to key {stored_key:032x}")));
    }
    let len = u64::from_le_bytes(field(h, 8));
    if len != expected_len as u64 {
        return Err(RemoteError::SizeMismatch {
            key: SequenceHash(key),
            expected: expected_len,
            stored: usize::try_from(len).unwrap_or(usize::MAX),
        });
    }
    Ok(CheckedHeader {
        sealed: field(h, 0),
        tag: u64::from_le_bytes(field(h, 32)),
    })
}

/// Checks the header's fields and `payload` against the tag of an already checked header.
pub(crate) fn verify_payload(
    seal: &FrameSeal,
    key: u128,
    header: CheckedHeader,
    payload: &[u8],
) -> Result<(), RemoteError> {
    let actual = seal.tag(&header.sealed, payload);
    if actual != header.tag {
        return Err(RemoteError::Corrupt {
            key: SequenceHash(key),
            reason: format!(
                "tag mismatch (payload, key or namespace): stored {:016x}, computed {actual:016x}",
                header.tag
            ),
        });
    }
    Ok(())
}

/// Decodes a whole value (`header || payload`) stored under `key` into `out`, which must be exactly
/// the block size. On error `out` may hold some of the value's bytes; they must not be used.
pub(crate) fn decode_into(
    seal: &FrameSeal,
    key: u128,
    value: &[u8],
    out: &mut [u8],
) -> Result<(), RemoteError> {
    let expected_total = HEADER_LEN + out.len();
    let Some((head, payload)) = value.split_first_chunk::<HEADER_LEN>() else {
        return Err(RemoteError::Short {
            key: SequenceHash(key),
            expected: expected_total,
            got: value.len(),
        });
    };
    let header = check_header(seal, key, head, out.len())?;
    if payload.len() < out.len() {
        return Err(RemoteError::Short {
            key: SequenceHash(key),
            expected: expected_total,
            got: value.len(),
        });
    }
    if payload.len() > out.len() {
        return Err(RemoteError::Corrupt {
            key: SequenceHash(key),
            reason: format!("{} trailing bytes", payload.len() - out.len()),
        });
    }
    verify_payload(seal, key, header, payload)?;
    out.copy_from_slice(payload);
    Ok(())
}

/// Decodes `value` as `decode_into` does, for a store in `namespace`; for tests and fuzzing.
pub fn decode_value(
    namespace: &str,
    key: u128,
    value: &[u8],
    out: &mut [u8],
) -> Result<(), RemoteError> {
    decode_into(&FrameSeal::for_namespace(namespace), key, value, out)
}

/// Encodes a whole value (`header || payload`) into one buffer, exactly as the backends store it
/// in `namespace`.
pub fn encode_value(namespace: &str, key: u128, payload: &[u8]) -> Vec<u8> {
    let seal = FrameSeal::for_namespace(namespace);
    let mut v = Vec::with_capacity(HEADER_LEN + payload.len());
    v.extend_from_slice(&encode_header(&seal, key, payload));
    v.extend_from_slice(payload);
    v
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const KEY: u128 = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210;
    const NS: &str = "test-ns";

    fn payload(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    fn decode(key: u128, v: &[u8], out: &mut [u8]) -> Result<(), RemoteError> {
        decode_value(NS, key, v, out)
    }

    #[test]
    fn round_trip_is_bit_exact() {
        let p = payload(4096);
        let v = encode_value(NS, KEY, &p);
        assert_eq!(v.len(), HEADER_LEN + 4096);
        let mut out = vec![0u8; 4096];
        decode(KEY, &v, &mut out).unwrap();
        assert_eq!(out, p);
    }

    #[test]
    fn empty_payload_round_trips() {
        let v = encode_value(NS, KEY, &[]);
        decode(KEY, &v, &mut []).unwrap();
    }

    #[test]
    fn every_flipped_bit_is_rejected() {
        let p = payload(64);
        let v = encode_value(NS, KEY, &p);
        for byte in 0..v.len() {
            for bit in 0..8 {
                let mut bad = v.clone();
                bad[byte] ^= 1 << bit;
                let mut out = vec![0u8; 64];
                let r = decode(KEY, &bad, &mut out);
                assert!(r.is_err(), "flip of byte {byte} bit {bit} was accepted");
            }
        }
    }

    #[test]
    fn truncation_is_short() {
        let p = payload(100);
        let v = encode_value(NS, KEY, &p);
        let mut out = vec![0u8; 100];
        for cut in [0, 1, HEADER_LEN - 1, HEADER_LEN, HEADER_LEN + 99] {
            match decode(KEY, &v[..cut], &mut out) {
                Err(RemoteError::Short { key, expected, got }) => {
                    assert_eq!(
                        (key, expected, got),
                        (SequenceHash(KEY), HEADER_LEN + 100, cut)
                    );
                }
                other => panic!("cut at {cut}: {other:?}"),
            }
        }
    }

    #[test]
    fn wrong_block_size_and_trailing_bytes() {
        let v = encode_value(NS, KEY, &payload(100));
        let mut small = vec![0u8; 99];
        assert_eq!(
            decode(KEY, &v, &mut small),
            Err(RemoteError::SizeMismatch {
                key: SequenceHash(KEY),
                expected: 99,
                stored: 100
            })
        );
        let mut long = v.clone();
        long.push(0);
        let mut out = vec![0u8; 100];
        assert!(matches!(
            decode(KEY, &long, &mut out),
            Err(RemoteError::Corrupt { .. })
        ));
    }

    #[test]
    fn value_of_another_key_is_rejected() {
        let v = encode_value(NS, KEY, &payload(10));
        let mut out = vec![0u8; 10];
        let r = decode(KEY + 1, &v, &mut out);
        assert!(
            matches!(&r, Err(RemoteError::Corrupt { reason, .. }) if reason.contains("belongs to")),
            "{r:?}"
        );
    }

    /// Regression (#13, forged remote values): a value copied from another block with its 16-byte
    /// key field patched to the victim key was accepted, because the checksum covered the payload
    /// only.
    #[test]
    fn copied_value_with_patched_key_field_is_rejected() {
        let other = KEY ^ 0xff;
        let mut forged = encode_value(NS, other, &payload(256));
        forged[16..32].copy_from_slice(&KEY.to_le_bytes());
        let mut out = vec![0u8; 256];
        let r = decode(KEY, &forged, &mut out);
        assert!(
            matches!(&r, Err(RemoteError::Corrupt { reason, .. }) if reason.contains("tag mismatch")),
            "{r:?}"
        );
    }

    /// A value stored by another namespace (model, tenant) under the same sequence hash is not
    /// accepted in this one.
    #[test]
    fn value_of_another_namespace_is_rejected() {
        let v = encode_value("other-ns", KEY, &payload(32));
        let mut out = vec![0u8; 32];
        assert!(matches!(
            decode(KEY, &v, &mut out),
            Err(RemoteError::Corrupt { .. })
        ));
    }

    /// Format version 1 (payload-only checksum) values are a clean miss, never served.
    #[test]
    fn version_1_value_is_a_miss() {
        let p = payload(48);
        let mut v = Vec::new();
        v.extend_from_slice(&MAGIC);
        v.extend_from_slice(&1u16.to_le_bytes());
        v.extend_from_slice(&0u16.to_le_bytes());
        v.extend_from_slice(&(p.len() as u64).to_le_bytes());
        v.extend_from_slice(&KEY.to_le_bytes());
        v.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(&p).to_le_bytes());
        v.extend_from_slice(&p);
        let mut out = vec![0u8; 48];
        assert_eq!(
            decode(KEY, &v, &mut out),
            Err(RemoteError::Missing {
                key: SequenceHash(KEY)
            })
        );
        assert_eq!(out, vec![0u8; 48]);
    }

    const SECRET: &[u8] = b"0123456789abcdef-cluster-secret";

    fn keyed() -> FrameSeal {
        FrameSeal::keyed(NS, SECRET).unwrap()
    }

    fn encode_with(seal: &FrameSeal, key: u128, p: &[u8]) -> Vec<u8> {
        let mut v = encode_header(seal, key, p).to_vec();
        v.extend_from_slice(p);
        v
    }

    /// Regression (#28): whoever could write to the store could forge a block by recomputing the
    /// unkeyed tag (16/16 tokens changed). Keyed, a frame with a recomputed unkeyed tag reads as
    /// a miss, one with the keyed flag but a tag not made with the key is corrupt, and a frame
    /// of another key is corrupt; the genuine frame round-trips.
    #[test]
    fn keyed_seal_refuses_frames_made_without_the_key() {
        let seal = keyed();
        let p = payload(512);
        let good = encode_with(&seal, KEY, &p);
        let mut out = vec![0u8; 512];
        decode_into(&seal, KEY, &good, &mut out).unwrap();
        assert_eq!(out, p);

        let mut evil = p.clone();
        evil[0] ^= 0xff;
        let forged = encode_value(NS, KEY, &evil);
        assert_eq!(
            decode_into(&seal, KEY, &forged, &mut out),
            Err(RemoteError::Missing {
                key: SequenceHash(KEY)
            })
        );
        let mut flagged = forged.clone();
        flagged[6..8].copy_from_slice(&FLAG_KEYED.to_le_bytes());
        let unkeyed = FrameSeal::for_namespace(NS);
        let tag = unkeyed.tag(&flagged[..SEALED_LEN], &evil);
        flagged[32..40].copy_from_slice(&tag.to_le_bytes());
        assert!(matches!(
            decode_into(&seal, KEY, &flagged, &mut out),
            Err(RemoteError::Corrupt { .. })
        ));
        let other = FrameSeal::keyed(NS, b"another-secret-of-the-same-length").unwrap();
        assert!(matches!(
            decode_into(&seal, KEY, &encode_with(&other, KEY, &evil), &mut out),
            Err(RemoteError::Corrupt { .. })
        ));
        // An unkeyed store cannot verify a keyed value: a miss.
        assert_eq!(
            decode_into(&unkeyed, KEY, &good, &mut out),
            Err(RemoteError::Missing {
                key: SequenceHash(KEY)
            })
        );
        // A value of the retired HMAC-SHA256 seal: a miss, not bytes and not damage.
        let mut legacy = good.clone();
        legacy[6..8].copy_from_slice(&FLAG_KEYED_HMAC.to_le_bytes());
        assert_eq!(
            decode_into(&seal, KEY, &legacy, &mut out),
            Err(RemoteError::Missing {
                key: SequenceHash(KEY)
            })
        );
        legacy[6..8].copy_from_slice(&3u16.to_le_bytes());
        assert!(matches!(
            decode_into(&seal, KEY, &legacy, &mut out),
            Err(RemoteError::Corrupt { .. })
        ));
        assert!(FrameSeal::keyed(NS, b"short").is_err());
        assert!(!format!("{seal:?}").contains("cluster-secret"));
    }
}
