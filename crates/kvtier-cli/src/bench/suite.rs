//! Runs every workload against every engine configuration, one engine at a time, and writes the report.
//!
//! Invariants: each (workload, configuration) pair gets a fresh engine and a fresh, empty scratch
//! directory for its disk tier, so no configuration inherits another's cache; the same request keys get
//! the same prompts everywhere, and the suite compares every configuration's generated tokens with the
//! first configuration's — any difference is reported as a correctness failure.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use serde::Serialize;

use crate::backend::Backend;
use crate::bench::report::{table, Summary};
use crate::bench::runner::{self, Progress, RequestRecord};
use crate::bench::workload::{RequestKey, Script, Workload};

/// Offload tiers of a kvtier configuration.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TierSetup {
    /// Host (G2) capacity in GB (decimal).
    pub host_gb: f64,
    /// Disk (G3) capacity in GB.
    pub disk_gb: f64,
    /// Apply the disk frequency filter (blocks reach disk only when offloaded twice in its window).
    pub disk_filter: bool,
}

/// One engine configuration of the comparison.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BenchConfig {
    /// Its name in the report (e.g. `kvtier`).
    pub name: String,
    /// One line saying what it is.
    pub description: String,
    /// The engine's own G1 prefix cache (off: nothing computed is reused across requests).
    pub prefix_cache: bool,
    /// `None`: no connector.
    pub kvtier: Option<TierSetup>,
}

/// Starts an engine for a configuration.
pub trait EngineFactory {
    /// A fresh engine; `scratch` is an empty directory it may use for its disk tier.
    fn start(&self, config: &BenchConfig, scratch: &Path) -> anyhow::Result<Arc<dyn Backend>>;
    /// G1 capacity in tokens (for the report's working-set line).
    fn device_tokens(&self) -> usize;
}

/// What to run and where to write.
#[derive(Debug, Clone)]
pub struct SuiteOptions {
    /// Workloads to run, in order.
    pub workloads: Vec<Workload>,
    /// Configurations to compare on each.
    pub configs: Vec<BenchConfig>,
    /// Where the report, chart and scratch directories go.
    pub out_dir: PathBuf,
    /// Seed of the workloads' token content.
    pub seed: u64,
    /// No progress output.
    pub quiet: bool,
    /// The configuration the target ratio is computed against.
    pub baseline: String,
    /// Every configuration the table's ratio columns (and `SuiteReport::ratios`) compare with.
    pub baselines: Vec<String>,
    /// The configuration the target is about.
    pub target_config: String,
    /// The target ratio (baseline TTFT p50 / target TTFT p50) on the first workload.
    pub target_ratio: f64,
    /// How the run was invoked (recorded in the JSON).
    pub command: String,
}

/// A mismatch between two configurations' outputs.
#[derive(Debug, Clone, Serialize)]
pub struct Mismatch {
    /// The workload.
    pub workload: String,
    /// The configuration whose output differs from the first one's.
    pub config: String,
    /// The request.
    pub key: RequestKey,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct SuiteReport {
    /// How the run was invoked.
    pub command: String,
    /// The machine it ran on (cores, model).
    pub machine: String,
    /// The workloads run.
    pub workloads: Vec<Workload>,
    /// The configurations compared.
    pub configs: Vec<BenchConfig>,
    /// One row per (workload, configuration).
    pub rows: Vec<Summary>,
    /// Every configuration generated the same tokens for every request.
    pub outputs_identical: bool,
    /// The requests where they did not.
    pub mismatches: Vec<Mismatch>,
    /// The headline check, if its configurations ran.
    pub target: Option<TargetCheck>,
    /// The target configuration's TTFT p50 ratio against every baseline, per workload.
    pub ratios: Vec<Ratio>,
    /// 1-minute load average of the machine when the run started and ended (Linux).
    pub load_avg: Option<(f64, f64)>,
    /// Per workload, per configuration, every request's record.
    pub requests: BTreeMap<String, BTreeMap<String, Vec<RequestRecord>>>,
}

/// `baseline`'s TTFT p50 divided by `config`'s on one workload (higher: `config` is faster).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Ratio {
    /// The workload.
    pub workload: String,
    /// The configuration measured.
    pub config: String,
    /// The configuration it is compared with.
    pub baseline: String,
    /// `baseline`'s TTFT p50 over `config`'s.
    pub ttft_p50: f64,
}

