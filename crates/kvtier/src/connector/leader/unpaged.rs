//! Positions without a page in a full-attention leader's input (TensorRT-LLM: `-1`,
//! `BAD_PAGE_INDEX`, passed as [`HOLE`]). KVCacheManagerV2 reports only a request's first chunk
//! of pages at allocation and pads the list with `-1` (the rest arrives later as new block ids),
//! and a sliding window the engine applies without kvtier knowing it (one the settings did not
//! declare) names a block it passed by `-1`. A leader serving a window group takes `-1` as a hole
//! (`window.rs`, its null block is [`HOLE`]); any other leader cannot cache such a request: its
//! table would name blocks the engine does not hold.
//!
//! Invariants (with the rule on, [`Leader::set_unpaged_exclusion`]):
//! - an allocation's trailing holes are dropped (pages not allocated yet), for every leader;
//! - a leader whose null block is not [`HOLE`] excludes a request whose allocation has a hole
//!   before a valid page (its table is cut before the hole) or whose step record carries a hole
//!   in `new_block_ids`; an excluded request's records are dropped from every later step until
//!   it finishes (so nothing of it is stored or loaded from them), and the exclusion is logged,
//!   rate-limited;
//! - a leader serving a window group passes holes through unchanged.
//!
//! With the rule off a hole where the leader takes none is refused as invalid input (no engine
//! but TensorRT-LLM sends one), naming the request and the field.
use crate::connector::fasthash::FastSet;
use crate::connector::leader::Leader;
use crate::connector::slot::HOLE;
use crate::connector::step::StepRecord;
use crate::connector::ConnectorError;
use crate::ids::{DeviceBlockId, RequestId};

/// The rule's state: whether it is on, and the requests it excluded.
#[derive(Debug, Default)]
pub(super) struct Unpaged {
    on: bool,
    excluded: FastSet<RequestId>,
}

impl Leader {
    /// Turn the rule for page ids without a page on (TensorRT-LLM; see the module documentation).
    pub fn set_unpaged_exclusion(&mut self, on: bool) {
        self.unpaged.on = on;
    }

    /// Whether `req` stopped being cached because its page ids had a hole.
    pub fn is_excluded(&self, req: &RequestId) -> bool {
        self.unpaged.excluded.contains(req)
    }

    fn takes_holes(&self) -> bool {
        self.null_block == Some(HOLE)
    }

    fn exclude(&mut self, req: &RequestId, why: &'static str) {
        if self.unpaged.excluded.insert(req.clone()) {
            crate::warn_limited!(request = %req, why, "request stops being cached by kvtier");
        }
    }

    /// An allocation's page ids as the leader takes them (see the module invariants): trailing
    /// holes dropped; a hole before a valid page excludes the request and cuts the table there.
    pub fn screen_allocation(
        &mut self,
        req: &RequestId,
        ids: &[DeviceBlockId],
    ) -> Result<Vec<DeviceBlockId>, ConnectorError> {
        if !ids.contains(&HOLE) {
            return Ok(ids.to_vec());
        }
        if !self.unpaged.on && !self.takes_holes() {
            return Err(ConnectorError::invalid(
                req,
                "block_ids",
                "-1 (no page) where this engine names every page",
            ));
        }
        let end = ids.iter().rposition(|b| *b != HOLE).map_or(0, |i| i + 1);
        let mut out = ids[..end].to_vec();
        if !self.takes_holes() {
            if let Some(i) = out.iter().position(|b| *b == HOLE) {
                out.truncate(i);
                self.exclude(
                    req,
                    "a -1 page id before valid pages (a sliding window passed a block)",
                );
            }
        }
        Ok(out)
    }

