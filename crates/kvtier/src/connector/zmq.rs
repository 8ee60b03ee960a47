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
//!    ([`ClusterLayout::agree`]) and answers every rank `Welcome { layout, tag }` (tagged with
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
use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc as tk;
use zeromq::{DealerSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::connector::messages::{ClusterLayout, RankLayout, StepMetadata, WorkerReport};
use crate::connector::worker::ReportSink;
use crate::connector::zmq_auth::{self, ChannelSecret, AUTH_FAILED};
use crate::connector::ConnectorError;

/// Version of the channel's frames (2: authenticated hello and welcome).
pub const WIRE_VERSION: u32 = 2;

/// How long a closing socket keeps running so that queued frames leave (like `ZMQ_LINGER`).
const LINGER: Duration = Duration::from_millis(200);

/// Everything that crosses the wire.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Wire {
    Hello {
        layout: RankLayout,
        nonce: [u8; 16],
        tag: [u8; 32],
    },
    Welcome {
        layout: ClusterLayout,
        tag: [u8; 32],
    },
    Reject(String),
    Report(WorkerReport),
    Step(StepMetadata),
    Shutdown,
}

/// Encode one frame.
pub fn encode(msg: &Wire) -> Result<Vec<u8>, ConnectorError> {
    encode_with_version(WIRE_VERSION, msg)
}

fn layout_bytes<T: Serialize>(l: &T) -> Result<Vec<u8>, ConnectorError> {
    postcard::to_stdvec(l).map_err(|e| ConnectorError::Codec(e.to_string()))
}

/// A hello for `layout`, authenticated with `secret` under a fresh nonce.
pub fn hello(secret: &ChannelSecret, layout: RankLayout) -> Result<Wire, ConnectorError> {
    let nonce = zmq_auth::random_bytes::<16>()?;
    let tag = secret.hello_tag(&nonce, &layout_bytes(&layout)?);
    Ok(Wire::Hello { layout, nonce, tag })
}

/// Encode with an explicit version (tests of the version check).
pub fn encode_with_version(version: u32, msg: &Wire) -> Result<Vec<u8>, ConnectorError> {
    let mut out =
        postcard::to_stdvec(&version).map_err(|e| ConnectorError::Codec(e.to_string()))?;
    out.extend(postcard::to_stdvec(msg).map_err(|e| ConnectorError::Codec(e.to_string()))?);
    Ok(out)
}

/// Decode one frame, checking the version first.
pub fn decode(bytes: &[u8]) -> Result<Wire, ConnectorError> {
    let (version, rest): (u32, &[u8]) = postcard::take_from_bytes(bytes)
        .map_err(|e| ConnectorError::Codec(format!("frame header: {e}")))?;
    if version != WIRE_VERSION {
        return Err(ConnectorError::Handshake(format!(
            "peer speaks protocol version {version}, this build speaks {WIRE_VERSION}"
        )));
    }
    postcard::from_bytes(rest).map_err(|e| ConnectorError::Codec(format!("frame body: {e}")))
}

/// The endpoints this build can bind and connect: `tcp://…` or `ipc://<non-empty path>`.
pub fn check_endpoint(endpoint: &str) -> Result<(), ConnectorError> {
    let bad = |why: &str| {
        ConnectorError::Channel(format!(
            "ZeroMQ endpoint {endpoint:?} {why} (expected tcp://host:port or ipc:///path)"
        ))
    };
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        if path.is_empty() {
            return Err(bad("has no socket path"));
        }
    } else if !endpoint.starts_with("tcp://") {
        return Err(bad("uses an unsupported transport"));
    }
    endpoint
        .parse::<zeromq::Endpoint>()
        .map_err(|e| bad(&format!("does not parse: {e}")))?;
    Ok(())
}

/// Before binding `ipc://path`: removes a socket file nobody listens on (left by a leader that
/// died); a live one is left alone (the bind then fails with "address in use").
fn reclaim_stale_ipc(endpoint: &str) {
    use std::os::unix::fs::FileTypeExt;
    let Some(path) = endpoint.strip_prefix("ipc://") else {
        return;
    };
    let is_socket = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket());
    if is_socket {
        if let Err(e) = std::os::unix::net::UnixStream::connect(path) {
            if e.kind() == std::io::ErrorKind::ConnectionRefused {
                tracing::info!(path, "removing a stale leader socket");
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

/// After binding `ipc://path`: only this user may connect.
fn restrict_ipc(endpoint: &str) -> Result<(), ConnectorError> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(|e| {
            ConnectorError::Channel(format!("chmod 0600 of the leader socket {path}: {e}"))
        })?;
    }
    Ok(())
}

fn runtime() -> Result<tokio::runtime::Runtime, ConnectorError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ConnectorError::Channel(format!("tokio runtime: {e}")))
}

