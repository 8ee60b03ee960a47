//! Hash scheme v1: published test vectors (docs/arch/core.md) and the scheme's properties.
//!
//! The vectors were cross-checked against an independent implementation (Python's `xxhash`
//! package computing the same byte strings), so they pin the scheme, not just this code.
#![allow(clippy::unwrap_used)]
use kvtier::hash::{chain_block, sequence_hashes, HashSalt, SequenceHash, HASH_SCHEME_VERSION};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

#[test]
fn scheme_version_is_1() {
    assert_eq!(HASH_SCHEME_VERSION, 1);
}

#[test]
fn salt_vectors() {
    assert_eq!(HashSalt::new(MODEL, None, None).0, 0x719d_206b_0566_bf2c);
    assert_eq!(
        HashSalt::new(MODEL, Some("sql-adapter"), None).0,
        0xaa03_b592_438c_fbc7
    );
    assert_eq!(
        HashSalt::new(MODEL, None, Some("tenant-42")).0,
        0x0945_e6d4_9e8d_cd57
    );
    assert_eq!(HashSalt::new("", None, None).0, 0x1bc0_ebcc_2537_2358);
}

/// Per-request salts (`xxh3_64(b"kvtier-req-v1\0" || engine_salt_le8 || identity)`), checked
/// against Python's `xxhash` on the same bytes.
#[test]
fn request_salt_vectors() {
    let engine = HashSalt::new(MODEL, None, None);
    assert_eq!(
        engine.for_request("salt=tenant-42").0,
        0x7190_201e_35ba_2cc3
    );
    assert_eq!(
        engine.for_request("lora=sql-adapter").0,
        0x32b4_5ab8_a090_811a
    );
    // Even an empty identity is a key space of its own, apart from the engine salt.
    assert_eq!(engine.for_request("").0, 0xf33d_0813_906a_1796);
    assert_ne!(engine.for_request(""), engine);
}

#[test]
fn block_vectors() {
    let salt = HashSalt::new(MODEL, None, None);
    let tokens: Vec<u32> = (0..40).collect();
    // Two full blocks of 16; the 8-token tail has no hash.
    assert_eq!(
        sequence_hashes(salt, &tokens, 16),
        vec![
            SequenceHash(0xfcb8_8a3a_9e53_35a0_9421_7815_da13_827f),
            SequenceHash(0xb547_7307_df63_5a42_9f00_3763_aef6_445a),
        ]
    );
    let lora = HashSalt::new(MODEL, Some("sql-adapter"), None);
    assert_eq!(
        chain_block(None, lora, &tokens[..16]),
        SequenceHash(0x88db_8407_b1da_d5d7_062b_247d_249b_9a9e)
    );
    let tenant = HashSalt::new(MODEL, None, Some("tenant-42"));
    assert_eq!(
        chain_block(None, tenant, &tokens[..16]),
        SequenceHash(0xdc48_467d_4516_6666_44a2_43e6_1b51_4fc2)
    );
    // A 64-token block with high token ids and an explicit parent.
    let big: Vec<u32> = (0..64u32)
        .map(|i| 0xFFFF_FFF0u32.wrapping_add(i.wrapping_mul(0x0101_0101)))
        .collect();
    assert_eq!(
        chain_block(
            Some(SequenceHash(0x0123_4567_89ab_cdef_fedc_ba98_7654_3210)),
            salt,
            &big
        ),
        SequenceHash(0x35ae_d3f5_bf41_06c3_beaa_f7fe_4735_9c01)
    );
    // Block sizes above 64 take the allocating path; same scheme.
    let t65: Vec<u32> = (0..65).collect();
    assert_eq!(
        chain_block(None, salt, &t65),
        SequenceHash(0x3262_d59b_9cd8_fa7e_d94a_3a1b_d8e1_da09)
    );
    assert_eq!(
        chain_block(None, salt, &[128_000]),
        SequenceHash(0x3ebe_92e7_c529_f0d4_e270_6933_9430_86a4)
    );
}

#[test]
fn different_salts_never_share_a_block() {
    let tokens: Vec<u32> = (0..16 * 64).map(|i| i % 1000).collect();
    let salts = [
        HashSalt::new(MODEL, None, None),
        HashSalt::new(MODEL, Some("a"), None),
        HashSalt::new(MODEL, Some("b"), None),
        HashSalt::new(MODEL, None, Some("a")),
        HashSalt::new(MODEL, None, Some("b")),
        HashSalt::new("other-model", None, None),
    ];
    let mut all = std::collections::HashSet::new();
    for s in salts {
        for h in sequence_hashes(s, &tokens, 16) {
            assert!(all.insert(h), "hash shared across salts");
        }
    }
    assert_eq!(all.len(), salts.len() * 64);
    // LoRA name and cache salt are separate fields: swapping them changes the key space.
    assert_ne!(
        HashSalt::new(MODEL, Some("x"), None),
        HashSalt::new(MODEL, None, Some("x"))
    );
}

#[test]
fn chaining_identifies_the_whole_prefix() {
    let salt = HashSalt::new(MODEL, None, None);
    let a: Vec<u32> = (0..64).collect();
    let mut b = a.clone();
    b[3] = 999; // differs in block 0 only
    let ha = sequence_hashes(salt, &a, 16);
    let hb = sequence_hashes(salt, &b, 16);
    for i in 0..4 {
        assert_ne!(ha[i], hb[i], "block {i} must differ: its prefix differs");
    }
    // Same prefix, different tail tokens: the full blocks agree, the tail has no hash.
    let mut c = a.clone();
    c.extend([1, 2, 3]);
    assert_eq!(sequence_hashes(salt, &c, 16), ha);
    assert!(sequence_hashes(salt, &a, 0).is_empty());
    assert!(sequence_hashes(salt, &a[..15], 16).is_empty());
}

/// Every code path of `chain_block` (exact-size buffers for 16/32/64 tokens, the stack buffer,
/// the heap buffer) hashes exactly the bytes the scheme defines.
#[test]
fn every_block_size_hashes_the_defined_bytes() {
    use xxhash_rust::xxh3::xxh3_128_with_seed;
    let salt = HashSalt::new(MODEL, Some("l"), Some("t"));
    let parent = SequenceHash(0xfeed_beef_0000_1111_2222_3333_4444_5555);
    for n in 1..=130usize {
        let tokens: Vec<u32> = (0..n as u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let mut bytes = parent.0.to_le_bytes().to_vec();
        for t in &tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let want = SequenceHash(xxh3_128_with_seed(&bytes, salt.0));
        assert_eq!(chain_block(Some(parent), salt, &tokens), want, "{n} tokens");
        let mut root = vec![0u8; 16];
        root.extend_from_slice(&bytes[16..]);
        assert_eq!(
            chain_block(None, salt, &tokens),
            SequenceHash(xxh3_128_with_seed(&root, salt.0)),
            "{n} tokens, no parent"
        );
    }
}
