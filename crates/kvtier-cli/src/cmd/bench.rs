//! `kvtier bench`: the embedded default workload comparison (the project's main command).
//!
//! Invariant: with no flags it runs the multi-round chat and document-QA workloads against the engine
//! alone and the engine with kvtier, on the built-in model, with a G1 deliberately too small for the
//! workloads' history, and writes `bench.json`, `bench.md` and `bench.png` into `./bench-out/`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::bail;
use clap::{Args, ValueEnum};
use kvtier_engine::Role;

use crate::backend::Backend;
use crate::bench::suite::{
    run_suite, verdict, BenchConfig, EngineFactory, SuiteOptions, TierSetup,
};
use crate::bench::workload::{ChatParams, DocQaParams, Workload};
use crate::engine_backend::EngineBackend;
use crate::settings::{ConnectorKind, EngineArgs, TierArgs};

/// Which workloads to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WorkloadChoice {
    Chat,
    Docqa,
}

/// Which configurations to compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ConfigChoice {
    /// No connector: the engine's own G1 prefix cache only.
    Engine,
    /// kvtier with host and disk tiers.
    Kvtier,
    /// kvtier with a tiny host tier, so hits come from disk.
    KvtierDisk,
}

/// `kvtier bench` flags.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Output directory for bench.json, bench.md, bench.png.
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,
    /// Workloads, in order (the first one carries the headline target).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [WorkloadChoice::Chat, WorkloadChoice::Docqa])]
    pub workloads: Vec<WorkloadChoice>,
    /// Configurations, in order (the first is the reference for the identical-output check).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [ConfigChoice::Engine, ConfigChoice::Kvtier])]
    pub configs: Vec<ConfigChoice>,
    /// A larger run (more users, longer histories and documents); several minutes.
    #[arg(long)]
    pub large: bool,
    /// Chat: users.
    #[arg(long)]
    pub users: Option<usize>,
    /// Chat: rounds per user.
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Chat: shared system prompt length in tokens.
    #[arg(long)]
    pub system_tokens: Option<usize>,
    /// Tokens per question (both workloads; default 32).
    #[arg(long)]
    pub question_tokens: Option<usize>,
    /// Tokens per answer (both workloads; default chat 64, docqa 16).
    #[arg(long)]
    pub answer_tokens: Option<u32>,
    /// Chat: requests per second.
    #[arg(long)]
    pub chat_qps: Option<f64>,
    /// Docqa: documents.
    #[arg(long)]
    pub docs: Option<usize>,
    /// Docqa: tokens per document.
    #[arg(long)]
    pub doc_tokens: Option<usize>,
    /// Docqa: questions per document.
    #[arg(long)]
    pub questions_per_doc: Option<usize>,
    /// Docqa: requests per second.
    #[arg(long)]
    pub docqa_qps: Option<f64>,
    /// Seed of the workload text.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// No progress lines.
    #[arg(long)]
    pub quiet: bool,
    /// Engine settings (G1 defaults to a size the workloads' history does not fit in).
    #[command(flatten)]
    pub engine: BenchEngineArgs,
}

/// Engine flags of the bench (defaults differ from `serve`: a small G1).
#[derive(Debug, Clone, Args)]
pub struct BenchEngineArgs {
    /// Hugging Face Llama directory. Default: the built-in model.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// G1 capacity in blocks (small on purpose: the workloads' history must not fit).
    /// Default 96 (1536 tokens), 128 with --large.
    #[arg(long)]
    pub num_device_blocks: Option<usize>,
    #[arg(long, default_value_t = 16)]
    pub max_num_seqs: usize,
    #[arg(long, default_value_t = 256)]
    pub max_batch_tokens: usize,
    /// Host tier size of the `kvtier` configuration, GB.
    #[arg(long, default_value_t = 1.0)]
    pub host_cache_gb: f64,
    /// Disk tier size, GB.
    #[arg(long, default_value_t = 1.0)]
    pub disk_cache_gb: f64,
}

impl BenchArgs {
    /// The flags' defaults (what `kvtier` with no command runs).
    pub fn parse_defaults() -> Self {
        #[derive(clap::Parser)]
        struct Wrapper {
            #[command(flatten)]
            args: BenchArgs,
        }
        <Wrapper as clap::Parser>::parse_from(["kvtier-bench"]).args
    }