fn frame_payload(msg: ZmqMessage) -> Option<(Option<Vec<u8>>, Vec<u8>)> {
    let mut frames = msg.into_vec();
    let payload = frames.pop()?.to_vec();
    let identity = frames.first().map(|b| b.to_vec());
    Some((identity, payload))
}

// ----- leader side ------------------------------------------------------------------------

enum LeaderCmd {
    Handshake {
        world_size: u32,
        block_size: u32,
        timeout: Duration,
        reply: std_mpsc::Sender<Result<ClusterLayout, ConnectorError>>,
    },
    Attach(std_mpsc::Sender<WorkerReport>),
    Broadcast(Vec<u8>),
    Shutdown,
}

/// The leader's end of the channel.
pub struct LeaderChannel {
    endpoint: String,
    cmd: tk::UnboundedSender<LeaderCmd>,
    thread: Option<JoinHandle<()>>,
}

impl LeaderChannel {
    /// Bind a ROUTER at `endpoint` (e.g. `tcp://127.0.0.1:0`; the resolved one is
    /// [`LeaderChannel::endpoint`]), with the secret of [`zmq_auth::leader_secret`]
    /// (`KVTIER_ZMQ_SECRET`, else a fresh one in the endpoint's private key file).
    pub fn bind(endpoint: &str) -> Result<LeaderChannel, ConnectorError> {
        Self::bind_with(endpoint, None)
    }

    /// As [`LeaderChannel::bind`], with an explicit secret (`None`: as `bind`).
    pub fn bind_with(
        endpoint: &str,
        secret: Option<ChannelSecret>,
    ) -> Result<LeaderChannel, ConnectorError> {
        check_endpoint(endpoint)?;
        reclaim_stale_ipc(endpoint);
        let (cmd_tx, cmd_rx) = tk::unbounded_channel();
        let (ready_tx, ready_rx) = std_mpsc::channel();
        let ep = endpoint.to_owned();
        let thread = std::thread::Builder::new()
            .name("kvtier-zmq-leader".into())
            .spawn(move || {
                let rt = match runtime() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                rt.block_on(leader_loop(ep, secret, cmd_rx, ready_tx));
            })
            .map_err(|e| ConnectorError::Channel(format!("spawn: {e}")))?;
        let endpoint = ready_rx
            .recv_timeout(Duration::from_secs(30))
            .map_err(|_| ConnectorError::Channel("leader socket thread did not start".into()))??;
        Ok(LeaderChannel {
            endpoint,
            cmd: cmd_tx,
            thread: Some(thread),
        })
    }

    /// The endpoint workers connect to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Wait (at most `timeout`) for `world_size` ranks, agree on their layout and welcome them.
    pub fn handshake(
        &self,
        world_size: u32,
        block_size: u32,
        timeout: Duration,
    ) -> Result<ClusterLayout, ConnectorError> {
        let (tx, rx) = std_mpsc::channel();
        self.cmd
            .send(LeaderCmd::Handshake {
                world_size,
                block_size,
                timeout,
                reply: tx,
            })
            .map_err(|_| ConnectorError::Channel("leader socket thread is gone".into()))?;
        rx.recv()
            .map_err(|_| ConnectorError::Channel("leader socket thread is gone".into()))?
    }

    /// Forward every worker report (including those that arrived earlier) to `reports`
    /// (`Leader::report_sender()`).
    pub fn attach(&self, reports: std_mpsc::Sender<WorkerReport>) -> Result<(), ConnectorError> {
        self.cmd
            .send(LeaderCmd::Attach(reports))
            .map_err(|_| ConnectorError::Channel("leader socket thread is gone".into()))
    }

    /// Send the step's metadata to every rank (for engines that do not broadcast it themselves).
    pub fn broadcast(&self, meta: &StepMetadata) -> Result<(), ConnectorError> {
        let bytes = encode(&Wire::Step(meta.clone()))?;
        self.cmd
            .send(LeaderCmd::Broadcast(bytes))
            .map_err(|_| ConnectorError::Channel("leader socket thread is gone".into()))
    }

