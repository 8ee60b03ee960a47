//! The per-request slot: a pure state machine (no I/O, no pools) that consumes the engine's
//! schedule for one request and says which full blocks to offload and which to onboard.
//!
//! Invariants:
//! - the device block table has one owner, this slot: an id already in the table is recognised,
//!   never appended twice (TensorRT-LLM reports a new request's blocks at allocation and again in
//!   its first record);
//! - a block index is handed out for offload at most once per slot, only when every token of the
//!   block is known and computed by a forward pass whose end gates the store, and never while its
//!   tokens are unverified draft tokens; partial blocks never;
//! - blocks the engine took from its own prefix cache (below `num_computed_tokens` at the first
//!   record) and blocks onboarded by kvtier are not offloaded again;
//! - invalid input returns [`ConnectorError::InvalidInput`] naming the request and the field and
//!   leaves the slot exactly as it was (validation happens before any mutation);
//! - the slot knows every token's block through `hashes` (one per full block), but keeps the
//!   tokens themselves only from `token_base` on: matching stores the whole list (the first
//!   record is compared with it exactly), a running request only its partial tail block, so a
//!   step never copies a prompt and a long generation never grows a token buffer.
use crate::connector::fasthash::FastSet;

pub use table::HOLE;
use table::{scan, DeviceTable, IdFilter};

use crate::connector::step::StepRecord;
use crate::connector::ConnectorError;
use crate::hash::{chain_block, extend_chain, HashSalt, SequenceHash};
use crate::ids::{DeviceBlockId, RequestId};

/// Where a slot is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    /// Seen by matching (or created), no device blocks yet.
    Waiting,
    /// Device blocks allocated (`update_state_after_alloc`), not yet scheduled.
    Allocated,
    /// Scheduled at least once; the last record computed prompt tokens.
    Prefilling,
    /// Scheduled; the last record appended generated tokens.
    Decoding,
    /// Preempted: the device table is gone; matching is allowed again.
    Preempted,
    /// The engine finished the request; no further records are accepted.
    Finished,
}

/// One full block leaving the device for kvtier's tiers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OffloadBlock {
    /// Block index within the request (block `i` holds tokens `i*bs .. (i+1)*bs`).
    pub index: usize,
    /// The device block holding it.
    pub device: DeviceBlockId,
    /// Its sequence hash.
    pub hash: SequenceHash,
}

/// One block the engine expects kvtier to fill (its source is chosen by the leader).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OnboardBlock {
    /// Block index within the request.
    pub index: usize,
    /// The device block to fill.
    pub device: DeviceBlockId,
    /// The sequence hash of its content.
    pub hash: SequenceHash,
}

/// What the last (side-effect free) match of this request found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatchRecord {
    /// Tokens the engine already holds on the device (block aligned).
    pub device_tokens: usize,
    /// Tokens kvtier's tiers can supply beyond them (block aligned).
    pub external_tokens: usize,
}

/// The per-request state machine. See the module documentation for its invariants.
#[derive(Clone, Debug)]
pub struct Slot {
    id: RequestId,
    block_size: usize,
    salt: HashSalt,
    /// The known tokens from index `token_base` on (`token_base` is block aligned and at most
    /// `hashes.len() * block_size`: tokens before it are known only through their hashes).
    tokens: Vec<u32>,
    token_base: usize,
    /// Hashes of every full block of the known tokens.
    hashes: Vec<SequenceHash>,
    table: DeviceTable,
    /// Tokens whose KV is known to be on the device after the last record's forward pass.
    position: usize,
    /// Blocks `0..evaluated` were either offloaded, onboarded or taken from the device prefix cache.
    evaluated: usize,
    /// Block indices below this were handed out for offload at some point (survives preemption).
    offloaded_watermark: usize,
    state: SlotState,
    last_match: Option<MatchRecord>,
    /// Set when the request must be recomputed rather than loaded: matching then finds nothing
    /// external for it (see `Slot::refuse_external`). Survives preemption.
    external_refused: bool,
    /// kvtier cannot key this request correctly (see `Slot::private`): it is never matched and
    /// none of its blocks is handed out for offload.
    private: bool,
}

