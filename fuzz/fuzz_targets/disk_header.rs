//! The disk tier's block check (what every G3 read runs on a slot's header page and payload,
//! bytes that a torn write, a bit flip or another process's file may have changed): a slot built
//! from the input's fields, then optionally one flipped bit anywhere in the checked bytes, one
//! expected field changed, or the bytes cut short. Never panics; accepts exactly the unchanged
//! slot for exactly the fields it was written with.
#![no_main]
use kvtier_io::storage::disk::fuzz::{block, verify};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let (head, payload) = data.split_at(8);
    let mode = head[0];
    let set_id = u64::from(head[1]) | 1;
    let slot = u32::from(head[2]);
    let generation = u64::from(head[3]) + 1;
    let key = u128::from(u16::from_le_bytes([head[4], head[5]]));
    let mut bytes = block(set_id, slot, generation, key, payload);
    assert_eq!(
        verify(&bytes, set_id, slot, generation, key, payload.len()),
        Ok(()),
        "an unchanged slot is refused"
    );
    let pick = usize::from(u16::from_le_bytes([head[6], head[7]]));
    let (mut s, mut sl, mut g, mut k, mut len) = (set_id, slot, generation, key, payload.len());
    // The bytes a read checks: the header's 64 bytes of fields and their checksum, the payload
    // (the rest of the header page is padding).
    let checked: Vec<usize> = (0..72).chain(4096..bytes.len()).collect();
    let at = checked[pick % checked.len()];
    match mode % 8 {
        0 => bytes[at] ^= 1 << (mode >> 5),
        1 => s ^= 1 << (pick % 64),
        2 => sl ^= 1 << (pick % 32),
        3 => g ^= 1 << (pick % 64),
        4 => k ^= 1 << (pick % 128),
        5 => len = len.wrapping_add(1 + pick % 4096),
        6 => bytes.truncate(at),
        _ => return,
    }
    assert!(
        verify(&bytes, s, sl, g, k, len).is_err(),
        "a changed slot or expectation was accepted (mode {})",
        mode % 8
    );
});