/// The headline check: kvtier vs the baseline on the first workload.
#[derive(Debug, Clone, Serialize)]
pub struct TargetCheck {
    /// The first workload.
    pub workload: String,
    /// The configuration compared with.
    pub baseline: String,
    /// The configuration the target is about.
    pub config: String,
    /// `baseline`'s TTFT p50 over `config`'s.
    pub ratio: f64,
    /// The ratio asked for.
    pub required: f64,
    /// Whether `ratio >= required`.
    pub met: bool,
    /// Distinct tokens the workload keeps alive (all streams' final histories) vs G1's capacity.
    pub working_set_tokens: usize,
    /// G1's capacity in tokens.
    pub device_tokens: usize,
}

fn machine() -> String {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    format!("{} {} cores", std::env::consts::ARCH, cores)
}

/// The 1-minute load average (`None` where `/proc/loadavg` is missing).
fn load_avg() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn ttft_ratio(rows: &[Summary], workload: &str, baseline: &str, config: &str) -> Option<f64> {
    let find = |c: &str| {
        rows.iter()
            .find(|r| r.workload == workload && r.config == c)
    };
    let (b, t) = (find(baseline)?, find(config)?);
    Some(if t.ttft_p50_ms > 0.0 {
        b.ttft_p50_ms / t.ttft_p50_ms
    } else {
        0.0
    })
}

fn working_set(w: &Workload) -> usize {
    match w {
        Workload::Chat(p) => {
            p.system_tokens + p.users * p.rounds * (p.question_tokens + p.answer_tokens as usize)
        }
        Workload::DocQa(p) => p.docs * p.doc_tokens,
    }
}

/// Runs the suite and writes `bench.json`, `bench.md` and `bench.png` into `opts.out_dir`.
pub async fn run_suite(
    factory: &dyn EngineFactory,
    opts: &SuiteOptions,
) -> anyhow::Result<SuiteReport> {
    std::fs::create_dir_all(&opts.out_dir)
        .with_context(|| format!("creating {}", opts.out_dir.display()))?;
    let load_start = load_avg();
    let scratch_root = opts.out_dir.join("scratch");
    let mut rows = Vec::new();
    let mut mismatches = Vec::new();
    let mut requests: BTreeMap<String, BTreeMap<String, Vec<RequestRecord>>> = BTreeMap::new();
    for w in &opts.workloads {
        let mut script: Option<Script> = None;
        let mut reference: Option<(String, BTreeMap<RequestKey, Vec<u32>>)> = None;
        for c in &opts.configs {
            let scratch = scratch_root.join(format!("{}-{}", w.name(), c.name));
            if scratch.exists() {
                std::fs::remove_dir_all(&scratch)
                    .with_context(|| format!("clearing {}", scratch.display()))?;
            }
            std::fs::create_dir_all(&scratch)
                .with_context(|| format!("creating {}", scratch.display()))?;
            let backend = factory
                .start(c, &scratch)
                .with_context(|| format!("starting the engine for `{}`", c.name))?;
            if w.max_sequence_len() > backend.max_model_len() {
                backend.shutdown();
                anyhow::bail!(
                    "workload `{}` needs sequences of {} tokens but the model's context is {}",
                    w.name(),
                    w.max_sequence_len(),
                    backend.max_model_len()
                );
            }
            let script = script.get_or_insert_with(|| {
                let vocab = backend.vocab_size();
                let (lo, hi) = if vocab >= 127 { (32, 127) } else { (0, vocab) };
                Script::new(w, opts.seed, lo, hi)
            });
            if !opts.quiet {
                eprintln!("== {} / {}: {}", w.name(), c.name, c.description);
            }
            let mut progress = Progress::new(
                format!("{}/{}", w.name(), c.name),
                w.num_requests(),
                opts.quiet,
            );
            let result = runner::run(backend.clone(), w, script, &mut progress).await;
            backend.shutdown();
            let _ = std::fs::remove_dir_all(&scratch);
            let summary = Summary::new(w.name(), &c.name, &result);
            let outputs: BTreeMap<RequestKey, Vec<u32>> = result
                .records
                .iter()
                .map(|r| (r.key, r.output.clone()))
                .collect();
            match &reference {
                None => reference = Some((c.name.clone(), outputs)),
                Some((_, want)) => {
                    for (k, v) in want {
                        if outputs.get(k) != Some(v) {
                            mismatches.push(Mismatch {
                                workload: w.name().into(),
                                config: c.name.clone(),
                                key: *k,
                            });
                        }
                    }
                }
            }
            if let Some(e) = result.records.iter().find_map(|r| r.error.clone()) {
                eprintln!(
                    "  warning: {} request(s) failed, first error: {e}",
                    summary.errors
                );
            }
            requests
                .entry(w.name().to_string())
                .or_default()
                .insert(c.name.clone(), result.records);
            rows.push(summary);
        }
    }
    let _ = std::fs::remove_dir(&scratch_root);

    let target = opts.workloads.first().and_then(|w| {
        let ratio = ttft_ratio(&rows, w.name(), &opts.baseline, &opts.target_config)?;
        Some(TargetCheck {
            workload: w.name().into(),
            baseline: opts.baseline.clone(),
            config: opts.target_config.clone(),
            ratio,
            required: opts.target_ratio,
            met: ratio >= opts.target_ratio,
            working_set_tokens: working_set(w),
            device_tokens: factory.device_tokens(),
        })
    });
    let mut ratios = Vec::new();
    for w in &opts.workloads {
        for b in opts.baselines.iter().filter(|b| **b != opts.target_config) {
            if let Some(r) = ttft_ratio(&rows, w.name(), b, &opts.target_config) {
                ratios.push(Ratio {
                    workload: w.name().into(),
                    config: opts.target_config.clone(),
                    baseline: b.clone(),
                    ttft_p50: r,
                });
            }
        }
    }
    let report = SuiteReport {
        command: opts.command.clone(),
        machine: machine(),
        workloads: opts.workloads.clone(),
        configs: opts.configs.clone(),
        outputs_identical: mismatches.is_empty(),
        mismatches,
        target,
        ratios,
        load_avg: load_start.zip(load_avg()),
        rows,
        requests,
    };
    write_outputs(&report, opts)?;
    Ok(report)
}

