//! One request inside the engine: its tokens, its G1 blocks, its progress and what has been
//! reported to the connector.
//!
//! Invariants: `num_computed <= tokens.len()`; `blocks.len() * block_size >= num_computed`;
//! `hashes[i]` is the sequence hash of full block i of `tokens`; blocks `0..num_registered` are
//! published in the G1 prefix cache (or were already cached when matched); `tokens_reported` and
//! `blocks_reported` count what the connector has already been told.
use kvtier::hash::{chain_block, HashSalt, SequenceHash};
use kvtier::RequestId;
use tokio::sync::mpsc::UnboundedSender;

use crate::api::{FinishReason, GenerateEvent, Usage};

/// Events waiting to be delivered at the end of a step.
pub(crate) type Outbox = Vec<(UnboundedSender<GenerateEvent>, GenerateEvent)>;

pub(crate) struct Request {
    pub id: RequestId,
    /// Admission order; lower is older. Preemption picks the highest.
    pub seq: u64,
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Stop when `tokens.len()` reaches this.
    pub max_total_len: usize,
    pub ignore_eos: bool,
    /// Prefill role: stop after the first generated token.
    pub stop_after_first: bool,
    pub num_computed: usize,
    pub blocks: Vec<u32>,
    pub hashes: Vec<SequenceHash>,
    pub num_registered: usize,
    pub generated: usize,
    pub cached_tokens: usize,
    pub admitted_once: bool,
    pub tx: UnboundedSender<GenerateEvent>,
    // connector reporting
    pub reported_once: bool,
    pub tokens_reported: usize,
    pub blocks_reported: usize,
    pub resumed: bool,
    /// Connector-matched tokens still to subtract from the next reported computed position.
    pub ext_subtract: usize,
    /// Tokens an async load will add to `num_computed` when it completes.
    pub pending_load: usize,
    pub finish: Option<FinishReason>,
}

impl Request {
    /// Extend `hashes` to every full block of `tokens`.
    pub(crate) fn update_hashes(&mut self, salt: HashSalt, block_size: usize) {
        let full = self.tokens.len() / block_size;
        while self.hashes.len() < full {
            let i = self.hashes.len();
            let parent = self.hashes.last().copied();
            let h = chain_block(
                parent,
                salt,
                &self.tokens[i * block_size..(i + 1) * block_size],
            );
            self.hashes.push(h);
        }
    }

    /// The connector must be told everything again (after preemption or a failed load): all
    /// blocks in the next record, flagged as resumed if it was reported before.
    pub(crate) fn forget_connector_view(&mut self) {
        self.blocks_reported = 0;
        self.resumed = self.reported_once;
        self.ext_subtract = 0;
    }

    pub(crate) fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens: self.generated,
            cached_tokens: self.cached_tokens,
        }
    }

    /// Queue an event in `outbox` (sent after the step's metrics are published); `false` if the
    /// receiver is gone (the request is then aborted).
    pub(crate) fn send(&self, outbox: &mut Outbox, ev: GenerateEvent) -> bool {
        if self.tx.is_closed() {
            return false;
        }
        outbox.push((self.tx.clone(), ev));
        true
    }
}
