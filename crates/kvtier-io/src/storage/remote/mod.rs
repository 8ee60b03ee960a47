//! The shared remote store (tier G4): blocks keyed by 128-bit sequence hashes, on a Redis-protocol
//! server (Redis, Valkey) or a shared directory, implementing [`kvtier::transfer::RemoteStore`].
//! It hands KV from a prefill worker to a decode worker in another process or machine, and serves
//! as a fleet-wide prefix cache.
//!
//! Invariant: a value is `frame` header (magic, version, length, key, a tag over the header fields
//! and the payload, seeded by the namespace) plus the payload, and `get` fills the caller's buffer
//! only with bytes whose header and tag verified for the key and namespace asked for; anything else is a typed [`kvtier::transfer::RemoteError`]. Every network operation is
//! bounded by timeouts, so an outage produces errors (the connector then recomputes), never a hang.
mod breaker;
mod cluster;
mod dir_store;
mod frame;
mod key;
mod open;
mod redis_store;
mod wire;

pub use breaker::{BreakerState, BreakerStats};
pub use dir_store::{DirOptions, DirStore};
pub use frame::{decode_value, encode_value, FrameSeal, HEADER_LEN, MIN_MAC_KEY_LEN};
pub use key::Namespace;
pub use open::{from_url, open, redact_url};
pub use redis_store::{RedisOptions, RedisStore};