/// The human summary printed after the table.
pub fn verdict(report: &SuiteReport) -> String {
    let mut s = String::new();
    if report.outputs_identical {
        s.push_str("outputs: every configuration generated identical tokens for every request\n");
    } else {
        s.push_str(&format!(
            "outputs: MISMATCH in {} request(s) (first: {:?}) — kvtier must never change an answer\n",
            report.mismatches.len(),
            report.mismatches.first()
        ));
    }
    for r in &report.ratios {
        s.push_str(&format!(
            "{} on `{}`: TTFT p50 {:.2}x better than `{}`\n",
            r.config, r.workload, r.ttft_p50, r.baseline
        ));
    }
    if let Some(t) = &report.target {
        s.push_str(&format!(
            "target: {} TTFT p50 {:.2}x better than `{}` on `{}` (required {:.1}x: {}); working set {} tokens vs G1 {} tokens\n",
            t.config,
            t.ratio,
            t.baseline,
            t.workload,
            t.required,
            if t.met { "met" } else { "NOT met" },
            t.working_set_tokens,
            t.device_tokens,
        ));
    }
    s
}

/// The chart's title: the headline ratios of the first workload.
fn chart_title(report: &SuiteReport) -> String {
    let mut t = String::from("kvtier bench: time to first token");
    let first = report.workloads.first().map(|w| w.name().to_string());
    let parts: Vec<String> = report
        .ratios
        .iter()
        .filter(|r| Some(&r.workload) == first.as_ref())
        .map(|r| format!("{:.1}x vs {}", r.ttft_p50, r.baseline))
        .collect();
    if let (Some(w), Some(r)) = (&first, report.ratios.first()) {
        if !parts.is_empty() {
            t.push_str(&format!(" ({w}, {}: {})", r.config, parts.join(", ")));
        }
    }
    t
}

