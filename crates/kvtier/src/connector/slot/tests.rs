//! Unit tests of [`super::Slot`]: step records turn into the exact token and block
//! bookkeeping the leader matches and stores from.
#![allow(clippy::unwrap_used)]
use super::*;

fn rec(new_tokens: Vec<u32>, blocks: &[u32], computed: usize, scheduled: usize) -> StepRecord {
    StepRecord {
        request_id: RequestId::from("r"),
        new_tokens,
        new_block_ids: blocks.iter().map(|&b| DeviceBlockId(b)).collect(),
        num_computed_tokens: computed,
        num_scheduled_tokens: scheduled,
        ..Default::default()
    }
}

fn idx(v: &[OffloadBlock]) -> Vec<usize> {
    v.iter().map(|b| b.index).collect()
}

#[test]
fn worked_example_reference_section_1() {
    let prompt: Vec<u32> = (0..100).collect();
    let mut s = Slot::new("r".into(), 16, HashSalt(7));
    let mut r1 = rec(prompt.clone(), &[10, 11, 12, 13, 14, 15, 16], 0, 64);
    r1.is_new = true;
    assert_eq!(idx(&s.apply(&r1).unwrap()), vec![0, 1, 2, 3]);
    assert_eq!(
        idx(&s.apply(&rec(vec![], &[], 64, 36)).unwrap()),
        vec![4, 5]
    );
    assert_eq!(
        idx(&s.apply(&rec(vec![100], &[], 100, 1)).unwrap()),
        Vec::<usize>::new()
    );
    for t in 101..111u32 {
        assert!(s
            .apply(&rec(vec![t], &[], t as usize, 1))
            .unwrap()
            .is_empty());
    }
    let out = s.apply(&rec(vec![111], &[], 111, 1)).unwrap();
    assert_eq!(idx(&out), vec![6]);
    assert_eq!(out[0].device, DeviceBlockId(16));
    assert_eq!(
        out[0].hash,
        crate::hash::sequence_hashes(HashSalt(7), &(0..112).collect::<Vec<_>>(), 16)[6]
    );
}

#[test]
fn double_reported_ids_are_recognised() {
    let mut s = Slot::new("r".into(), 4, HashSalt(1));
    s.set_all_tokens(&[1, 2, 3, 4, 5, 6, 7, 8]);
    s.allocate(&[DeviceBlockId(3), DeviceBlockId(9)], Some(0))
        .unwrap();
    let mut r = rec(vec![1, 2, 3, 4, 5, 6, 7, 8], &[3, 9], 0, 8);
    r.is_new = true;
    assert_eq!(idx(&s.apply(&r).unwrap()), vec![0, 1]);
    assert_eq!(s.device_table(), &[DeviceBlockId(3), DeviceBlockId(9)]);
}

#[test]
fn long_tables_recognise_known_ids_past_the_linear_scan() {
    // 200 blocks of 1 token: the table crosses LINEAR_MAX and builds its index.
    let n = 200u32;
    let mut s = Slot::new("r".into(), 1, HashSalt(1));
    let ids: Vec<u32> = (0..n).map(|i| i * 7 + 3).collect();
    let mut r = rec((0..n).collect(), &ids[..100], 0, 100);
    r.is_new = true;
    assert_eq!(s.apply(&r).unwrap().len(), 100);
    // Re-reported ids (old ones mixed in) are recognised, new ones appended in order.
    let mut again: Vec<u32> = ids[50..150].to_vec();
    again.extend_from_slice(&ids[..10]);
    let out = s.apply(&rec(vec![], &again, 100, 50)).unwrap();
    assert_eq!(idx(&out), (100..150).collect::<Vec<_>>());
    assert_eq!(s.device_table().len(), 150);
    assert!(s.table.index.is_some(), "index built past LINEAR_MAX");
    let out = s.apply(&rec(vec![], &ids[140..200], 150, 50)).unwrap();
    assert_eq!(idx(&out), (150..200).collect::<Vec<_>>());
    let want: Vec<DeviceBlockId> = ids.iter().map(|&b| DeviceBlockId(b)).collect();
    assert_eq!(s.device_table(), &want[..]);
    // A fresh id listed twice is an error, whichever the table's representation.
    let e = s
        .apply(&rec(vec![n], &[9999, 5, 9999], 200, 0))
        .unwrap_err();
    assert!(matches!(
        e,
        ConnectorError::InvalidInput {
            field: "new_block_ids",
            ..
        }
    ));
    assert_eq!(s.device_table().len(), 200);
}

