//! `kvtier bench`: the embedded default workload comparison (the project's main command).
//!
//! Invariant: with no flags it runs the multi-round chat and document-QA workloads against three
//! configurations — the engine with no cache at all (G1 prefix cache off, no connector), the engine's
//! own prefix cache alone, and the engine with kvtier's host and disk tiers — on the built-in model,
//! with a G1 deliberately too small for the workloads' history, and writes `bench.json`, `bench.md`
//! and `bench.png` into `./bench-out/`. kvtier's ratios are reported against both baselines; the
//! target is against the prefix cache alone.

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
    /// Multi-round chat sharing a system prompt.
    Chat,
    /// Several questions per long document.
    Docqa,
}

/// Which configurations to compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ConfigChoice {
    /// No connector and the engine's G1 prefix cache off: nothing is reused across requests.
    NoCache,
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
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [ConfigChoice::NoCache, ConfigChoice::Engine, ConfigChoice::Kvtier])]
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
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// G1 capacity in blocks (small on purpose: the workloads' history must not fit).
    /// Default 96 (1536 tokens), 128 with --large.
    #[arg(long)]
    pub num_device_blocks: Option<usize>,
    /// Most requests running at once.
    #[arg(long, default_value_t = 16)]
    pub max_num_seqs: usize,
    /// Token budget of one forward pass.
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
        Self::parse_flags(&[]).unwrap_or_else(|e| e.exit())
    }

    /// `kvtier bench` flags from a list (without the program name).
    pub fn parse_flags(flags: &[&str]) -> Result<Self, clap::Error> {
        #[derive(clap::Parser)]
        struct Wrapper {
            #[command(flatten)]
            args: BenchArgs,
        }
        let argv = std::iter::once("kvtier-bench").chain(flags.iter().copied());
        Ok(<Wrapper as clap::Parser>::try_parse_from(argv)?.args)
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
                ConfigChoice::NoCache => BenchConfig {
                    name: "no-cache".into(),
                    description: "no connector, G1 prefix cache off: every prompt computed in full"
                        .into(),
                    prefix_cache: false,
                    kvtier: None,
                },
                ConfigChoice::Engine => BenchConfig {
                    name: "engine".into(),
                    description: "no connector: the engine's own G1 prefix cache only".into(),
                    prefix_cache: true,
                    kvtier: None,
                },
                ConfigChoice::Kvtier => BenchConfig {
                    name: "kvtier".into(),
                    description: format!(
                        "kvtier: host tier {} GB + disk tier {} GB",
                        self.engine.host_cache_gb, self.engine.disk_cache_gb
                    ),
                    prefix_cache: true,
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
                    prefix_cache: true,
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
            no_prefix_cache: !config.prefix_cache,
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

/// Which configurations the ratios are computed against.
#[derive(Debug, Clone, PartialEq)]
struct BaselinePlan {
    /// The target's baseline: the engine without kvtier (its prefix cache on if such a
    /// configuration runs, else the first configuration).
    baseline: String,
    /// Every configuration without kvtier (ratio columns), or the first one if all have kvtier.
    baselines: Vec<String>,
    /// The configuration the target is about: the first with kvtier.
    target: String,
}

fn baselines_of(configs: &[BenchConfig]) -> BaselinePlan {
    let first = configs.first().map(|c| c.name.clone()).unwrap_or_default();
    let mut baselines: Vec<String> = configs
        .iter()
        .filter(|c| c.kvtier.is_none())
        .map(|c| c.name.clone())
        .collect();
    if baselines.is_empty() {
        baselines.push(first.clone());
    }
    let baseline = configs
        .iter()
        .find(|c| c.kvtier.is_none() && c.prefix_cache)
        .map_or_else(|| baselines[0].clone(), |c| c.name.clone());
    let target = configs
        .iter()
        .find(|c| c.kvtier.is_some())
        .map_or(first, |c| c.name.clone());
    BaselinePlan {
        baseline,
        baselines,
        target,
    }
}

/// Runs the bench and prints the table.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let workloads = args.workloads();
    let configs = args.configs();
    if workloads.is_empty() || configs.is_empty() {
        bail!("--workloads and --configs must not be empty");
    }
    let plan = baselines_of(&configs);
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let opts = SuiteOptions {
        workloads,
        configs,
        out_dir: args.out.clone(),
        seed: args.seed,
        quiet: args.quiet,
        baseline: plan.baseline.clone(),
        baselines: plan.baselines.clone(),
        target_config: plan.target,
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
    println!(
        "{}",
        crate::bench::report::table(&report.rows, &plan.baselines)
    );
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_run_compares_three_configurations() {
        let a = BenchArgs::parse_defaults();
        let c = a.configs();
        let names: Vec<&str> = c.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["no-cache", "engine", "kvtier"]);
        assert!(!c[0].prefix_cache && c[0].kvtier.is_none());
        assert!(c[1].prefix_cache && c[1].kvtier.is_none());
        assert!(c[2].prefix_cache && c[2].kvtier.is_some());
        let plan = baselines_of(&c);
        assert_eq!(plan.baseline, "engine");
        assert_eq!(plan.baselines, ["no-cache", "engine"]);
        assert_eq!(plan.target, "kvtier");
    }

    #[test]
    fn baselines_without_the_prefix_cache_configuration() {
        let a = BenchArgs::parse_flags(&["--configs", "no-cache,kvtier-disk"]).unwrap();
        let plan = baselines_of(&a.configs());
        assert_eq!(plan.baseline, "no-cache");
        assert_eq!(plan.baselines, ["no-cache"]);
        assert_eq!(plan.target, "kvtier-disk");
        assert!(BenchArgs::parse_flags(&["--configs", "bogus"]).is_err());
    }
}
