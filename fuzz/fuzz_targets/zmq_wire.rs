//! Frames of the leader <-> worker channel as a peer sends them: decoding never panics, and a
//! decoded frame re-encodes to one that decodes equal.
#![no_main]
use kvtier::connector::zmq::{decode, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(w) = decode(data) {
        let again = encode(&w).expect("a decoded frame encodes");
        assert_eq!(decode(&again).expect("re-encoded frame decodes"), w);
    }
});