fn hashes_of(tokens: &[u32], bs: usize) -> Vec<SequenceHash> {
    crate::hash::sequence_hashes(HashSalt(1), tokens, bs)
}

#[test]
fn matched_tokens_are_compared_then_only_the_tail_is_kept() {
    let prompt: Vec<u32> = (0..10).collect();
    let mut s = Slot::new("r".into(), 4, HashSalt(1));
    s.set_all_tokens(&prompt);
    assert_eq!((s.num_tokens(), s.tokens.len()), (10, 10));
    let mut r = rec(prompt.clone(), &[1, 2, 3], 0, 10);
    r.is_new = true;
    assert_eq!(idx(&s.apply(&r).unwrap()), vec![0, 1]);
    // Running: the two hashed blocks' tokens are gone, the tail (8, 9) stays.
    assert_eq!((s.token_base, &s.tokens[..]), (8, &[8u32, 9][..]));
    assert_eq!(s.hashes(), &hashes_of(&prompt, 4)[..]);
    // Decoding completes block 2 from the tail.
    s.apply(&rec(vec![10], &[], 10, 1)).unwrap();
    let out = s.apply(&rec(vec![11], &[], 11, 1)).unwrap();
    assert_eq!(idx(&out), vec![2]);
    assert_eq!(out[0].hash, hashes_of(&(0..12).collect::<Vec<_>>(), 4)[2]);
    assert_eq!((s.num_tokens(), s.tokens.len()), (12, 0));
}

#[test]
fn a_first_record_may_repeat_part_of_the_match_but_not_contradict_it() {
    let prompt: Vec<u32> = (0..12).collect();
    let mut s = Slot::new("r".into(), 4, HashSalt(1));
    s.set_all_tokens(&prompt);
    let mut short = rec(prompt[..6].to_vec(), &[1, 2, 3], 0, 12);
    short.is_new = true;
    assert_eq!(idx(&s.apply(&short).unwrap()), vec![0, 1, 2]);
    assert_eq!(s.num_tokens(), 12);

    let mut s = Slot::new("r".into(), 4, HashSalt(1));
    s.set_all_tokens(&prompt);
    let mut other = prompt.clone();
    other[5] = 99;
    let mut bad = rec(other, &[1, 2, 3], 0, 12);
    bad.is_new = true;
    let e = s.apply(&bad).unwrap_err();
    assert!(matches!(
        e,
        ConnectorError::InvalidInput {
            field: "new_tokens",
            ..
        }
    ));
    assert_eq!((s.num_tokens(), s.state()), (12, SlotState::Waiting));
}

#[test]
fn after_preemption_full_lists_are_recognised_by_hash() {
    let prompt: Vec<u32> = (0..10).collect();
    let mut s = Slot::new("r".into(), 4, HashSalt(1));
    let mut r = rec(prompt.clone(), &[1, 2, 3], 0, 10);
    r.is_new = true;
    s.apply(&r).unwrap();
    assert_eq!(s.token_base, 8, "only the tail is kept");
    s.preempt().unwrap();
    // vLLM resends every token of a resumed request: recognised, nothing appended.
    let mut resumed = rec(prompt.clone(), &[7, 8, 9], 0, 10);
    resumed.resumed_from_preemption = true;
    assert_eq!(idx(&s.apply(&resumed).unwrap()), Vec::<usize>::new());
    assert_eq!(s.num_tokens(), 10);
    assert_eq!(
        s.device_table(),
        &[DeviceBlockId(7), DeviceBlockId(8), DeviceBlockId(9)]
    );
    // Matching again after a preemption keeps the whole list again, hashes unchanged.
    s.preempt().unwrap();
    let mut longer = prompt.clone();
    longer.extend([10, 11, 12]);
    s.set_all_tokens(&longer);
    assert_eq!((s.token_base, s.num_tokens()), (0, 13));
    assert_eq!(s.hashes(), &hashes_of(&longer, 4)[..]);
    // A matching list that contradicts the known tokens starts over.
    let other: Vec<u32> = (100..109).collect();
    s.set_all_tokens(&other);
    assert_eq!(s.hashes(), &hashes_of(&other, 4)[..]);
    assert_eq!(s.num_tokens(), 9);
}

