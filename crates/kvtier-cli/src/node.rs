//! `kvtier node`: the per-node host tier shared by every engine process on this machine.
//!
//! Invariant: the command prints exactly one `serving SOCKET` line on stdout once engines can
//! attach (tests and scripts wait for it); SIGINT/SIGTERM stop it within a bounded time, removing
//! its socket and its shared-memory arena; a second signal exits at once.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use kvtier_io::storage::node::{default_socket, HugePages, NodeOptions, NodeServer, SharePolicy};

/// `kvtier node` flags.
#[derive(Debug, Clone, Args)]
pub struct NodeArgs {
    /// The Unix socket engines attach to (`remote.url = "node://SOCKET"`). Created mode 0600
    /// (0666 with --allow-uid) in a directory of this user that no one else may write (created
    /// 0700, 0711 with --allow-uid; refused otherwise). Default: $XDG_RUNTIME_DIR/kvtier-node/
    /// node.sock, else /tmp/kvtier-node-UID/node.sock.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Shared host memory for blocks, in GB (decimal).
    #[arg(long, default_value_t = 4.0)]
    pub capacity_gb: f64,
    /// Directory (tmpfs) of the shared-memory arena.
    #[arg(long, default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// Other user ids allowed to attach (the node's own user always may); their engines add
    /// `node_uid=<this node's uid>` to their node:// URL. Each uid gets namespaces and an arena
    /// of its own (the capacity is split evenly between the node's uid and these).
    #[arg(long = "allow-uid", value_name = "UID")]
    pub allow_uids: Vec<u32>,
    /// Close a connection idle this long (seconds).
    #[arg(long, default_value_t = 3600)]
    pub idle_timeout_s: u64,
    /// How the arena is shared among models: `equal`, or `weighted:NAME=W,...` (NAME is a
    /// namespace or its model part; unlisted models weigh 1). See docs/arch/node.md.
    #[arg(long, default_value = "equal")]
    pub share: String,
    /// The node's own disk tier behind the arena: blocks evicted from the arena are kept here
    /// and served from it; kept across node restarts (warm restart). Off without it.
    #[arg(long)]
    pub disk_dir: Option<PathBuf>,
    /// Size of the node's disk tier, in GB (decimal).
    #[arg(long, default_value_t = 0.0)]
    pub disk_gb: f64,
    /// How the arena gets 2 MiB pages: `advise` (a hint: enough where the kernel's
    /// shmem_enabled is not `never`, or --shm-dir is a tmpfs mounted huge=always) or `collapse`
    /// (MADV_COLLAPSE the whole arena at start: huge pages everywhere, seconds per GiB at start on
    /// some machines). See docs/arch/node.md.
    #[arg(long, default_value = "advise", value_parser = huge_pages_arg)]
    pub huge_pages: HugePages,
    /// How long each connection polls for its engine's next request after an answer, in
    /// microseconds, before it sleeps (0: never polls). A request inside it costs no wake-up;
    /// each connection keeps a CPU busy while it polls. See docs/arch/node.md.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(0..=100_000))]
    pub poll_us: u64,
}

/// `--huge-pages`: `advise` or `collapse` (anything else is a usage error).
fn huge_pages_arg(s: &str) -> Result<HugePages, String> {
    HugePages::parse(s).ok_or_else(|| "expected `advise` or `collapse`".to_string())
}

/// Run the node until a signal.
pub async fn run(args: NodeArgs) -> anyhow::Result<()> {
    if !(args.capacity_gb.is_finite() && args.capacity_gb > 0.0) {
        bail!(
            "--capacity-gb must be a positive number of GB, got {}",
            args.capacity_gb
        );
    }
    let capacity = (args.capacity_gb * 1e9) as u64;
    let socket = args.socket.clone().unwrap_or_else(default_socket);
    let mut opts = NodeOptions::new(socket.clone(), capacity);
    opts.shm_dir = args.shm_dir.clone();
    opts.allowed_uids = args.allow_uids.clone();
    opts.idle_timeout = Duration::from_secs(args.idle_timeout_s.max(1));
    if args.disk_dir.is_some() && !(args.disk_gb.is_finite() && args.disk_gb > 0.0) {
        bail!("--disk-dir needs --disk-gb > 0, got {}", args.disk_gb);
    }
    opts.disk_dir = args.disk_dir.clone();
    opts.disk_bytes = (args.disk_gb * 1e9) as u64;
    opts.share = SharePolicy::parse(&args.share).map_err(|e| anyhow::anyhow!("--share {e}"))?;
    opts.huge_pages = args.huge_pages;
    opts.poll = std::time::Duration::from_micros(args.poll_us);
    let mut node = NodeServer::start(&opts)
        .with_context(|| format!("starting the kvtier node on {}", socket.display()))?;
    println!("serving {}", socket.display());
    std::io::stdout().flush().ok();
    let signals = Arc::new(AtomicUsize::new(0));
    wait_for_signal(&signals).await?;
    let stats = node.stats();
    node.shutdown(Duration::from_secs(5));
    eprintln!("kvtier node: stopped ({stats:?})");
    Ok(())
}

/// Waits for SIGINT or SIGTERM; a second one exits the process at once.
async fn wait_for_signal(count: &Arc<AtomicUsize>) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    count.fetch_add(1, Ordering::SeqCst);
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        eprintln!("kvtier node: second signal, exiting now");
        std::process::exit(130);
    });
    Ok(())
}
