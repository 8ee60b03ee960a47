//! `redis+unix://` (and `valkey+unix://`, `unix://`) against a real `redis-server` listening on a
//! Unix socket: accepted by the configuration check and working in the store (#13: the check
//! refused it while the store supported it).
#![allow(clippy::unwrap_used)]
mod remote_support;

use anyhow::Result;
use kvtier::config::KvtierConfig;
use kvtier::hash::SequenceHash;
use kvtier_io::storage::remote::open;
use remote_support::{block, RedisServer};

#[test]
fn unix_socket_urls_pass_the_check_and_round_trip() -> Result<()> {
    let sock_dir = tempfile::tempdir()?;
    let sock = sock_dir.path().join("redis.sock");
    let sock_s = sock.display().to_string();
    let Some(_srv) = RedisServer::start_with(&["--unixsocket", &sock_s, "--unixsocketperm", "700"])
    else {
        return Ok(());
    };
    for (i, scheme) in ["redis+unix", "valkey+unix", "unix"].iter().enumerate() {
        let url = format!("{scheme}://{sock_s}?db=1&io_timeout_ms=2000");
        let env = [
            ("KVTIER_HOST_NUM_BLOCKS".to_string(), "4".to_string()),
            ("KVTIER_REMOTE_URL".to_string(), url.clone()),
        ]
        .into();
        let cfg = KvtierConfig::build(None, &env, None)?;
        let store = open(cfg.remote.as_ref().unwrap(), "unix-test")?;
        let key = 0x5eed_0000 + i as u128;
        let data = block(i as u64, 4096);
        store.put(SequenceHash(key), &data)?;
        let mut out = vec![0u8; 4096];
        store.get(SequenceHash(key), &mut out)?;
        assert_eq!(out, data, "{url}");
        assert_eq!(
            store.contains(&[SequenceHash(key), SequenceHash(key + 100)])?,
            vec![true, false],
            "{url}"
        );
    }
    Ok(())
}
