//! A worker's end: a DEALER that introduces its rank, waits (bounded) for the leader's verdict,
//! then sends reports and receives the step metadata the leader broadcasts.
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::mpsc as tk;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::connector::messages::{ClusterLayout, RankLayout, StepMetadata, WorkerReport};
use crate::connector::worker::ReportSink;
use crate::connector::zmq_auth::{self, ChannelSecret, AUTH_FAILED};
use crate::connector::ConnectorError;

use super::endpoint::*;
use super::thread::*;
use super::wire::*;

// ----- worker side ------------------------------------------------------------------------

/// A worker's end of the channel: its report sink and the metadata the leader broadcasts.
pub struct WorkerChannel {
    layout: ClusterLayout,
    out: tk::UnboundedSender<Vec<u8>>,
    stop: tk::UnboundedSender<()>,
    steps: std_mpsc::Receiver<Option<StepMetadata>>,
    thread: Option<JoinHandle<()>>,
}

struct ZmqSink {
    out: tk::UnboundedSender<Vec<u8>>,
}

impl ReportSink for ZmqSink {
    fn send(&self, report: WorkerReport) -> Result<(), ConnectorError> {
        let bytes = encode(&Wire::Report(report))?;
        self.out
            .send(bytes)
            .map_err(|_| ConnectorError::Channel("worker socket thread is gone".into()))
    }
}

impl WorkerChannel {
    /// Connect to the leader, introduce this rank and wait (at most `timeout`) for its verdict,
    /// authenticating with [`zmq_auth::worker_secret`] (`KVTIER_ZMQ_SECRET`, else the leader's key
    /// file for `endpoint`, waited for within `timeout`).
    pub fn connect(
        endpoint: &str,
        me: RankLayout,
        timeout: Duration,
    ) -> Result<WorkerChannel, ConnectorError> {
        Self::connect_with(endpoint, me, timeout, None)
    }

    /// As [`WorkerChannel::connect`], with an explicit secret (`None`: as `connect`).
    pub fn connect_with(
        endpoint: &str,
        me: RankLayout,
        timeout: Duration,
        secret: Option<ChannelSecret>,
    ) -> Result<WorkerChannel, ConnectorError> {
        check_endpoint(endpoint)?;
        let (out_tx, out_rx) = tk::unbounded_channel::<Vec<u8>>();
        let (stop_tx, stop_rx) = tk::unbounded_channel::<()>();
        let (steps_tx, steps_rx) = std_mpsc::channel();
        let (ready_tx, ready_rx) = std_mpsc::channel();
        let ep = endpoint.to_owned();
        let thread = spawn_socket_thread("kvtier-zmq-worker", ready_tx, move |ready| {
            worker_loop(ep, me, secret, timeout, out_rx, stop_rx, steps_tx, ready)
        })?;
        let verdict = ready_rx
            .recv_timeout(timeout + Duration::from_secs(5))
            .map_err(|_| {
                ConnectorError::Handshake(format!("no answer from the leader within {timeout:?}"))
            })
            .and_then(|r| r);
        match verdict {
            Ok(layout) => Ok(WorkerChannel {
                layout,
                out: out_tx,
                stop: stop_tx,
                steps: steps_rx,
                thread: Some(thread),
            }),
            Err(e) => {
                drop(out_tx);
                drop(stop_tx);
                join_within(thread, CHANNEL_STOP_TIMEOUT, "a worker's ZeroMQ thread");
                Err(e)
            }
        }
    }

    /// The layout every rank agreed on.
    pub fn layout(&self) -> &ClusterLayout {
        &self.layout
    }

    /// The sink to build this rank's `WorkerLink` with.
    pub fn sink(&self) -> Arc<dyn ReportSink> {
        Arc::new(ZmqSink {
            out: self.out.clone(),
        })
    }

    /// The next metadata the leader broadcast; `Ok(None)` when the leader shut down.
    pub fn recv_step(&self, timeout: Duration) -> Result<Option<StepMetadata>, ConnectorError> {
        match self.steps.recv_timeout(timeout) {
            Ok(s) => Ok(s),
            Err(std_mpsc::RecvTimeoutError::Timeout) => Err(ConnectorError::Channel(format!(
                "no step metadata within {timeout:?}"
            ))),
            Err(std_mpsc::RecvTimeoutError::Disconnected) => Ok(None),
        }
    }
}

impl Drop for WorkerChannel {
    fn drop(&mut self) {
        // The socket thread flushes queued reports, then exits.
        let _ = self.stop.send(());
        if let Some(t) = self.thread.take() {
            join_within(t, CHANNEL_STOP_TIMEOUT, "a worker's ZeroMQ thread");
        }
    }
}

