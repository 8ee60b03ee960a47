//! The leader's state behind its mutex, and how the Rust leader is built: exactly once, with the
//! ranks' layout, from the settings' `bytes_per_block`, the in-process rank 0 worker's
//! registration, or every rank's ZeroMQ handshake (waiting without the GIL); the flags the adapter
//! set before (verdicts, holds, exclusions, remote hits) are applied to it then.
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Duration;

use kvtier::connector::leader::Leader;
use kvtier::connector::messages::{ClusterLayout, WorkerReport};
use kvtier::connector::zmq::LeaderChannel;
use kvtier::connector::ConnectorError;
use kvtier::ids::DeviceBlockId;
use kvtier_io::metrics_http::StatsPublisher;
use pyo3::prelude::*;

use crate::errors::{BridgeError, BridgeResult, Family};
use crate::rendezvous::Rendezvous;
use crate::settings::Settings;

/// Where the ranks' layout comes from when the settings do not give `bytes_per_block`.
pub(super) enum Pending {
    /// Rank 0's worker in this process registers it.
    InProcess {
        rendezvous: Arc<Rendezvous>,
        timeout: Duration,
    },
    /// Every rank says hello over ZeroMQ; the handshake runs on its own thread from construction.
    Zmq {
        handshake: Receiver<Result<ClusterLayout, ConnectorError>>,
        timeout: Duration,
    },
}

pub(super) struct Inner {
    pub(super) block_size: usize,
    pub(super) world_size: u32,
    pub(super) async_loads: bool,
    pub(super) sync_host_loads: bool,
    /// `Leader::set_recompute_tail`, applied when the leader is built.
    pub(super) recompute_tail: usize,
    /// `Leader::set_load_verdicts`, applied when the leader is built.
    pub(super) load_verdicts: bool,
    /// `Leader::set_unpaged_exclusion`, applied when the leader is built.
    pub(super) unpaged_exclusion: bool,
    /// `Leader::enable_match_holds(expire)`, applied when the leader is built (`None`: off).
    pub(super) match_holds: Option<bool>,
    /// `Leader::set_near_remote(false)` when the leader is built (`load_remote_hits_async`).
    pub(super) remote_hits_async: bool,
    pub(super) settings: Settings,
    pub(super) pending: Option<Pending>,
    pub(super) leader: Option<Leader>,
    pub(super) reports: Option<Receiver<WorkerReport>>,
    pub(super) zmq: Option<Arc<LeaderChannel>>,
    /// Snapshots for the process's metrics endpoint (`metrics.enabled`).
    pub(super) metrics: Option<StatsPublisher>,
    pub(super) shut_down: bool,
}

impl Inner {
    /// Everything through the composition root, as in every other engine.
    pub(super) fn build(&mut self, layout: ClusterLayout) -> BridgeResult<()> {
        let plan = crate::vllm_support::composition(&self.settings, layout)?;
        let remote = plan.remote_store().map_err(crate::vllm_support::bridge)?;
        let mut leader = plan
            .leader(remote, self.async_loads)
            .map_err(crate::vllm_support::bridge)?;
        leader.set_sync_host_loads(self.sync_host_loads);
        leader.set_recompute_tail(self.recompute_tail);
        leader.set_load_verdicts(self.load_verdicts);
        leader.set_unpaged_exclusion(self.unpaged_exclusion);
        if let Some(expire) = self.match_holds {
            leader.enable_match_holds(expire);
        }
        if self.remote_hits_async {
            leader.set_near_remote(false);
        }
        let (window, null_block) = self.settings.sliding_window().map_err(BridgeError::from)?;
        leader.set_window(window, null_block.map(DeviceBlockId));
        // One endpoint per process: with several KV cache groups, group 0's leader publishes (its
        // requests' counters are the engine's; its blocks and bytes are group 0's).
        let group = self.settings.kv_cache_group().map_err(BridgeError::from)?;
        if self.metrics.is_none() && group.is_none_or(|(index, _, _)| index == 0) {
            self.metrics = plan.metrics().map_err(crate::vllm_support::bridge)?;
        }
        if let Some(p) = &self.metrics {
            p.publish(leader.stats());
        }
        self.leader = Some(leader);
        Ok(())
    }

    /// The Rust leader, built on first use from the in-process workers' layouts if needed.
    pub(super) fn ready(&mut self, py: Python<'_>) -> BridgeResult<&mut Leader> {
        if self.shut_down {
            return Err(BridgeError::local(
                Family::Connector,
                "the leader was shut down",
            ));
        }
        if self.leader.is_none() {
            match self.pending.take() {
                None => {
                    return Err(BridgeError::local(
                        Family::Connector,
                        "leader has no layout source",
                    ))
                }
                Some(Pending::InProcess {
                    rendezvous,
                    timeout,
                }) => {
                    let rv = Arc::clone(&rendezvous);
                    let layouts = py.detach(|| rv.wait_for(0, timeout));
                    let Some(layouts) = layouts else {
                        self.pending = Some(Pending::InProcess {
                            rendezvous,
                            timeout,
                        });
                        return Err(BridgeError::local(
                            Family::Connector,
                            format!(
                                "no kvtier worker of rank 0 registered its KV cache in this process within {}s \
                                 (connector.leader_worker_timeout_secs); the scheduler needs rank 0's worker in its process",
                                timeout.as_secs()
                            ),
                        ));
                    };
                    let r0 = &layouts[0];
                    if r0.block_size as usize != self.block_size {
                        return Err(BridgeError::local(
                            Family::Connector,
                            format!(
                                "rank 0 registered {} tokens per block, the leader was configured with {}",
                                r0.block_size, self.block_size
                            ),
                        ));
                    }
                    // Tensor-parallel shards are equal: every rank holds rank 0's bytes per block.
                    let layout = ClusterLayout {
                        block_size: r0.block_size,
                        num_device_blocks: r0.num_device_blocks,
                        bytes_per_block: vec![r0.bytes_per_block; self.world_size as usize],
                    };
                    self.reports = rendezvous.take_receiver();
                    self.build(layout)?;
                }
                Some(Pending::Zmq { handshake, timeout }) => {
                    let (handshake, got) = py.detach(move || {
                        let got = handshake.recv_timeout(timeout + Duration::from_secs(5));
                        (handshake, got)
                    });
                    let layout = match got {
                        Ok(Ok(l)) => l,
                        Ok(Err(e)) => return Err(e.into()),
                        Err(_) => {
                            self.pending = Some(Pending::Zmq { handshake, timeout });
                            return Err(BridgeError::local(
                                Family::Connector,
                                format!(
                                    "the ranks did not all connect over ZeroMQ within {}s (connector.leader_worker_timeout_secs)",
                                    timeout.as_secs()
                                ),
                            ));
                        }
                    };
                    self.build(layout)?;
                    if let (Some(ch), Some(l)) = (&self.zmq, &self.leader) {
                        ch.attach(l.report_sender())?;
                    }
                }
            }
        }
        let leader = self
            .leader
            .as_mut()
            .ok_or_else(|| BridgeError::local(Family::Connector, "leader not built"))?;
        if let Some(rx) = &self.reports {
            while let Ok(r) = rx.try_recv() {
                leader.apply_report(r);
            }
        }
        if let Some(p) = &self.metrics {
            p.publish(leader.stats());
        }
        Ok(leader)
    }
}