    /// Whether a step record goes to `build_step`: false for a request the rule excluded (now, for
    /// a hole in `new_block_ids`, or earlier).
    pub fn screen_record(&mut self, r: &StepRecord) -> Result<bool, ConnectorError> {
        if r.new_block_ids.contains(&HOLE) && !self.takes_holes() {
            if !self.unpaged.on {
                return Err(ConnectorError::invalid(
                    &r.request_id,
                    "new_block_ids",
                    "-1 (no page) where this engine names every page",
                ));
            }
            self.exclude(&r.request_id, "a -1 page id in new_block_ids");
        }
        // No hashing of the id while nothing is excluded (every vLLM step).
        Ok(self.unpaged.excluded.is_empty() || !self.unpaged.excluded.contains(&r.request_id))
    }

    /// The request finished: forget its exclusion (the engine may reuse its id).
    pub fn forget_exclusion(&mut self, req: &RequestId) {
        self.unpaged.excluded.remove(req);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::connector::leader::LeaderConfig;
    use crate::hash::HashSalt;

    fn leader(window_group: bool, on: bool) -> Leader {
        let mut l = Leader::new(LeaderConfig::new(4, HashSalt(9), 64)).unwrap();
        if window_group {
            l.set_window(Some(8), Some(HOLE));
        }
        l.set_unpaged_exclusion(on);
        l
    }

    fn ids(v: &[u32]) -> Vec<DeviceBlockId> {
        v.iter().map(|b| DeviceBlockId(*b)).collect()
    }

    fn record(id: &str, blocks: &[u32]) -> StepRecord {
        StepRecord {
            request_id: id.into(),
            new_block_ids: ids(blocks),
            ..Default::default()
        }
    }

    const H: u32 = HOLE.0;

    #[test]
    fn trailing_holes_are_pages_not_allocated_yet() {
        let mut l = leader(false, true);
        let r: RequestId = "r".into();
        assert_eq!(
            l.screen_allocation(&r, &ids(&[3, 4, H, H])).unwrap(),
            ids(&[3, 4])
        );
        assert!(!l.is_excluded(&r));
        assert!(l.screen_record(&record("r", &[5])).unwrap());
    }

    #[test]
    fn a_hole_before_a_valid_page_excludes_the_request_until_it_finishes() {
        let mut l = leader(false, true);
        let r: RequestId = "r".into();
        assert_eq!(
            l.screen_allocation(&r, &ids(&[3, H, 4, H])).unwrap(),
            ids(&[3])
        );
        assert!(l.is_excluded(&r));
        assert!(
            !l.screen_record(&record("r", &[5])).unwrap(),
            "cached anyway"
        );
        assert!(l.screen_record(&record("other", &[6])).unwrap());
        l.forget_exclusion(&r);
        assert!(l.screen_record(&record("r", &[5])).unwrap());
    }

    #[test]
    fn a_hole_in_a_record_excludes_that_record_and_every_later_one() {
        let mut l = leader(false, true);
        assert!(!l.screen_record(&record("r", &[5, H])).unwrap());
        assert!(!l.screen_record(&record("r", &[6])).unwrap());
        assert!(l.is_excluded(&"r".into()));
    }

    #[test]
    fn a_window_group_keeps_its_holes() {
        let mut l = leader(true, true);
        let r: RequestId = "r".into();
        assert_eq!(
            l.screen_allocation(&r, &ids(&[H, 4, H])).unwrap(),
            ids(&[H, 4])
        );
        assert!(l.screen_record(&record("r", &[H, 5])).unwrap());
        assert!(!l.is_excluded(&r));
    }

    #[test]
    fn with_the_rule_off_a_hole_is_invalid_input() {
        let mut l = leader(false, false);
        let r: RequestId = "r".into();
        assert!(matches!(
            l.screen_allocation(&r, &ids(&[3, H])),
            Err(ConnectorError::InvalidInput {
                field: "block_ids",
                ..
            })
        ));
        assert!(matches!(
            l.screen_record(&record("r", &[H])),
            Err(ConnectorError::InvalidInput {
                field: "new_block_ids",
                ..
            })
        ));
        assert_eq!(
            l.screen_allocation(&r, &ids(&[3, 4])).unwrap(),
            ids(&[3, 4])
        );
    }
}