/// The secret to authenticate with: the given one, else [`zmq_auth::worker_secret`], waiting for
/// the leader's key file to appear.
async fn wait_secret(
    endpoint: &str,
    given: &Option<ChannelSecret>,
) -> Result<ChannelSecret, ConnectorError> {
    if let Some(s) = given {
        return Ok(s.clone());
    }
    loop {
        if let Some(s) = zmq_auth::worker_secret(endpoint)? {
            return Ok(s);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[allow(clippy::too_many_arguments)]
async fn worker_loop(
    endpoint: String,
    me: RankLayout,
    given: Option<ChannelSecret>,
    timeout: Duration,
    mut out_rx: tk::UnboundedReceiver<Vec<u8>>,
    mut stop_rx: tk::UnboundedReceiver<()>,
    steps: std_mpsc::Sender<Option<StepMetadata>>,
    ready: std_mpsc::Sender<Result<ClusterLayout, ConnectorError>>,
) {
    let mut socket = DealerSocket::new();
    let handshake = async {
        socket
            .connect(&endpoint)
            .await
            .map_err(|e| ConnectorError::Channel(format!("connect {endpoint}: {e}")))?;
        'hello: loop {
            let secret = wait_secret(&endpoint, &given).await?;
            // The leader's challenge first: the hello answers it, so it cannot be replayed.
            socket
                .send(ZmqMessage::from(encode(&Wire::Hi)?))
                .await
                .map_err(|e| ConnectorError::Channel(e.to_string()))?;
            let challenge = loop {
                let m = socket
                    .recv()
                    .await
                    .map_err(|e| ConnectorError::Channel(e.to_string()))?;
                let Some((_, payload)) = frame_payload(m) else {
                    continue;
                };
                match decode(&payload)? {
                    Wire::Challenge(c) => break c,
                    Wire::Reject(reason) => {
                        return Err(ConnectorError::Handshake(format!(
                            "leader rejected this rank: {reason}"
                        )))
                    }
                    other => tracing::warn!(?other, "unexpected message during the handshake"),
                }
            };
            let nonce = zmq_auth::random_bytes::<16>()?;
            let msg = Wire::Hello {
                layout: me.clone(),
                nonce,
                tag: secret.hello_tag(&challenge, &nonce, &layout_bytes(&me)?),
            };
            socket
                .send(ZmqMessage::from(encode(&msg)?))
                .await
                .map_err(|e| ConnectorError::Channel(e.to_string()))?;
            loop {
                let m = socket
                    .recv()
                    .await
                    .map_err(|e| ConnectorError::Channel(e.to_string()))?;
                let Some((_, payload)) = frame_payload(m) else {
                    continue;
                };
                match decode(&payload)? {
                    Wire::Welcome { layout, tag } => {
                        if layout_bytes(&layout).is_ok_and(|b| secret.welcome_ok(&nonce, &b, &tag))
                        {
                            return Ok(layout);
                        }
                        tracing::warn!(
                            "ignored a welcome that is not from this deployment's leader"
                        );
                    }
                    Wire::Reject(reason) if reason == AUTH_FAILED && given.is_none() => {
                        // A key file of an earlier leader on this endpoint: read it again.
                        tracing::info!("leader refused this rank's key; rereading the key file");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue 'hello;
                    }
                    Wire::Reject(reason) => {
                        return Err(ConnectorError::Handshake(format!(
                            "leader rejected this rank: {reason}"
                        )))
                    }
                    other => tracing::warn!(?other, "unexpected message during the handshake"),
                }
            }
        }
    };
    let verdict = match tokio::time::timeout(timeout, handshake).await {
        Ok(v) => v,
        Err(_) => Err(ConnectorError::Handshake(format!(
            "no welcome from the leader at {endpoint} within {timeout:?}"
        ))),
    };
    let ok = verdict.is_ok();
    let _ = ready.send(verdict);
    if !ok {
        return;
    }
    let (mut tx, mut rx) = socket.split();
    loop {
        tokio::select! {
            out = out_rx.recv() => match out {
                Some(bytes) => {
                    if let Err(e) = tx.send(ZmqMessage::from(bytes)).await {
                        tracing::warn!(error = %e, "sending a report failed");
                    }
                }
                None => return,
            },
            _ = stop_rx.recv() => {
                // Flush what is queued, then close.
                while let Ok(bytes) = out_rx.try_recv() {
                    let _ = tx.send(ZmqMessage::from(bytes)).await;
                }
                tokio::time::sleep(LINGER).await;
                return;
            },
            msg = rx.recv() => {
                let Ok(msg) = msg else {
                    let _ = steps.send(None);
                    return;
                };
                let Some((_, payload)) = frame_payload(msg) else { continue };
                match decode(&payload) {
                    Ok(Wire::Step(m)) => {
                        let _ = steps.send(Some(m));
                    }
                    Ok(Wire::Shutdown) => {
                        let _ = steps.send(None);
                    }
                    Ok(other) => tracing::warn!(?other, "unexpected message from the leader"),
                    Err(e) => tracing::warn!(error = %e, "undecodable frame from the leader"),
                }
            }
        }
    }
}
