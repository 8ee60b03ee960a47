//! The channel's frames: every frame is `postcard(WIRE_VERSION: u32) ++ postcard(Wire)`, and a
//! frame of another version is refused with both versions named, never decoded as ours.

use serde::{Deserialize, Serialize};
use zeromq::ZmqMessage;

use crate::connector::messages::{ClusterLayout, RankLayout, StepMetadata, WorkerReport};
use crate::connector::zmq_auth::{self, ChannelSecret};
use crate::connector::ConnectorError;

/// Version of the channel's frames (2: authenticated hello and welcome; 3: the hello answers the
/// leader's challenge).
pub const WIRE_VERSION: u32 = 3;

/// Everything that crosses the wire.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Wire {
    /// A worker asks the leader for a challenge (the first frame of a handshake).
    Hi,
    /// The leader's fresh challenge to the peer that said `Hi`, good for one hello.
    Challenge([u8; 16]),
    /// A worker introduces its rank, authenticated.
    Hello {
        /// The rank's layout.
        layout: RankLayout,
        /// Fresh per hello; binds the leader's welcome to this hello.
        nonce: [u8; 16],
        /// The secret's tag over the leader's challenge, nonce and layout.
        tag: [u8; 32],
    },
    /// The leader accepts: the agreed layout.
    Welcome {
        /// The layout every rank agreed on.
        layout: ClusterLayout,
        /// The secret's tag over the rank's nonce and the layout.
        tag: [u8; 32],
    },
    /// The handshake failed: the reason.
    Reject(String),
    /// A worker's job report.
    Report(WorkerReport),
    /// The leader's step metadata.
    Step(StepMetadata),
    /// The leader is going away.
    Shutdown,
}

/// Encode one frame.
pub fn encode(msg: &Wire) -> Result<Vec<u8>, ConnectorError> {
    encode_with_version(WIRE_VERSION, msg)
}

pub(super) fn layout_bytes<T: Serialize>(l: &T) -> Result<Vec<u8>, ConnectorError> {
    postcard::to_stdvec(l).map_err(|e| ConnectorError::Codec(e.to_string()))
}

/// A hello for `layout` answering the leader's `challenge`, authenticated with `secret` under a
/// fresh nonce.
pub fn hello(
    secret: &ChannelSecret,
    challenge: &[u8; 16],
    layout: RankLayout,
) -> Result<Wire, ConnectorError> {
    let nonce = zmq_auth::random_bytes::<16>()?;
    let tag = secret.hello_tag(challenge, &nonce, &layout_bytes(&layout)?);
    Ok(Wire::Hello { layout, nonce, tag })
}

/// Encode with an explicit version (tests of the version check).
pub fn encode_with_version(version: u32, msg: &Wire) -> Result<Vec<u8>, ConnectorError> {
    let mut out =
        postcard::to_stdvec(&version).map_err(|e| ConnectorError::Codec(e.to_string()))?;
    out.extend(postcard::to_stdvec(msg).map_err(|e| ConnectorError::Codec(e.to_string()))?);
    Ok(out)
}

/// Decode one frame, checking the version first.
pub fn decode(bytes: &[u8]) -> Result<Wire, ConnectorError> {
    let (version, rest): (u32, &[u8]) = postcard::take_from_bytes(bytes)
        .map_err(|e| ConnectorError::Codec(format!("frame header: {e}")))?;
    if version != WIRE_VERSION {
        return Err(ConnectorError::Handshake(format!(
            "peer speaks protocol version {version}, this build speaks {WIRE_VERSION}"
        )));
    }
    postcard::from_bytes(rest).map_err(|e| ConnectorError::Codec(format!("frame body: {e}")))
}

pub(super) fn frame_payload(msg: ZmqMessage) -> Option<(Option<Vec<u8>>, Vec<u8>)> {
    let mut frames = msg.into_vec();
    let payload = frames.pop()?.to_vec();
    let identity = frames.first().map(|b| b.to_vec());
    Some((identity, payload))
}
