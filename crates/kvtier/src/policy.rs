//! Offload policy. (Owned by the core helper; placeholder until it lands.)