    /// Tell every rank to stop and close the socket.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.cmd.send(LeaderCmd::Shutdown);
        if let Some(t) = self.thread.take() {
            join_within(t, CHANNEL_STOP_TIMEOUT, "the leader's ZeroMQ thread");
        }
    }
}

/// How long stopping a channel waits for its socket thread (it flushes queued messages first).
const CHANNEL_STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// Join `t` if it ends within `timeout`; otherwise log and leave it detached (a socket thread
/// stuck in the network must not hang the engine's shutdown). True if it was joined.
fn join_within(t: std::thread::JoinHandle<()>, timeout: Duration, what: &str) -> bool {
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

impl Drop for LeaderChannel {
    fn drop(&mut self) {
        self.stop();
    }
}

struct PendingHandshake {
    world_size: u32,
    block_size: u32,
    deadline: tokio::time::Instant,
    reply: std_mpsc::Sender<Result<ClusterLayout, ConnectorError>>,
}

async fn leader_loop(
    endpoint: String,
    secret: Option<ChannelSecret>,
    mut cmd_rx: tk::UnboundedReceiver<LeaderCmd>,
    ready: std_mpsc::Sender<Result<String, ConnectorError>>,
) {
    let mut socket = RouterSocket::new();
    let bound = match socket.bind(&endpoint).await {
        Ok(ep) => ep.to_string(),
        Err(e) => {
            let _ = ready.send(Err(ConnectorError::Channel(format!(
                "bind {endpoint}: {e}"
            ))));
            return;
        }
    };
    if let Err(e) = restrict_ipc(&bound) {
        let _ = ready.send(Err(e));
        return;
    }
    let resolved = match secret {
        Some(s) => Ok((s, None)),
        None => zmq_auth::leader_secret(&bound).map(|(s, g)| (s, Some(g))),
    };
    let (secret, _key_file) = match resolved {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(bound));
    let (mut tx, mut rx) = socket.split();
    // identity -> (rank layout, its hello's nonce)
    let mut hellos: HashMap<Vec<u8>, (RankLayout, [u8; 16])> = HashMap::new();
    let mut nonces_seen: std::collections::HashSet<[u8; 16]> = Default::default();
    // Why peers were refused (named in a handshake timeout).
    let mut refused: Vec<String> = Vec::new();
    let mut peers: Vec<Vec<u8>> = Vec::new();
    let mut pending: Option<PendingHandshake> = None;
    let mut reports: Option<std_mpsc::Sender<WorkerReport>> = None;
    let mut backlog: Vec<WorkerReport> = Vec::new();
    loop {
        let deadline = pending
            .as_ref()
            .map(|p| p.deadline)
            .unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(3600));
        tokio::select! {
            cmd = cmd_rx.recv() => match cmd {
                None | Some(LeaderCmd::Shutdown) => {
                    if let Ok(bytes) = encode(&Wire::Shutdown) {
                        for p in &peers {
                            let _ = send_to(&mut tx, p, &bytes).await;
                        }
                    }
                    // Linger: give queued frames time to leave before the socket closes.
                    tokio::time::sleep(LINGER).await;
                    return;
                }
                Some(LeaderCmd::Handshake { world_size, block_size, timeout, reply }) => {
                    pending = Some(PendingHandshake {
                        world_size,
                        block_size,
                        deadline: tokio::time::Instant::now() + timeout,
                        reply,
                    });
                }
                Some(LeaderCmd::Attach(s)) => {
                    for r in backlog.drain(..) {
                        let _ = s.send(r);
                    }
                    reports = Some(s);
                }
                Some(LeaderCmd::Broadcast(bytes)) => {
                    for p in &peers {
                        if let Err(e) = send_to(&mut tx, p, &bytes).await {
                            tracing::warn!(error = %e, "broadcast to a rank failed");
                        }
                    }
                }
            },
            msg = rx.recv() => {
                let Ok(msg) = msg else { continue };
                let Some((Some(id), payload)) = frame_payload(msg) else { continue };
                let peer = hex_id(&id);
                match decode(&payload) {
                    Ok(Wire::Hello { layout, nonce, tag }) => {
                        let authentic = layout_bytes(&layout)
                            .is_ok_and(|b| secret.hello_ok(&nonce, &b, &tag));
                        let why = if !authentic {
                            Some(AUTH_FAILED.to_string())
                        } else if peers.contains(&id) || !nonces_seen.insert(nonce) {
                            Some("replayed or repeated hello".to_string())
                        } else {
                            None
                        };
                        match why {
                            None => {
                                hellos.insert(id, (layout, nonce));
                            }
                            Some(why) => {
                                tracing::warn!(%peer, claimed_rank = layout.rank, reason = %why, "refused a peer on the leader channel");
                                refused.push(format!("peer {peer}: {why}"));
                                if let Ok(b) = encode(&Wire::Reject(why)) {
                                    let _ = send_to(&mut tx, &id, &b).await;
                                }
                            }
                        }
                    }
                    Ok(Wire::Report(r)) if peers.contains(&id) => match &reports {
                        Some(s) => {
                            let _ = s.send(r);
                        }
                        None => backlog.push(r),
                    },
                    Ok(Wire::Report(_)) => {
                        tracing::warn!(%peer, "refused a report from a peer that is not a welcomed rank");
                    }
                    Ok(other) => tracing::warn!(%peer, ?other, "unexpected message from a worker"),
                    Err(e) => {
                        tracing::warn!(%peer, error = %e, "undecodable frame on the leader channel");
                        if !peers.contains(&id) {
                            refused.push(format!("peer {peer}: {e}"));
                            if let Ok(b) = encode(&Wire::Reject(e.to_string())) {
                                let _ = send_to(&mut tx, &id, &b).await;
                            }
                        }
                    }
                }
            },
            _ = tokio::time::sleep_until(deadline), if pending.is_some() => {
                if let Some(p) = pending.take() {
                    let mut msg = format!(
                        "timed out: {} of {} ranks connected",
                        hellos.len(),
                        p.world_size
                    );
                    if !refused.is_empty() {
                        msg.push_str(&format!("; refused {}", refused.join("; ")));
                    }
                    let _ = p.reply.send(Err(ConnectorError::Handshake(msg)));
                }
            }
        }
        // Complete the handshake once every rank spoke (or one spoke nonsense).
        let ready_now = pending
            .as_ref()
            .is_some_and(|p| hellos.len() >= p.world_size as usize);
        if ready_now {
            if let Some(p) = pending.take() {
                let result = agree(&hellos, p.block_size, p.world_size);
                for (id, (_, nonce)) in &hellos {
                    let reply = match &result {
                        Ok(layout) => match layout_bytes(layout) {
                            Ok(b) => Wire::Welcome {
                                layout: layout.clone(),
                                tag: secret.welcome_tag(nonce, &b),
                            },
                            Err(e) => Wire::Reject(e.to_string()),
                        },
                        Err(e) => Wire::Reject(e.to_string()),
                    };
                    if let Ok(bytes) = encode(&reply) {
                        let _ = send_to(&mut tx, id, &bytes).await;
                    }
                }
                if result.is_ok() {
                    peers = hellos.keys().cloned().collect();
                }
                let _ = p.reply.send(result);
            }
        }
    }
}

