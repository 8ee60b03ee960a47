//! Table-driven cases for the slot state machine: each case is a script of engine events and
//! the exact block indices (or error field) each event must produce.
#![allow(clippy::unwrap_used)]
use kvtier::connector::{ConnectorError, MatchRecord, Slot, SlotState, StepRecord};
use kvtier::hash::HashSalt;
use kvtier::DeviceBlockId;

const BS: usize = 16;

#[derive(Clone, Debug)]
enum Ev {
    /// Matching saw `tokens` (all of them); the engine holds `device` tokens; kvtier offers `external`.
    Match {
        tokens: usize,
        device: usize,
        external: usize,
    },
    /// update_state_after_alloc with device blocks `blocks` and this external count; expect these onboard indices.
    Alloc {
        blocks: Vec<u32>,
        external: Option<usize>,
        onboard: Vec<usize>,
    },
    /// One step record; expect these offload indices (or an error naming `field`).
    Step {
        rec: StepRecord,
        expect: Result<Vec<usize>, &'static str>,
    },
    Preempt,
    LoadFailed(usize),
    Finish,
}

fn toks(range: std::ops::Range<usize>) -> Vec<u32> {
    range.map(|t| t as u32 + 1000).collect()
}

fn b(range: std::ops::Range<u32>) -> Vec<DeviceBlockId> {
    range.map(DeviceBlockId).collect()
}

#[allow(clippy::too_many_arguments)]
fn rec(
    new_tokens: Vec<u32>,
    blocks: Vec<DeviceBlockId>,
    computed: usize,
    scheduled: usize,
    drafts: usize,
    new: bool,
    resumed: bool,
) -> StepRecord {
    StepRecord {
        request_id: "r".into(),
        new_tokens,
        new_block_ids: blocks,
        num_computed_tokens: computed,
        num_scheduled_tokens: scheduled,
        num_draft_tokens: drafts,
        is_new: new,
        resumed_from_preemption: resumed,
    }
}

fn step(rec: StepRecord, expect: &[usize]) -> Ev {
    Ev::Step {
        rec,
        expect: Ok(expect.to_vec()),
    }
}

fn run(name: &str, events: Vec<Ev>) {
    let mut s = Slot::new("r".into(), BS, HashSalt(3));
    for (i, ev) in events.into_iter().enumerate() {
        match ev {
            Ev::Match {
                tokens,
                device,
                external,
            } => {
                assert!(s.can_match(), "{name} #{i}: matching must be allowed");
                s.set_all_tokens(&toks(0..tokens));
                s.record_match(MatchRecord {
                    device_tokens: device,
                    external_tokens: external,
                });
            }
            Ev::Alloc {
                blocks,
                external,
                onboard,
            } => {
                let got = s.allocate(&b(blocks[0]..blocks[1]), external).unwrap();
                assert_eq!(
                    got.iter().map(|o| o.index).collect::<Vec<_>>(),
                    onboard,
                    "{name} #{i}: onboard"
                );
                for o in &got {
                    assert_eq!(
                        o.device,
                        s.device_table()[o.index],
                        "{name} #{i}: onboard pairing"
                    );
                }
            }
            Ev::Step { rec, expect } => {
                let before = (
                    s.position(),
                    s.evaluated_blocks(),
                    s.device_table().to_vec(),
                    s.num_tokens(),
                );
                match (s.apply(&rec), expect) {
                    (Ok(got), Ok(want)) => {
                        assert_eq!(
                            got.iter().map(|o| o.index).collect::<Vec<_>>(),
                            want,
                            "{name} #{i}: offload"
                        );
                        for o in &got {
                            assert_eq!(
                                o.device,
                                s.device_table()[o.index],
                                "{name} #{i}: device pairing"
                            );
                            assert!(
                                (o.index + 1) * BS <= s.num_tokens(),
                                "{name} #{i}: partial block"
                            );
                        }
                    }
                    (Err(ConnectorError::InvalidInput { field, .. }), Err(want)) => {
                        assert_eq!(field, want, "{name} #{i}: error field");
                        let after = (
                            s.position(),
                            s.evaluated_blocks(),
                            s.device_table().to_vec(),
                            s.num_tokens(),
                        );
                        assert_eq!(
                            before, after,
                            "{name} #{i}: an error must not change the slot"
                        );
                    }
                    (got, want) => panic!("{name} #{i}: got {got:?}, want {want:?}"),
                }
            }
            Ev::Preempt => s.preempt().unwrap(),
            Ev::LoadFailed(idx) => s.load_failed(idx),
            Ev::Finish => s.finish(),
        }
    }
}

