//! Which endpoints the channel accepts (`tcp://` and `ipc://`, checked before the ZeroMQ crate,
//! which panics on transports it was not built with) and the `ipc://` socket file's lifecycle:
//! a stale file is reclaimed before binding and a fresh one is mode 0600.

use crate::connector::ConnectorError;

/// The endpoints this build can bind and connect: `tcp://…` or `ipc://<non-empty path>`.
pub fn check_endpoint(endpoint: &str) -> Result<(), ConnectorError> {
    let bad = |why: &str| {
        ConnectorError::Channel(format!(
            "ZeroMQ endpoint {endpoint:?} {why} (expected tcp://host:port or ipc:///path)"
        ))
    };
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        if path.is_empty() {
            return Err(bad("has no socket path"));
        }
    } else if !endpoint.starts_with("tcp://") {
        return Err(bad("uses an unsupported transport"));
    }
    endpoint
        .parse::<zeromq::Endpoint>()
        .map_err(|e| bad(&format!("does not parse: {e}")))?;
    Ok(())
}

/// Before binding `ipc://path`: removes a socket file nobody listens on (left by a leader that
/// died); a live one is left alone (the bind then fails with "address in use").
pub(super) fn reclaim_stale_ipc(endpoint: &str) {
    use std::os::unix::fs::FileTypeExt;
    let Some(path) = endpoint.strip_prefix("ipc://") else {
        return;
    };
    let is_socket = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket());
    if is_socket {
        if let Err(e) = std::os::unix::net::UnixStream::connect(path) {
            if e.kind() == std::io::ErrorKind::ConnectionRefused {
                tracing::info!(path, "removing a stale leader socket");
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

/// After binding `ipc://path`: only this user may connect.
pub(super) fn restrict_ipc(endpoint: &str) -> Result<(), ConnectorError> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(|e| {
            ConnectorError::Channel(format!("chmod 0600 of the leader socket {path}: {e}"))
        })?;
    }
    Ok(())
}
