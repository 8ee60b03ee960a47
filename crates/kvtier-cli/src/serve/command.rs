//! `kvtier serve`: start the reference engine and serve the OpenAI API until Ctrl-C / SIGTERM.
//!
//! Invariant: the server prints exactly one `listening on http://ADDR` line on stdout once the socket
//! is bound (tests and scripts wait for it), and the engine is shut down after the server stops. The
//! server stops within its shutdown grace period (`listener::ServeOptions`, 10 s) of the first signal;
//! a second signal exits at once.

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;

use crate::backend::Backend;
use crate::engine_backend::EngineBackend;
use crate::serve::disagg::PrefillClient;
use crate::serve::http_client::HttpUrl;
use crate::serve::server::{serve, AppState, Generator};
use crate::settings::{DisaggMode, EngineArgs};

/// `kvtier serve` flags.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to bind (0 = any free port; the chosen one is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Aggregated, or one half of a disaggregated pair.
    #[arg(long, value_enum, default_value_t = DisaggMode::Agg)]
    pub disaggregation_mode: DisaggMode,
    /// Decode mode: the prefill server's base URL (http://host:port).
    #[arg(long, value_name = "URL")]
    pub prefill_url: Option<String>,
    /// Decode mode: timeout for one prefill call, in seconds.
    #[arg(long, default_value_t = 120)]
    pub prefill_timeout_s: u64,
    /// The engine and tier settings.
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// Resolves on the first Ctrl-C / SIGTERM; from then on a second one exits the process at once
/// (status 130), whatever the shutdown is waiting for.
async fn shutdown_signal() {
    one_signal().await;
    eprintln!("kvtier serve: shutting down (a second signal exits at once)");
    tokio::spawn(async {
        one_signal().await;
        eprintln!("kvtier serve: second signal, exiting now");
        std::process::exit(130);
    });
}

async fn one_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

/// Runs the server.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let mode = args.disaggregation_mode;
    let generator = match (mode, &args.prefill_url) {
        (DisaggMode::Decode, Some(u)) => Generator::Decode(PrefillClient {
            url: HttpUrl::parse(u).with_context(|| "--prefill-url")?,
            timeout: Duration::from_secs(args.prefill_timeout_s),
        }),
        (DisaggMode::Decode, None) => {
            bail!("--disaggregation-mode decode needs --prefill-url http://HOST:PORT")
        }
        (_, Some(_)) => bail!("--prefill-url is only used with --disaggregation-mode decode"),
        (_, None) => Generator::Local,
    };
    let cfg = args.engine.engine_config(mode.role())?;
    let backend = Arc::new(EngineBackend::start(cfg).context("starting the engine")?);
    let model = backend.model_name();
    let state = AppState::new(backend.clone(), generator, mode.label());
    let addr = SocketAddr::new(args.host, args.port);
    let connector = format!("{:?}", args.engine.connector).to_lowercase();
    let result = serve(
        state,
        addr,
        |bound| {
            println!(
                "kvtier serve: listening on http://{bound} (model {model}, connector {connector}, mode {})",
                mode.label()
            );
            let _ = std::io::stdout().flush();
        },
        shutdown_signal(),
    )
    .await;
    backend.shutdown();
    result
}
