//! Remote values as a store returns them: decoding never panics, and accepts a value only if it
//! is exactly the frame kvtier writes for that key, namespace and payload (so forged or damaged
//! values never count as a hit).
#![no_main]
use kvtier_io::storage::remote::{decode_value, encode_value, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 18 {
        return;
    }
    let key = u128::from_le_bytes(data[..16].try_into().unwrap_or([0; 16]));
    let block = usize::from(u16::from_le_bytes([data[16], data[17]]) % 4096);
    let value = &data[18..];
    let mut out = vec![0u8; block];
    if decode_value("fuzz", key, value, &mut out).is_ok() {
        assert_eq!(value.len(), HEADER_LEN + block);
        assert_eq!(
            encode_value("fuzz", key, &out),
            value,
            "accepted a value kvtier did not write"
        );
    }
    // A value kvtier wrote always decodes, and never under another key.
    let mine = encode_value("fuzz", key, value);
    let mut back = vec![0u8; value.len()];
    decode_value("fuzz", key, &mine, &mut back).expect("own frame decodes");
    assert_eq!(back, value);
    assert!(decode_value("fuzz", key ^ 1, &mine, &mut back).is_err());
    assert!(decode_value("fuzz2", key, &mine, &mut back).is_err());
});