fn write_outputs(report: &SuiteReport, opts: &SuiteOptions) -> anyhow::Result<()> {
    let json_path = opts.out_dir.join("bench.json");
    let json = serde_json::to_string_pretty(report)?;
    std::fs::write(&json_path, json).with_context(|| format!("writing {}", json_path.display()))?;
    let md_path = opts.out_dir.join("bench.md");
    let load = report.load_avg.map_or_else(String::new, |(a, b)| {
        format!("\nload average (1 min): {a:.2} at start, {b:.2} at end")
    });
    let md = format!(
        "# kvtier bench\n\ncommand: `{}`\nmachine: {}{load}\nbaselines for ratios: {}; target baseline `{}`\n\n{}\n{}",
        report.command,
        report.machine,
        opts.baselines
            .iter()
            .map(|b| format!("`{b}`"))
            .collect::<Vec<_>>()
            .join(", "),
        opts.baseline,
        table(&report.rows, &opts.baselines),
        verdict(report)
    );
    std::fs::write(&md_path, md).with_context(|| format!("writing {}", md_path.display()))?;
    let names: Vec<String> = opts.configs.iter().map(|c| c.name.clone()).collect();
    let png = opts.out_dir.join("bench.png");
    crate::bench::chart::draw(&png, &report.rows, &names, &chart_title(report))
        .with_context(|| format!("writing {}", png.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::fake::FakeBackend;
    use crate::bench::workload::{ChatParams, DocQaParams};

    struct Fakes;
    impl EngineFactory for Fakes {
        fn start(&self, _c: &BenchConfig, scratch: &Path) -> anyhow::Result<Arc<dyn Backend>> {
            assert!(scratch.is_dir());
            assert_eq!(
                std::fs::read_dir(scratch)?.count(),
                0,
                "scratch must start empty"
            );
            std::fs::write(scratch.join("leftover"), b"x")?;
            Ok(Arc::new(FakeBackend::new()))
        }
        fn device_tokens(&self) -> usize {
            16
        }
    }

    #[tokio::test]
    async fn suite_writes_json_md_png_and_compares_outputs() {
        let dir = tempfile::tempdir().unwrap();
        let opts = SuiteOptions {
            workloads: vec![
                Workload::Chat(ChatParams {
                    users: 2,
                    rounds: 2,
                    system_tokens: 8,
                    question_tokens: 4,
                    answer_tokens: 2,
                    qps: 1000.0,
                }),
                Workload::DocQa(DocQaParams {
                    docs: 2,
                    doc_tokens: 8,
                    questions_per_doc: 2,
                    question_tokens: 2,
                    answer_tokens: 2,
                    qps: 1000.0,
                }),
            ],
            configs: vec![
                BenchConfig {
                    name: "a".into(),
                    description: "first".into(),
                    prefix_cache: true,
                    kvtier: None,
                },
                BenchConfig {
                    name: "b".into(),
                    description: "second".into(),
                    prefix_cache: true,
                    kvtier: Some(TierSetup {
                        host_gb: 0.001,
                        disk_gb: 0.01,
                        disk_filter: true,
                    }),
                },
            ],
            out_dir: dir.path().join("out"),
            seed: 1,
            quiet: true,
            baseline: "a".into(),
            baselines: vec!["a".into()],
            target_config: "b".into(),
            target_ratio: 3.0,
            command: "test".into(),
        };
        let r = run_suite(&Fakes, &opts).await.unwrap();
        assert!(r.outputs_identical);
        assert_eq!(r.rows.len(), 4);
        let t = r.target.as_ref().unwrap();
        assert_eq!(t.workload, "chat");
        assert_eq!(t.working_set_tokens, 8 + 2 * 2 * 6);
        let rs: Vec<(&str, &str)> = r
            .ratios
            .iter()
            .map(|x| (x.workload.as_str(), x.baseline.as_str()))
            .collect();
        assert_eq!(rs, [("chat", "a"), ("docqa", "a")]);
        let title = chart_title(&r);
        assert!(
            title.contains("(chat, b: ") && title.contains("x vs a)"),
            "{title}"
        );
        for f in ["bench.json", "bench.md", "bench.png"] {
            assert!(opts.out_dir.join(f).is_file(), "{f}");
        }
        assert!(!opts.out_dir.join("scratch").exists());
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(opts.out_dir.join("bench.json")).unwrap())
                .unwrap();
        assert_eq!(v["rows"].as_array().unwrap().len(), 4);
        assert_eq!(v["requests"]["chat"]["a"].as_array().unwrap().len(), 4);
    }
}
