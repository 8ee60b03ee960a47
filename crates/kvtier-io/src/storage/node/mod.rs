//! The node tier: one host cache shared by every engine process on a machine. `kvtier node`
//! runs a [`NodeServer`] that owns a shared-memory arena and its books; engine processes (vLLM,
//! TensorRT-LLM, the reference engine, any TP rank) attach with `remote.url = "node:///path.sock"`
//! and read and write blocks through the arena ([`NodeStore`], a `RemoteStore`).
//!
//! Invariants (see each module): a block is visible only after its writer committed it; a
//! crashed engine leaves neither a half-written block nor a lease behind; blocks are keyed by
//! namespace (model identity) and sequence hash; on a node other uids may attach to, each block
//! is verified against a checksum bound to the key when committed and before a read counts (a
//! private node's clients, all of its uid, skip the hashing: see docs/arch/node.md, Trust); only local users allowed by the socket's credentials attach, each in
//! namespaces of its own uid, and a client attaches only to a node of its own (or an allowed)
//! uid; a full node degrades to skipped stores and misses.
mod alloc;
mod batch;
mod books;
mod client;
pub(crate) mod direct;
mod disk;
#[cfg(test)]
pub(crate) mod gpu_tests;
mod granted;
mod hash;
mod listen;
mod pipeline;
mod protocol;
mod server;
mod share;
mod staged;
mod tenants;

pub use books::{
    AttachRefused, BlockCopy, Books, ClientId, Named, NodeStats, PutRefused, SlotGrant,
    GRANT_SHARE, MAX_GRANTS, MAX_NAMESPACES,
};
pub use client::{NodeClientOptions, NodeStore};
pub use listen::default_socket;
pub use protocol::{
    block_checksum, GetAnswer, ItemAnswer, LeaseEnd, PutAnswer, PutEnd, Reply, Request, MAX_BATCH,
    MAX_FRAME, MAX_HELLO_FRAME, NODE_POLL, NODE_PROTOCOL_VERSION,
};
#[cfg(any(test, feature = "testing"))]
pub use protocol::{decode_request_stream, encode_request};
pub use server::{
    HugePages, NodeOptions, NodeServer, HELLO_TIMEOUT, MAX_CONNECTIONS, MAX_NAMESPACE_LEN,
};
pub use share::{SharePolicy, SharePolicyError};
