//! The leader <-> worker channel across processes, over ZeroMQ (the pure-Rust `zeromq` crate):
//! the leader binds a ROUTER, each rank connects a DEALER.
//!
//! Protocol (every frame is `postcard(WIRE_VERSION: u32) ++ postcard(Wire)`):
//! 1. each worker sends `Hello { layout, nonce, tag }`, authenticated with the deployment's
//!    secret ([`super::zmq_auth`]); a hello that does not authenticate (or repeats a nonce), or
//!    an undecodable frame from a peer that is not a rank, is refused: logged with the peer's
//!    identity, answered `Reject(reason)`, never counted as a rank and never failing the
//!    handshake of the real ranks;
//! 2. when all `world_size` ranks said hello, the leader checks layouts
//!    (`ClusterLayout::agree`) and answers every rank `Welcome { layout, tag }` (tagged with
//!    that rank's nonce), or `Reject(reason)` to every rank and fails its own handshake with the
//!    same reason;
//! 3. workers send `Report`s; the leader may broadcast `Step` metadata (for engines that do not
//!    carry it themselves) and finally `Shutdown`.
//!
//! Invariants: a frame of another wire version is never decoded as ours (it is rejected
//! with both versions named); only authenticated ranks are counted, welcomed or listened to; the handshake and the wait for metadata are bounded by one
//! configurable timeout; no call here panics on anything a peer sends.
//!
//! Endpoints: `tcp://host:port` and `ipc:///path` (a Unix socket, local only: the leader creates
//! it mode 0600, so only the deployment's user can connect, and reclaims a stale socket file a
//! dead leader left behind). Anything else (`inproc://`, typos) is refused with
//! `ConnectorError::Channel` before it reaches the ZeroMQ crate, which panics on transports it
//! was not built with.
//!
//! Threading: each endpoint runs one background thread with a single-threaded tokio runtime
//! that owns the socket; the public handles talk to it through channels only.
mod endpoint;
mod leader;
mod thread;
mod wire;
mod worker;

pub use endpoint::check_endpoint;
pub use leader::LeaderChannel;
pub use wire::{decode, encode, encode_with_version, hello, Wire, WIRE_VERSION};
pub use worker::WorkerChannel;

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::mpsc as std_mpsc;
    use std::time::Duration;

    use super::thread::join_within;
    use super::*;

    #[test]
    fn a_stuck_channel_thread_does_not_hang_the_stop() {
        let (tx, rx) = std_mpsc::channel::<()>();
        let stuck = std::thread::spawn(move || {
            let _ = rx.recv_timeout(Duration::from_secs(5));
        });
        let t = std::time::Instant::now();
        assert!(!join_within(
            stuck,
            Duration::from_millis(50),
            "test thread"
        ));
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        drop(tx);
        let quick = std::thread::spawn(|| {});
        assert!(join_within(quick, Duration::from_secs(5), "test thread"));
    }

    #[test]
    fn frames_of_another_version_are_rejected_by_name() {
        let f = encode_with_version(7, &Wire::Shutdown).unwrap();
        let e = decode(&f).unwrap_err();
        assert!(e.to_string().contains("version 7"), "{e}");
        assert_eq!(
            decode(&encode(&Wire::Shutdown).unwrap()).unwrap(),
            Wire::Shutdown
        );
    }

    #[test]
    fn unsupported_endpoints_are_refused_by_name() {
        for ep in [
            "inproc://x",
            "ipc://",
            "udp://1.2.3.4:5",
            "127.0.0.1:5",
            "tcp://",
        ] {
            let e = check_endpoint(ep).unwrap_err();
            assert!(e.to_string().contains("expected tcp://"), "{ep}: {e}");
        }
        check_endpoint("tcp://127.0.0.1:0").unwrap();
        check_endpoint("ipc:///tmp/x.sock").unwrap();
    }
}
