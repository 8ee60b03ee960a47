//! The socket thread every endpoint runs: a single-threaded tokio runtime owning the socket, and
//! a bounded stop (a thread stuck in the network is left behind, never waited on forever).
use std::sync::mpsc as std_mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::connector::ConnectorError;

/// How long a closing socket keeps running so that queued frames leave (like `ZMQ_LINGER`).
pub(super) const LINGER: Duration = Duration::from_millis(200);

fn runtime() -> Result<tokio::runtime::Runtime, ConnectorError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ConnectorError::Channel(format!("tokio runtime: {e}")))
}

/// Spawn the socket thread `name`, running `run(ready)` on its own runtime. `ready` is how the
/// thread reports that it started (or why not): when the runtime cannot be built, the error is
/// sent there and `run` never starts.
pub(super) fn spawn_socket_thread<T, F, Fut>(
    name: &str,
    ready: std_mpsc::Sender<Result<T, ConnectorError>>,
    run: F,
) -> Result<JoinHandle<()>, ConnectorError>
where
    T: Send + 'static,
    F: FnOnce(std_mpsc::Sender<Result<T, ConnectorError>>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || match runtime() {
            Ok(rt) => rt.block_on(run(ready)),
            Err(e) => {
                let _ = ready.send(Err(e));
            }
        })
        .map_err(|e| ConnectorError::Channel(format!("spawn: {e}")))
}
/// How long stopping a channel waits for its socket thread (it flushes queued messages first).
pub(super) const CHANNEL_STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// Join `t` if it ends within `timeout`; otherwise log and leave it detached (a socket thread
/// stuck in the network must not hang the engine's shutdown). True if it was joined.
pub(super) fn join_within(t: std::thread::JoinHandle<()>, timeout: Duration, what: &str) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    while !t.is_finished() {
        if std::time::Instant::now() >= deadline {
            tracing::warn!(?timeout, "{what} did not stop in time; leaving it behind");
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let _ = t.join();
    true
}
