//! Offers the engine cuts: TensorRT-LLM's KVCacheManagerV2 may match a request and allocate it
//! iterations later, and meanwhile tell the connector (`cancel_load`) that it will not consume
//! tokens `[start, end)` of the offer. The allocation then loads what is left of it.
//!
//! Invariants: a cut applies to the one allocation that follows it (a new match or a preemption
//! forgets it); a head cut (starting at or before the offer) is matched again from its end, so
//! the engine's own cache and kvtier's load never overlap; a tail cut keeps the offer up to the
//! cut's start; without a cut the allocation loads what the last match offered.
use crate::connector::leader::Leader;
use crate::connector::ConnectorError;
use crate::ids::{DeviceBlockId, RequestId};

impl Leader {
    /// The engine will not consume tokens `[start, end)` of the request's last offer (see the
    /// module documentation); an unknown request is left alone. A cut that ends before it starts
    /// is refused ([`ConnectorError::InvalidInput`] naming both values), nothing changed.
    pub fn cancel_load(
        &mut self,
        req: &RequestId,
        start: usize,
        end: usize,
    ) -> Result<(), ConnectorError> {
        if start > end {
            return Err(ConnectorError::InvalidInput {
                request: req.to_string(),
                field: "cancel_load",
                reason: format!("start {start} is past end {end}"),
            });
        }
        if let Some(e) = self.slots.get_mut(req) {
            e.cut = Some((start, end));
        }
        Ok(())
    }

    /// The engine allocated `block_ids` without naming the external tokens it accepted
    /// (TensorRT-LLM): the last match's offer, less the engine's cut ([`Leader::cancel_load`]).
    /// Returns the first token of the request's asynchronous load (the tokens before it are the
    /// engine's), or `None` when no asynchronous load was offered.
    pub fn allocate_offer(
        &mut self,
        req: &RequestId,
        block_ids: &[DeviceBlockId],
    ) -> Result<Option<usize>, ConnectorError> {
        let (offered, cut, key) = match self.slots.get_mut(req) {
            Some(e) => (e.offer, e.cut.take(), e.key.clone()),
            None => (None, None, None),
        };
        let mut start = offered;
        let external = match (cut, offered) {
            (None, _) => None,
            (Some((cut_start, cut_end)), Some(s)) if cut_start <= s => {
                // Head cut: the engine's own cache covers up to `cut_end`; load the rest.
                let tokens = self
                    .slots
                    .get(req)
                    .map(|e| e.slot.known_tokens().to_vec())
                    .unwrap_or_default();
                let key = key.unwrap_or_default();
                let n = self.get_num_new_matched_tokens_for(req, &tokens, cut_end, &key)?;
                start = Some(cut_end);
                Some(n)
            }
            (Some((cut_start, _)), s) => Some(cut_start.saturating_sub(s.unwrap_or(0))),
        };
        self.update_state_after_alloc(req, block_ids, external)?;
        // The offer is allocated: a later allocation of the request parks no load.
        if let Some(e) = self.slots.get_mut(req) {
            e.offer = None;
        }
        Ok(start)
    }
}