impl Slot {
    /// A fresh slot. `block_size` must be non-zero (the leader validates its configuration).
    pub fn new(id: RequestId, block_size: usize, salt: HashSalt) -> Self {
        debug_assert!(block_size > 0);
        Slot {
            id,
            block_size: block_size.max(1),
            salt,
            tokens: Vec::new(),
            token_base: 0,
            hashes: Vec::new(),
            table: DeviceTable::default(),
            position: 0,
            evaluated: 0,
            offloaded_watermark: 0,
            state: SlotState::Waiting,
            last_match: None,
            external_refused: false,
            private: false,
        }
    }

    /// A slot whose blocks no other request may ever see: matching offers it nothing and no
    /// block of it is handed out for offload. For requests whose KV depends on inputs kvtier
    /// cannot put into the key.
    pub fn private(id: RequestId, block_size: usize, salt: HashSalt) -> Self {
        let mut slot = Slot::new(id, block_size, salt);
        slot.private = true;
        slot.external_refused = true;
        slot
    }

    /// Whether this slot is private (see `Slot::private`).
    pub fn is_private(&self) -> bool {
        self.private
    }

    /// The salt this request's blocks are hashed with.
    pub fn salt(&self) -> HashSalt {
        self.salt
    }

    /// The request.
    pub fn id(&self) -> &RequestId {
        &self.id
    }
    /// Where the request is in its lifecycle.
    pub fn state(&self) -> SlotState {
        self.state
    }
    /// How many tokens of the request the slot knows (prompt and generated).
    pub fn num_tokens(&self) -> usize {
        self.token_base + self.tokens.len()
    }
    /// Hashes of the full blocks of the known tokens.
    pub fn hashes(&self) -> &[SequenceHash] {
        &self.hashes
    }
    /// The request's device block table, in block order.
    pub fn device_table(&self) -> &[DeviceBlockId] {
        &self.table.ids
    }

    /// The engine freed the device blocks of the positions before `block` (a sliding window
    /// left them): they become holes, and an id among them handed out again is a new block.
    pub fn forget_device_ids_before(&mut self, block: usize) -> usize {
        self.table.forget_before(block)
    }
    /// Tokens whose KV is on the device after the last record's forward pass.
    pub fn position(&self) -> usize {
        self.position
    }
    /// Blocks already offloaded, onboarded or found in the device prefix cache.
    pub fn evaluated_blocks(&self) -> usize {
        self.evaluated
    }
    /// From now on matching offers this request no external tokens: a load of it failed before
    /// it ever ran, or an allocation with external tokens was refused. It is recomputed, and
    /// cannot cycle through match -> load -> fail.
    pub fn refuse_external(&mut self) {
        self.external_refused = true;
    }

    /// Whether matching offers this request no external tokens (see `refuse_external`).
    pub fn external_refused(&self) -> bool {
        self.external_refused
    }

    /// What the last match of this request found.
    pub fn last_match(&self) -> Option<MatchRecord> {
        self.last_match
    }

    fn invalid(&self, field: &'static str, reason: impl Into<String>) -> ConnectorError {
        ConnectorError::InvalidInput {
            request: self.id.to_string(),
            field,
            reason: reason.into(),
        }
    }

    /// The known tokens from `token_base` on: the whole list after a match (matching keeps it).
    pub fn known_tokens(&self) -> &[u32] {
        &self.tokens
    }
    /// True once the engine scheduled the request (a record ran) and until it is preempted or
    /// finished.
    pub fn is_running(&self) -> bool {
        matches!(self.state, SlotState::Prefilling | SlotState::Decoding)
    }
    /// True while matching may run: before the request is allocated, or after preemption.
    pub fn can_match(&self) -> bool {
        matches!(
            self.state,
            SlotState::Waiting | SlotState::Preempted | SlotState::Allocated
        )
    }

    /// Replace or extend the known tokens with the engine's full token list, rehashing only what
    /// changed, and keep the whole list (the first record is compared with it). Used by
    /// matching, which always sees the whole sequence.
    pub fn set_all_tokens(&mut self, all_tokens: &[u32]) {
        if self.token_base == 0 && all_tokens.starts_with(&self.tokens) {
            let known = self.tokens.len();
            self.extend_keeping_all(&all_tokens[known..]);
        } else {
            // A running slot kept only its tail: the list is rehashed and kept whole again.
            self.tokens.clear();
            self.token_base = 0;
            self.hashes.clear();
            self.extend_keeping_all(all_tokens);
        }
    }

