//! The leader's end: a ROUTER that authenticates each rank's hello, agrees the cluster layout
//! once all `world_size` ranks said hello (or rejects every rank with one reason), then forwards
//! reports and broadcasts step metadata. Only authenticated ranks are counted or listened to.
use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::mpsc as tk;
use zeromq::{RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::connector::messages::{ClusterLayout, RankLayout, StepMetadata, WorkerReport};
use crate::connector::zmq_auth::{self, ChannelSecret, AUTH_FAILED};
use crate::connector::ConnectorError;

use super::endpoint::*;
use super::thread::*;
use super::wire::*;

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
        let thread = spawn_socket_thread("kvtier-zmq-leader", ready_tx, move |ready| {
            leader_loop(ep, secret, cmd_rx, ready)
        })?;
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

impl Drop for LeaderChannel {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Challenges outstanding at once (one per peer that said `Hi` and has not said hello yet).
const MAX_CHALLENGES: usize = 1024;
/// Refusals remembered by reason; the rest are only counted.
const MAX_REFUSED: usize = 16;

/// Why peers were refused, for the handshake's timeout message: the first [`MAX_REFUSED`]
/// reasons and a count of the rest (#28: a record of every refused frame grew without bound).
#[derive(Default)]
struct Refusals {
    first: Vec<String>,
    more: u64,
}

impl Refusals {
    fn push(&mut self, why: String) {
        if self.first.len() < MAX_REFUSED {
            self.first.push(why);
        } else {
            self.more = self.more.saturating_add(1);
        }
    }

    fn describe(&self) -> Option<String> {
        if self.first.is_empty() {
            return None;
        }
        let mut s = self.first.join("; ");
        if self.more > 0 {
            s.push_str(&format!("; and {} more", self.more));
        }
        Some(s)
    }

    #[cfg(test)]
    fn held(&self) -> usize {
        self.first.len()
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
    // Challenges issued and not yet answered, by peer identity (at most MAX_CHALLENGES, the
    // oldest forgotten first).
    let mut challenges: HashMap<Vec<u8>, [u8; 16]> = HashMap::new();
    let mut challenge_order: std::collections::VecDeque<Vec<u8>> = Default::default();
    // Why peers were refused (named in a handshake timeout): the first MAX_REFUSED, then a count.
    let mut refused = Refusals::default();
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
                    Ok(Wire::Hi) => {
                        let Ok(c) = zmq_auth::random_bytes::<16>() else { continue };
                        if challenges.insert(id.clone(), c).is_none() {
                            challenge_order.push_back(id.clone());
                        }
                        while challenges.len() > MAX_CHALLENGES {
                            match challenge_order.pop_front() {
                                Some(old) => {
                                    challenges.remove(&old);
                                }
                                None => challenges.clear(),
                            }
                        }
                        if let Ok(b) = encode(&Wire::Challenge(c)) {
                            let _ = send_to(&mut tx, &id, &b).await;
                        }
                    }
                    Ok(Wire::Hello { layout, nonce, tag }) => {
                        // A challenge answers one hello.
                        let challenge = challenges.remove(&id);
                        let authentic = challenge.is_some_and(|c| {
                            layout_bytes(&layout)
                                .is_ok_and(|b| secret.hello_ok(&c, &nonce, &b, &tag))
                        });
                        let why = if !authentic {
                            Some(AUTH_FAILED.to_string())
                        } else if peers.contains(&id) {
                            Some("repeated hello".to_string())
                        } else {
                            None
                        };
                        match why {
                            None => {
                                hellos.insert(id, (layout, nonce));
                            }
                            Some(why) => {
                                crate::warn_limited!(%peer, claimed_rank = layout.rank, reason = %why, "refused a peer on the leader channel");
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
                        crate::warn_limited!(%peer, "refused a report from a peer that is not a welcomed rank");
                    }
                    Ok(other) => crate::warn_limited!(%peer, ?other, "unexpected message from a worker"),
                    Err(e) => {
                        crate::warn_limited!(%peer, error = %e, "undecodable frame on the leader channel");
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
                    if let Some(r) = refused.describe() {
                        msg.push_str(&format!("; refused {r}"));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (#28): the leader kept a record of every refused frame (300,000 garbage frames:
    /// +74 MB, never freed). It keeps the first MAX_REFUSED reasons and counts the rest.
    #[test]
    fn refusals_are_bounded_and_counted() {
        let mut r = Refusals::default();
        for i in 0..100_000 {
            r.push(format!("peer {i}: garbage"));
        }
        assert_eq!(r.held(), MAX_REFUSED);
        let d = r.describe().unwrap_or_default();
        assert!(d.starts_with("peer 0: garbage"), "{d}");
        assert!(
            d.ends_with(&format!("and {} more", 100_000 - MAX_REFUSED)),
            "{d}"
        );
    }
}
