//! Step metadata from a peer (engine broadcast or the ZeroMQ channel): decoding never panics,
//! and whatever decodes re-encodes to bytes that decode to the same value.
#![no_main]
use kvtier::connector::StepMetadata;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = StepMetadata::from_bytes(data) {
        let again = m.to_bytes().expect("a decoded value encodes");
        let back = StepMetadata::from_bytes(&again).expect("re-encoded bytes decode");
        assert_eq!(back, m);
    }
});