    /// Whether the known tokens are a prefix of `other` (earlier blocks compared by hash).
    fn known_is_prefix_of(&self, other: &[u32]) -> bool {
        other.len() >= self.num_tokens()
            && self.hashed_prefix_matches(other, self.token_base)
            && other[self.token_base..].starts_with(&self.tokens)
    }

    /// Whether `other` is a prefix of the known tokens. Tokens before `token_base` are compared
    /// by block hash, so a prefix that ends inside such a block cannot be confirmed: false.
    fn is_prefix_of_known(&self, other: &[u32]) -> bool {
        let n = other.len();
        if n > self.num_tokens() {
            return false;
        }
        if n < self.token_base {
            return n.is_multiple_of(self.block_size) && self.hashed_prefix_matches(other, n);
        }
        self.hashed_prefix_matches(other, self.token_base)
            && self.tokens.starts_with(&other[self.token_base..])
    }

    /// Whether the first `upto` tokens of `other` (block aligned, at most the hashed blocks)
    /// hash to this slot's blocks. Chained hashes: comparing the last block's hash covers all.
    fn hashed_prefix_matches(&self, other: &[u32], upto: usize) -> bool {
        let blocks = upto / self.block_size;
        if blocks == 0 {
            return true;
        }
        let mut parent = None;
        for block in other[..upto].chunks_exact(self.block_size) {
            parent = Some(chain_block(parent, self.salt, block));
        }
        parent == Some(self.hashes[blocks - 1])
    }

    /// Append tokens and keep them all (matching).
    fn extend_keeping_all(&mut self, new_tokens: &[u32]) {
        self.tokens.extend_from_slice(new_tokens);
        let bs = self.block_size;
        let done = self.hashes.len();
        let known = self.num_tokens();
        if (done + 1) * bs > known {
            return;
        }
        let from = done * bs - self.token_base;
        extend_chain(&mut self.hashes, self.salt, &self.tokens[from..], bs);
    }

    /// Append tokens, hashing the blocks they complete straight from `new_tokens`, and keep only
    /// the partial tail block (a running request).
    fn extend_tokens(&mut self, new_tokens: &[u32]) {
        let bs = self.block_size;
        let hashed = self.hashes.len() * bs;
        if self.token_base < hashed {
            // Tokens kept by matching: from now on only the tail is needed.
            self.tokens.drain(..hashed - self.token_base);
            self.token_base = hashed;
            if self.tokens.capacity() > 4 * bs {
                self.tokens.shrink_to(2 * bs);
            }
        }
        // A decode step rarely completes a block (and appends one token: no copy call).
        if self.tokens.len() + new_tokens.len() < bs {
            match new_tokens {
                [t] => self.tokens.push(*t),
                _ => self.tokens.extend_from_slice(new_tokens),
            }
            return;
        }
        let mut rest = new_tokens;
        if !self.tokens.is_empty() {
            // Complete the kept tail block first.
            let (head, tail) = rest.split_at(bs - self.tokens.len());
            self.tokens.extend_from_slice(head);
            let h = chain_block(self.hashes.last().copied(), self.salt, &self.tokens);
            self.hashes.push(h);
            self.tokens.clear();
            rest = tail;
        }
        if rest.len() >= bs {
            extend_chain(&mut self.hashes, self.salt, rest, bs);
        }
        self.tokens
            .extend_from_slice(&rest[rest.len() - rest.len() % bs..]);
        self.token_base = self.hashes.len() * bs;
    }

    /// Remember what matching found (book-keeping only: nothing is pinned here).
    pub fn record_match(&mut self, m: MatchRecord) {
        self.last_match = Some(m);
    }

    /// How many of `ids` are not yet in the table (`in_table`: whether the table counts; a
    /// restart rebuilds it from nothing). An id listed twice that is not in the table is an error.
    #[inline]
    fn count_fresh(&self, ids: &[DeviceBlockId], in_table: bool) -> Result<usize, ConnectorError> {
        if ids.is_empty() {
            return Ok(0); // most records of a running request
        }
        self.count_fresh_slow(ids, in_table)
    }

