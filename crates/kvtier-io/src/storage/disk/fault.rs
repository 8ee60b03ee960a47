//! Fault injection for the disk tier: make chosen reads or writes fail with an errno, come back
//! short, or come back with a flipped byte, so tests drive the real code paths under faults.
//!
//! Invariant: a fault applies to the slots it names, for as many operations as its `times`
//! allows; everything else runs normally. The injector is shared and lock-protected (`faults`).
use std::sync::Mutex;

/// Which operation a fault hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultOp {
    /// Reads of a slot (header page and payload).
    Read,
    /// Writes of a slot.
    Write,
}

/// What goes wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The system call fails with this errno (e.g. `libc::ENOSPC`, `libc::EIO`).
    Errno(i32),
    /// The operation moves only this many bytes.
    Short(usize),
    /// A read returns data with the byte at this payload offset flipped (silent corruption).
    FlipByte(usize),
}

#[derive(Clone, Debug)]
struct Rule {
    op: FaultOp,
    slots: std::ops::Range<u32>,
    fault: Fault,
    times: Option<u32>,
}

/// A set of fault rules consulted by a [`crate::DiskStorage`] before and after each operation.
#[derive(Debug, Default)]
pub struct FaultInjector {
    faults: Mutex<Vec<Rule>>,
}

impl FaultInjector {
    /// An injector with no faults armed.
    pub fn new() -> Self {
        Self::default()
    }

    /// Apply `fault` to `op` on every slot in `slots`, `times` times in all (`None` = always).
    pub fn add(&self, op: FaultOp, slots: std::ops::Range<u32>, fault: Fault, times: Option<u32>) {
        if let Ok(mut f) = self.faults.lock() {
            f.push(Rule {
                op,
                slots,
                fault,
                times,
            });
        }
    }

    /// Remove every rule.
    pub fn clear(&self) {
        if let Ok(mut f) = self.faults.lock() {
            f.clear();
        }
    }

    /// The fault to apply to `op` on `slot`, if any (consumes one use of the rule).
    pub(crate) fn take(&self, op: FaultOp, slot: u32) -> Option<Fault> {
        let mut f = self.faults.lock().ok()?;
        let i = f
            .iter()
            .position(|r| r.op == op && r.slots.contains(&slot) && r.times != Some(0))?;
        let rule = &mut f[i];
        if let Some(t) = rule.times.as_mut() {
            *t -= 1;
        }
        Some(rule.fault)
    }
}