    fn workloads(&self) -> Vec<Workload> {
        let large = self.large;
        let chat = ChatParams {
            users: self.users.unwrap_or(if large { 16 } else { 8 }),
            rounds: self.rounds.unwrap_or(if large { 10 } else { 8 }),
            system_tokens: self.system_tokens.unwrap_or(if large { 512 } else { 256 }),
            question_tokens: self.question_tokens.unwrap_or(32),
            answer_tokens: self.answer_tokens.unwrap_or(64),
            qps: self.chat_qps.unwrap_or(3.0),
        };
        let docqa = DocQaParams {
            docs: self.docs.unwrap_or(if large { 12 } else { 6 }),
            doc_tokens: self.doc_tokens.unwrap_or(if large { 1536 } else { 768 }),
            questions_per_doc: self.questions_per_doc.unwrap_or(if large { 4 } else { 3 }),
            question_tokens: self.question_tokens.unwrap_or(32),
            answer_tokens: self.answer_tokens.unwrap_or(16),
            qps: self.docqa_qps.unwrap_or(if large { 2.0 } else { 3.0 }),
        };
        self.workloads
            .iter()
            .map(|w| match w {
                WorkloadChoice::Chat => Workload::Chat(chat.clone()),
                WorkloadChoice::Docqa => Workload::DocQa(docqa.clone()),
            })
            .collect()
    }

    fn configs(&self) -> Vec<BenchConfig> {
        self.configs
            .iter()
            .map(|c| match c {
                ConfigChoice::Engine => BenchConfig {
                    name: "engine".into(),
                    description: "no connector: the engine's own G1 prefix cache only".into(),
                    kvtier: None,
                },
                ConfigChoice::Kvtier => BenchConfig {
                    name: "kvtier".into(),
                    description: format!(
                        "kvtier: host tier {} GB + disk tier {} GB",
                        self.engine.host_cache_gb, self.engine.disk_cache_gb
                    ),
                    kvtier: Some(TierSetup {
                        host_gb: self.engine.host_cache_gb,
                        disk_gb: self.engine.disk_cache_gb,
                        disk_filter: true,
                    }),
                },
                ConfigChoice::KvtierDisk => BenchConfig {
                    name: "kvtier-disk".into(),
                    description: format!(
                        "kvtier: tiny host tier (1 MB) + disk tier {} GB, disk filter off, so hits come from disk",
                        self.engine.disk_cache_gb
                    ),
                    kvtier: Some(TierSetup {
                        host_gb: 0.001,
                        disk_gb: self.engine.disk_cache_gb,
                        disk_filter: false,
                    }),
                },
            })
            .collect()
    }
}

/// Starts reference engines for the bench.
struct RealFactory {
    engine: BenchEngineArgs,
    num_device_blocks: usize,
}

impl EngineFactory for RealFactory {
    fn start(&self, config: &BenchConfig, scratch: &Path) -> anyhow::Result<Arc<dyn Backend>> {
        let args = EngineArgs {
            model: self.engine.model.clone(),
            model_seed: 0,
            block_size: self.engine.block_size,
            num_device_blocks: self.num_device_blocks,
            max_num_seqs: self.engine.max_num_seqs,
            max_batch_tokens: self.engine.max_batch_tokens,
            max_waiting: 4096,
            connector: if config.kvtier.is_some() {
                ConnectorKind::Kvtier
            } else {
                ConnectorKind::None
            },
            tiers: match &config.kvtier {
                Some(t) => TierArgs {
                    host_cache_gb: Some(t.host_gb),
                    disk_cache_gb: Some(t.disk_gb),
                    disk_cache_dir: Some(scratch.join("disk")),
                    remote_url: None,
                    no_disk_filter: !t.disk_filter,
                },
                None => TierArgs::default(),
            },
        };
        let cfg = args.engine_config(Role::Aggregated)?;
        Ok(Arc::new(EngineBackend::start(cfg)?))
    }

    fn device_tokens(&self) -> usize {
        self.num_device_blocks * self.engine.block_size
    }
}

/// Runs the bench and prints the table.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let workloads = args.workloads();
    let configs = args.configs();
    if workloads.is_empty() || configs.is_empty() {
        bail!("--workloads and --configs must not be empty");
    }
    let baseline = configs[0].name.clone();
    let target_config = configs
        .iter()
        .find(|c| c.kvtier.is_some())
        .map_or(baseline.clone(), |c| c.name.clone());
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let opts = SuiteOptions {
        workloads,
        configs,
        out_dir: args.out.clone(),
        seed: args.seed,
        quiet: args.quiet,
        baseline: baseline.clone(),
        target_config,
        target_ratio: 3.0,
        command,
    };
    let num_device_blocks =
        args.engine
            .num_device_blocks
            .unwrap_or(if args.large { 128 } else { 96 });
    let factory = RealFactory {
        engine: args.engine.clone(),
        num_device_blocks,
    };
    let started = std::time::Instant::now();
    let report = run_suite(&factory, &opts).await?;
    println!("{}", crate::bench::report::table(&report.rows, &baseline));
    print!("{}", verdict(&report));
    println!(
        "wrote {0}/bench.json, {0}/bench.md, {0}/bench.png in {1:.1} s",
        args.out.display(),
        started.elapsed().as_secs_f64()
    );
    if !report.outputs_identical {
        bail!("configurations generated different tokens: see mismatches in bench.json");
    }
    Ok(())
}