    fn count_fresh_slow(
        &self,
        ids: &[DeviceBlockId],
        in_table: bool,
    ) -> Result<usize, ConnectorError> {
        // Duplicates inside one report: a filtered scan for short reports, a set for long ones.
        let mut seen: FastSet<DeviceBlockId> = FastSet::default();
        let long = ids.len() > 16;
        let mut earlier = IdFilter::default();
        let mut fresh = 0;
        for (k, &b) in ids.iter().enumerate() {
            if in_table && self.table.contains(b) {
                continue;
            }
            // An earlier copy of `b` is not in the table either, so it was counted as fresh.
            // Holes (positions without a block) repeat freely.
            let dup = b != HOLE
                && if long {
                    !seen.insert(b)
                } else {
                    let maybe = earlier.may_contain(b);
                    earlier.insert(b);
                    maybe && scan(&ids[..k], b)
                };
            if dup {
                return Err(self.invalid(
                    "new_block_ids",
                    format!("device block {} listed twice in one report", b.0),
                ));
            }
            fresh += 1;
        }
        Ok(fresh)
    }

    /// Append the ids of `ids` that are not yet in the table, in order (validated by
    /// `count_fresh`).
    #[inline]
    fn push_fresh(&mut self, ids: &[DeviceBlockId], fresh: usize) {
        if fresh == 0 {
            return;
        }
        let all = fresh == ids.len();
        self.table.ids.reserve(fresh);
        for &b in ids {
            if all || !self.table.contains(b) {
                self.table.push(b);
            }
        }
    }

    fn reset_device_state(&mut self) {
        self.table.clear();
        self.position = 0;
        self.evaluated = 0;
    }

    /// The engine preempted the request: its device blocks are gone. Matching may run again.
    pub fn preempt(&mut self) -> Result<(), ConnectorError> {
        if self.state == SlotState::Finished {
            return Err(self.invalid("request_id", "preempted after it finished"));
        }
        self.reset_device_state();
        self.last_match = None;
        self.state = SlotState::Preempted;
        Ok(())
    }

    /// The engine allocated device blocks (`update_state_after_alloc`). `block_ids` is the
    /// request's table (ids already known are recognised). `num_external_tokens`: the tokens
    /// kvtier promised; `None` = as the last match found. Returns the blocks to onboard, in
    /// request order, each paired with its device block.
    pub fn allocate(
        &mut self,
        block_ids: &[DeviceBlockId],
        num_external_tokens: Option<usize>,
    ) -> Result<Vec<OnboardBlock>, ConnectorError> {
        if self.state == SlotState::Finished {
            return Err(self.invalid("request_id", "allocation for a finished request"));
        }
        let fresh = self.count_fresh(block_ids, true)?;
        let bs = self.block_size;
        let m = self.last_match;
        let external = match num_external_tokens {
            Some(n) => n,
            None => m.map_or(0, |m| m.external_tokens),
        };
        if external == 0 {
            self.push_fresh(block_ids, fresh);
            if self.state == SlotState::Waiting || self.state == SlotState::Preempted {
                if let Some(m) = m {
                    self.position = self.position.max(m.device_tokens);
                    self.evaluated = self.evaluated.max(m.device_tokens / bs);
                }
                self.state = SlotState::Allocated;
            }
            return Ok(Vec::new());
        }
        if !matches!(self.state, SlotState::Waiting | SlotState::Preempted) {
            return Err(self.invalid(
                "num_external_tokens",
                format!(
                    "{external} external tokens for a request that is already allocated or running"
                ),
            ));
        }
        let Some(m) = m else {
            return Err(self.invalid(
                "num_external_tokens",
                format!("{external} external tokens but the request was never matched"),
            ));
        };
        if external > m.external_tokens || external % bs != 0 {
            return Err(self.invalid(
                "num_external_tokens",
                format!(
                    "{external} is not a whole number of blocks of {bs} within the {} tokens matched",
                    m.external_tokens
                ),
            ));
        }
        let first = m.device_tokens / bs;
        let end = (m.device_tokens + external) / bs;
        let table_len = self.table.len() + fresh;
        if table_len < end {
            return Err(self.invalid(
                "block_ids",
                format!(
                    "{table_len} device blocks cannot hold {} matched tokens",
                    end * bs
                ),
            ));
        }
        if end > self.hashes.len() {
            return Err(self.invalid(
                "num_external_tokens",
                format!(
                    "matched {} blocks but only {} full blocks are known",
                    end,
                    self.hashes.len()
                ),
            ));
        }
        self.push_fresh(block_ids, fresh);
        let out = (first..end)
            .map(|i| OnboardBlock {
                index: i,
                device: self.table.ids[i],
                hash: self.hashes[i],
            })
            .collect();
        self.position = self.position.max(end * bs);
        self.evaluated = self.evaluated.max(end);
        self.state = SlotState::Allocated;
        Ok(out)
    }