#[test]
fn slot_cases() {
    let cases: Vec<(&str, Vec<Ev>)> = vec![
        (
            "worked example: prompt 100, chunk 64, then decode to 112",
            vec![
                step(rec(toks(0..100), b(0..7), 0, 64, 0, true, false), &[0, 1, 2, 3]),
                step(rec(vec![], vec![], 64, 36, 0, false, false), &[4, 5]),
                step(rec(toks(100..101), vec![], 100, 1, 0, false, false), &[]),
            ]
            .into_iter()
            .chain((101..111).map(|t| step(rec(toks(t..t + 1), vec![], t, 1, 0, false, false), &[])))
            .chain([step(rec(toks(111..112), vec![], 111, 1, 0, false, false), &[6])])
            .collect(),
        ),
        (
            "chunked prefill with uneven chunks never offloads a partial block",
            vec![
                step(rec(toks(0..70), b(0..5), 0, 20, 0, true, false), &[0]),
                step(rec(vec![], vec![], 20, 20, 0, false, false), &[1]),
                step(rec(vec![], vec![], 40, 30, 0, false, false), &[2, 3]),
            ],
        ),
        (
            "device prefix hit: blocks from the engine's own cache are not sent again",
            vec![
                Ev::Match { tokens: 80, device: 32, external: 0 },
                Ev::Alloc { blocks: vec![0, 5], external: Some(0), onboard: vec![] },
                step(rec(toks(0..80), b(0..5), 32, 48, 0, true, false), &[2, 3, 4]),
            ],
        ),
        (
            "onboarding (TensorRT-LLM): ids reported twice, computed position excludes matched tokens",
            vec![
                Ev::Match { tokens: 100, device: 16, external: 48 },
                Ev::Alloc { blocks: vec![10, 17], external: None, onboard: vec![1, 2, 3] },
                step(rec(toks(0..100), b(10..17), 16, 36, 0, true, false), &[4, 5]),
                step(rec(toks(100..101), vec![], 100, 1, 0, false, false), &[]),
            ],
        ),
        (
            "onboarding (vLLM): computed includes the external tokens",
            vec![
                Ev::Match { tokens: 100, device: 0, external: 64 },
                Ev::Alloc { blocks: vec![0, 7], external: Some(64), onboard: vec![0, 1, 2, 3] },
                step(rec(toks(0..100), b(0..7), 64, 36, 0, true, false), &[4, 5]),
            ],
        ),
        (
            "decode appends blocks one id at a time",
            vec![
                step(rec(toks(0..32), b(0..2), 0, 32, 0, true, false), &[0, 1]),
                step(rec(toks(32..33), b(2..3), 32, 1, 0, false, false), &[]),
            ]
            .into_iter()
            .chain((33..47).map(|t| step(rec(toks(t..t + 1), vec![], t, 1, 0, false, false), &[])))
            .chain([step(rec(toks(47..48), vec![], 47, 1, 0, false, false), &[2])])
            .collect(),
        ),
        (
            "speculative decoding: draft tokens are not offloaded until accepted",
            vec![
                step(rec(toks(0..30), b(0..3), 0, 30, 0, true, false), &[0]),
                // tokens 0..31 known (t30 sampled), computes 30 + 3 drafts (positions 30..33)
                step(rec(toks(30..31), vec![], 30, 4, 3, false, false), &[]),
                // one draft accepted plus a bonus token: 33 tokens known, computed 32
                step(rec(toks(31..33), vec![], 32, 4, 3, false, false), &[1]),
            ],
        ),
        (
            "speculative decoding: a block completed only by drafts waits",
            vec![
                step(rec(toks(0..14), b(0..2), 0, 14, 0, true, false), &[]),
                step(rec(toks(14..15), vec![], 14, 4, 3, false, false), &[]),
                // no draft accepted
                step(rec(toks(15..16), vec![], 15, 4, 3, false, false), &[0]),
            ],
        ),
        (
            "preemption resets the table; offloaded blocks are not sent again",
            vec![
                step(rec(toks(0..40), b(0..3), 0, 40, 0, true, false), &[0, 1]),
                Ev::Preempt,
                Ev::Match { tokens: 40, device: 0, external: 0 },
                Ev::Alloc { blocks: vec![20, 23], external: Some(0), onboard: vec![] },
                step(rec(vec![], b(20..23), 0, 40, 0, false, true), &[]),
                step(rec(toks(40..41), vec![], 40, 1, 0, false, false), &[]),
            ],
        ),
        (
            "resumed record without an explicit preempt call restarts the table",
            vec![
                step(rec(toks(0..20), b(0..2), 0, 16, 0, true, false), &[0]),
                step(rec(vec![], b(5..8), 0, 48, 0, false, true), &[]),
            ],
        ),
        (
            "generation-only request (disaggregated decode): prompt KV arrived from elsewhere",
            vec![
                step(rec(toks(0..49), b(0..4), 48, 1, 0, true, false), &[]),
                step(rec(toks(49..50), vec![], 49, 1, 0, false, false), &[]),
            ]
            .into_iter()
            .chain((50..63).map(|t| step(rec(toks(t..t + 1), vec![], t, 1, 0, false, false), &[])))
            .chain([step(rec(toks(63..64), vec![], 63, 1, 0, false, false), &[3])])
            .collect(),
        ),
        (
            "failed load: the slot goes back and the engine's recompute is accepted",
            vec![
                Ev::Match { tokens: 100, device: 0, external: 96 },
                Ev::Alloc { blocks: vec![0, 7], external: None, onboard: vec![0, 1, 2, 3, 4, 5] },
                Ev::LoadFailed(3),
                step(rec(toks(0..100), b(0..7), 48, 52, 0, true, false), &[3, 4, 5]),
            ],
        ),
        (
            "failed load learnt only from the engine's next record (vLLM sync recompute)",
            vec![
                Ev::Match { tokens: 100, device: 0, external: 64 },
                Ev::Alloc { blocks: vec![0, 7], external: None, onboard: vec![0, 1, 2, 3] },
                step(rec(toks(0..100), b(0..7), 64, 36, 0, true, false), &[4, 5]),
                step(rec(vec![], vec![], 32, 68, 0, false, false), &[2, 3, 4, 5]),
            ],
        ),
        (
            "invalid input: scheduled past the table, too many drafts, duplicate ids in one report",
            vec![
                Ev::Step { rec: rec(toks(0..40), b(0..2), 0, 40, 0, true, false), expect: Err("num_scheduled_tokens") },
                Ev::Step { rec: rec(toks(0..40), b(0..3), 0, 2, 3, true, false), expect: Err("num_draft_tokens") },
                Ev::Step {
                    rec: rec(toks(0..40), vec![DeviceBlockId(1), DeviceBlockId(1), DeviceBlockId(2)], 0, 40, 0, true, false),
                    expect: Err("new_block_ids"),
                },
                step(rec(toks(0..40), b(0..3), 0, 40, 0, true, false), &[0, 1]),
                Ev::Step { rec: rec(vec![], vec![], 40, 0, 0, true, false), expect: Err("is_new") },
                Ev::Finish,
                Ev::Step { rec: rec(toks(40..41), vec![], 40, 1, 0, false, false), expect: Err("request_id") },
            ],
        ),
    ];
    for (name, events) in cases {
        run(name, events);
    }
}

#[test]
fn allocation_checks_the_promise() {
    let mut s = Slot::new("r".into(), BS, HashSalt(3));
    s.set_all_tokens(&toks(0..64));
    s.record_match(MatchRecord {
        device_tokens: 0,
        external_tokens: 32,
    });
    let field = |e: ConnectorError| match e {
        ConnectorError::InvalidInput { field, .. } => field,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        field(s.allocate(&b(0..4), Some(48)).unwrap_err()),
        "num_external_tokens"
    );
    assert_eq!(
        field(s.allocate(&b(0..4), Some(8)).unwrap_err()),
        "num_external_tokens"
    );
    assert_eq!(
        field(s.allocate(&b(0..1), Some(32)).unwrap_err()),
        "block_ids"
    );
    assert_eq!(s.state(), SlotState::Waiting);
    assert!(s.device_table().is_empty());
    assert_eq!(s.allocate(&b(0..4), Some(32)).unwrap().len(), 2);
    assert_eq!(s.state(), SlotState::Allocated);
}
