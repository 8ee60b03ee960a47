use std::sync::mpsc::channel;
use std::time::Duration;

use super::*;

/// Two device blocks whose chunks (24 + 40 bytes, then 8 + 56) straddle the 32-byte layers of a
/// 64-byte block, in a device buffer, and two host blocks of distinct bytes.
fn setup(dev: &mut [u8], host: &[u8]) -> Vec<(usize, Vec<Chunk>, usize)> {
    let d = dev.as_mut_ptr() as u64;
    let h = host.as_ptr() as usize;
    let chunk = |at: u64, len: usize| Chunk { addr: d + at, len };
    vec![
        (0, vec![chunk(100, 24), chunk(10, 40)], h),
        (1, vec![chunk(60, 8), chunk(200, 56)], h + 64),
    ]
}

/// `(host blocks, zeroed device buffer, what one whole copy leaves in it, the pairs)`.
struct Fixture {
    _host: Vec<u8>,
    dev: Vec<u8>,
    whole: Vec<u8>,
    resolved: Vec<(usize, Vec<Chunk>, usize)>,
}

fn fixture() -> Fixture {
    let host: Vec<u8> = (0..128u32).map(|i| (i * 7 + 1) as u8).collect();
    let mut dev = vec![0u8; 256];
    let resolved = setup(&mut dev, &host);
    let mut whole = vec![0u8; 256];
    copy_whole(&setup(&mut whole, &host), false);
    Fixture {
        _host: host,
        dev,
        whole,
        resolved,
    }
}

/// What the device buffer at `addr` holds now.
fn seen(addr: usize) -> Vec<u8> {
    crate::sys::job::with_bytes(addr, 256, |b| b.to_vec())
}

#[test]
fn a_layered_load_hands_the_gate_over_first_and_lands_bit_exact() {
    let f = fixture();
    let dev_addr = f.dev.as_ptr() as usize;
    let mut gate: Option<Arc<dyn LayerGate>> = None;
    let mut untouched_at_handover = false;
    let mut enqueued = |g: Option<Arc<dyn LayerGate>>| {
        // Nothing is copied yet when the engine is told to go on.
        untouched_at_handover = seen(dev_addr).iter().all(|&b| b == 0);
        gate = g;
    };
    let order = Ordering {
        stream: 0,
        layered: true,
        readable: false,
        enqueued: &mut enqueued,
    };
    load_layered(&f.resolved, 64, 2, order);
    assert!(untouched_at_handover);
    let gate = gate.expect("a layered load hands over a gate");
    assert_eq!(gate.layers(), 2);
    gate.wait_layer(0, 0).unwrap();
    gate.wait_layer(1, 0).unwrap();
    assert!(matches!(
        gate.wait_layer(2, 0),
        Err(TransferError::Other(_))
    ));
    assert_eq!(
        seen(dev_addr),
        f.whole,
        "layer by layer lands the same bytes as one whole copy"
    );
    assert!(f.whole.iter().any(|&b| b != 0));
}

#[test]
fn blocks_that_do_not_split_into_the_layers_are_copied_whole_without_a_gate() {
    let f = fixture();
    let dev_addr = f.dev.as_ptr() as usize;
    let mut handed: Option<Option<Arc<dyn LayerGate>>> = None;
    let mut complete_at_handover = false;
    let mut enqueued = |g: Option<Arc<dyn LayerGate>>| {
        complete_at_handover = seen(dev_addr) == f.whole;
        handed = Some(g);
    };
    let order = Ordering {
        stream: 0,
        layered: true,
        readable: false,
        enqueued: &mut enqueued,
    };
    load_layered(&f.resolved, 64, 3, order); // 64 bytes do not split into 3 layers
    assert!(matches!(handed, Some(None)));
    assert!(
        complete_at_handover,
        "the engine goes on only once the whole copy is in"
    );
}

/// A gate of three layers and the progress its copy reports to.
fn three_layers() -> (Arc<Progress>, CpuLayerGate) {
    let progress = Arc::new(Progress::default());
    let gate = CpuLayerGate {
        progress: Arc::clone(&progress),
        layers: 3,
    };
    (progress, gate)
}

#[test]
fn a_waiter_returns_only_once_its_layer_is_in() {
    let (progress, gate) = three_layers();
    let (tx, rx) = channel();
    std::thread::scope(|s| {
        s.spawn(|| tx.send(gate.wait_layer(1, 0).is_ok()).unwrap());
        let advance = Advance {
            progress: &progress,
            layers: 3,
        };
        advance.layer_in();
        // Layer 0 is in, layer 1 is not: the waiter must still be waiting.
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err());
        advance.layer_in();
        assert!(rx.recv_timeout(Duration::from_secs(30)).unwrap());
        advance.layer_in();
    });
    gate.wait_layer(2, 0).unwrap();
}

#[test]
fn a_copy_that_stops_early_fails_its_waiters_instead_of_hanging_them() {
    let (progress, gate) = three_layers();
    let (tx, rx) = channel();
    std::thread::scope(|s| {
        s.spawn(|| tx.send(gate.wait_layer(2, 0).is_ok()).unwrap());
        let stopped = std::thread::scope(|inner| {
            inner
                .spawn(|| {
                    let advance = Advance {
                        progress: &progress,
                        layers: 3,
                    };
                    advance.layer_in();
                    panic!("a copy stopped midway (planted)");
                })
                .join()
        });
        assert!(stopped.is_err());
        assert!(!rx.recv_timeout(Duration::from_secs(30)).unwrap());
    });
    gate.wait_layer(0, 0).unwrap(); // the layer that did come in stays in
    assert!(gate.wait_layer(1, 0).is_err());
}