    /// Consume one step record; return the full blocks whose store this step must dispatch
    /// (gated on the end of this step's forward pass). Implements Dynamo KVBM's per-request slot algorithm
    /// (`apply_scheduler_output` with `num_scheduled_tokens`; docs/arch/conn.md states it), plus draft-token exclusion and preemption reset.
    pub fn apply(&mut self, rec: &StepRecord) -> Result<Vec<OffloadBlock>, ConnectorError> {
        let mut out = Vec::new();
        self.apply_into(rec, &mut out)?;
        Ok(out)
    }

    /// [`Slot::apply`], appending the blocks to offload to `out` (which the caller may reuse
    /// across records). On error `out` and the slot are left as they were.
    pub fn apply_into(
        &mut self,
        rec: &StepRecord,
        out: &mut Vec<OffloadBlock>,
    ) -> Result<(), ConnectorError> {
        if self.is_plain_continuation(rec) {
            self.apply_continuation(rec, out);
            return Ok(());
        }
        self.apply_general(rec, out)
    }

    /// `apply_into` for any record: validates everything before changing anything.
    fn apply_general(
        &mut self,
        rec: &StepRecord,
        out: &mut Vec<OffloadBlock>,
    ) -> Result<(), ConnectorError> {
        if self.state == SlotState::Finished {
            return Err(self.invalid("request_id", "scheduled after it finished"));
        }
        if rec.num_draft_tokens > rec.num_scheduled_tokens {
            return Err(self.invalid(
                "num_draft_tokens",
                format!(
                    "{} draft tokens exceed the {} scheduled tokens",
                    rec.num_draft_tokens, rec.num_scheduled_tokens
                ),
            ));
        }
        let running = matches!(self.state, SlotState::Prefilling | SlotState::Decoding);
        if rec.is_new && running && !rec.resumed_from_preemption {
            return Err(self.invalid("is_new", "request is already running"));
        }
        // Everything below is computed on copies and validated before the slot changes.
        let restart = rec.resumed_from_preemption && running;
        let (table_len_before, base_position, base_evaluated) = if restart {
            (0, 0, 0)
        } else {
            (self.table.len(), self.position, self.evaluated)
        };
        let fresh = self.count_fresh(&rec.new_block_ids, !restart)?;
        // Tokens: a new request reports its full list (which may repeat what matching saw);
        // every other record reports the tokens appended since the last one.
        let known = self.num_tokens();
        let full_list =
            (rec.is_new || rec.resumed_from_preemption) && self.known_is_prefix_of(&rec.new_tokens);
        let appended: &[u32] = if full_list {
            &rec.new_tokens[known..]
        } else if rec.is_new && known > 0 && self.is_prefix_of_known(&rec.new_tokens) {
            &[]
        } else if rec.is_new && known > 0 {
            return Err(self.invalid(
                "new_tokens",
                "a new request's tokens disagree with the tokens seen at matching",
            ));
        } else {
            &rec.new_tokens
        };
        let total_tokens = known + appended.len();
        let bs = self.block_size;
        let table_len = table_len_before + fresh;
        let computed = rec.num_computed_tokens;
        // The first record after allocation may report fewer computed tokens than kvtier
        // onboarded (TensorRT-LLM subtracts connector-matched tokens): keep the larger. Later, a
        // smaller count means the engine rolled back (e.g. recomputing after a failed load):
        // believe it. A first record that only fits the table with the engine's count is a
        // rollback too.
        let first_record = !running || restart;
        let rollback = computed < base_position
            && (!first_record || base_position + rec.num_scheduled_tokens > table_len * bs);
        let (position, evaluated, watermark) = if rollback {
            let b = computed / bs;
            (
                computed,
                base_evaluated.min(b),
                self.offloaded_watermark.min(b),
            )
        } else {
            let p = base_position.max(computed);
            // Only a first record can start past blocks the engine took from its own prefix
            // cache; later jumps (accepted draft tokens) still owe their blocks an offload.
            let e = if first_record {
                base_evaluated.max(p / bs)
            } else {
                base_evaluated
            };
            (p, e, self.offloaded_watermark)
        };
        // Engine-supplied counts: an absurd one saturates and fails the table check below.
        let next = position.saturating_add(rec.num_scheduled_tokens);
        if next > table_len * bs {
            return Err(self.invalid(
                "num_scheduled_tokens",
                format!(
                    "computing up to token {next} needs {} blocks but only {table_len} are allocated",
                    next.div_ceil(bs)
                ),
            ));
        }
        // Commit.
        if restart {
            tracing::debug!(request = %self.id, "slot restarted after preemption");
            self.reset_device_state();
        }
        if first_record {
            // Room for the known tokens' blocks and some generation, so that a typical request
            // grows its hash list and block table once, here.
            let blocks = total_tokens / bs + total_tokens / (8 * bs) + 4;
            self.hashes
                .reserve(blocks.saturating_sub(self.hashes.len()));
            self.table
                .ids
                .reserve(blocks.saturating_sub(self.table.ids.len()));
            self.tokens.reserve(bs);
        }
        self.extend_tokens(appended);
        self.push_fresh(&rec.new_block_ids, fresh);
        self.state = if !appended.is_empty() && !rec.is_new && !full_list {
            SlotState::Decoding
        } else {
            SlotState::Prefilling
        };
        let confirmed = (next - rec.num_draft_tokens).min(total_tokens);
        debug_assert_eq!(self.num_tokens(), total_tokens);
        let end = confirmed / bs;
        if rollback {
            tracing::debug!(request = %self.id, from = base_position, to = computed, "engine rolled back");
            self.offloaded_watermark = watermark;
        }
        self.hand_out(evaluated, end, out);
        self.position = position + rec.num_scheduled_tokens - rec.num_draft_tokens;
        Ok(())
    }