proptest::proptest! {
    /// The fast path for plain continuation records gives exactly what the general path
    /// gives: the same offloads and the same slot afterwards.
    #[test]
    fn plain_continuations_match_the_general_path(
        prompt in 1usize..80,
        chunk in 1usize..40,
        steps in proptest::collection::vec((0u8..5, 1usize..6), 1..60),
    ) {
        let bs = 4;
        let mut s = Slot::new("r".into(), bs, HashSalt(9));
        let tokens: Vec<u32> = (0..prompt as u32).collect();
        let first = chunk.min(prompt);
        let mut r = rec(tokens.clone(), &[], 0, first);
        r.is_new = true;
        r.new_block_ids = (0..first.div_ceil(bs) as u32).map(DeviceBlockId).collect();
        s.apply(&r).unwrap();
        let (mut computed, mut len, mut blocks) = (first, prompt, first.div_ceil(bs));
        let mut next_id = blocks as u32;
        for (kind, n) in steps {
            // kind 0: a plain chunk or decode; 1: with a new block; 2: a rollback; 3: drafts;
            // 4: more tokens scheduled than the slot knows.
            let scheduled = if computed < len { n.min(len - computed) } else { 1 };
            let new_tokens: Vec<u32> = if computed >= len {
                len += 1;
                vec![len as u32 + 1000]
            } else {
                vec![]
            };
            let scheduled = if kind == 4 { scheduled + 2 } else { scheduled };
            let mut r = rec(new_tokens, &[], computed, scheduled);
            let need = (computed + scheduled).div_ceil(bs);
            if kind == 1 || need > blocks {
                r.new_block_ids = (next_id..next_id + (need.max(blocks + 1) - blocks) as u32)
                    .map(DeviceBlockId)
                    .collect();
                next_id += r.new_block_ids.len() as u32;
                blocks += r.new_block_ids.len();
            }
            if kind == 2 && computed > 0 {
                r.num_computed_tokens -= 1;
            }
            if kind == 3 {
                r.num_draft_tokens = 1;
                r.num_scheduled_tokens += 1;
                if (r.num_computed_tokens + r.num_scheduled_tokens).div_ceil(bs) > blocks {
                    r.new_block_ids.push(DeviceBlockId(next_id));
                    next_id += 1;
                    blocks += 1;
                }
            }
            let plain = s.is_plain_continuation(&r);
            let mut general = s.clone();
            let (mut got, mut want) = (Vec::new(), Vec::new());
            let g = general.apply_general(&r, &mut want);
            if plain {
                s.apply_continuation(&r, &mut got);
                proptest::prop_assert!(g.is_ok());
                proptest::prop_assert_eq!(&got, &want);
                proptest::prop_assert_eq!(format!("{s:?}"), format!("{general:?}"));
            } else {
                s = general;
                if g.is_err() {
                    break;
                }
            }
            computed = s.position();
        }
    }
}

#[test]
fn invalid_input_leaves_slot_unchanged() {
    let mut s = Slot::new("r".into(), 4, HashSalt(1));
    let mut r = rec(vec![1, 2, 3, 4, 5], &[0], 0, 5);
    r.is_new = true;
    let e = s.apply(&r).unwrap_err();
    assert!(matches!(
        e,
        ConnectorError::InvalidInput {
            field: "num_scheduled_tokens",
            ..
        }
    ));
    assert_eq!(s.num_tokens(), 0);
    assert!(s.device_table().is_empty());
    assert_eq!(s.state(), SlotState::Waiting);
}