fn hex_id(id: &[u8]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

fn agree(
    hellos: &HashMap<Vec<u8>, (RankLayout, [u8; 16])>,
    block_size: u32,
    world_size: u32,
) -> Result<ClusterLayout, ConnectorError> {
    let layouts: Vec<RankLayout> = hellos.values().map(|(l, _)| l.clone()).collect();
    if let Some(l) = layouts.iter().find(|l| l.world_size != world_size) {
        return Err(ConnectorError::Handshake(format!(
            "rank {} says world size {}, the leader expects {world_size}",
            l.rank, l.world_size
        )));
    }
    ClusterLayout::agree(&layouts, block_size)
}

async fn send_to(
    tx: &mut zeromq::RouterSendHalf,
    id: &[u8],
    bytes: &[u8],
) -> Result<(), ConnectorError> {
    let mut m = ZmqMessage::from(bytes.to_vec());
    m.push_front(id.to_vec().into());
    tx.send(m)
        .await
        .map_err(|e| ConnectorError::Channel(e.to_string()))
}

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
        let thread = std::thread::Builder::new()
            .name("kvtier-zmq-worker".into())
            .spawn(move || {
                let rt = match runtime() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                rt.block_on(worker_loop(
                    ep, me, secret, timeout, out_rx, stop_rx, steps_tx, ready_tx,
                ));
            })
            .map_err(|e| ConnectorError::Channel(format!("spawn: {e}")))?;
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
            let nonce = zmq_auth::random_bytes::<16>()?;
            let msg = Wire::Hello {
                layout: me.clone(),
                nonce,
                tag: secret.hello_tag(&nonce, &layout_bytes(&me)?),
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
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