    /// Whether `rec` is the common record of a running request: no new blocks, no draft tokens,
    /// no restart, no rollback, and it fits the table. [`Slot::apply_into`] then reduces to
    /// [`Slot::apply_continuation`] (the same result, without the general path's checks).
    #[inline]
    fn is_plain_continuation(&self, rec: &StepRecord) -> bool {
        matches!(self.state, SlotState::Prefilling | SlotState::Decoding)
            && !rec.is_new
            && !rec.resumed_from_preemption
            && rec.new_block_ids.is_empty()
            && rec.num_draft_tokens == 0
            && rec.num_computed_tokens >= self.position
            && rec
                .num_computed_tokens
                .checked_add(rec.num_scheduled_tokens)
                .is_some_and(|next| next <= self.table.len() * self.block_size)
    }

    /// `apply_into` for a record that passed `is_plain_continuation`.
    #[inline]
    fn apply_continuation(&mut self, rec: &StepRecord, out: &mut Vec<OffloadBlock>) {
        let next = rec.num_computed_tokens + rec.num_scheduled_tokens;
        self.extend_tokens(&rec.new_tokens);
        self.state = if rec.new_tokens.is_empty() {
            SlotState::Prefilling
        } else {
            SlotState::Decoding
        };
        let end = next.min(self.num_tokens()) / self.block_size;
        self.hand_out(self.evaluated, end, out);
        self.position = next;
    }

    /// Hand out blocks `max(evaluated, watermark) .. end` for offload; they count as evaluated
    /// and handed out from then on.
    #[inline]
    fn hand_out(&mut self, evaluated: usize, end: usize, out: &mut Vec<OffloadBlock>) {
        let start = evaluated.max(self.offloaded_watermark);
        if start < end && !self.private {
            out.extend((start..end).map(|i| OffloadBlock {
                index: i,
                device: self.table.ids[i],
                hash: self.hashes[i],
            }));
        }
        self.evaluated = evaluated.max(end);
        self.offloaded_watermark = self.offloaded_watermark.max(end);
    }

    /// A load into block `index` (and maybe later ones) failed: the engine recomputes from
    /// there, so the slot's position and evaluated blocks go back to that block.
    pub fn load_failed(&mut self, index: usize) {
        let bs = self.block_size;
        self.position = self.position.min(index * bs);
        self.evaluated = self.evaluated.min(index);
        self.offloaded_watermark = self.offloaded_watermark.min(index);
    }

    /// The block index of a device block in this request's table.
    pub fn index_of(&self, device: DeviceBlockId) -> Option<usize> {
        self.table.ids.iter().position(|&b| b == device)
    }

    /// The engine finished the request.
    pub fn finish(&mut self) {
        self.state = SlotState::Finished;
    }
}

mod table;
#[cfg(test)]
mod tests;
