//! The `dflash` command line: parses arguments, wires pipeline -> graph -> store -> executor,
//! and prints results. Data goes to stdout, logs and progress to stderr. Exit codes: 0 success,
//! 1 a stage failed, 2 invalid input or usage.

mod report;
mod units;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use miette::Diagnostic;

use crate::graph::Graph;
use crate::hashcache::HashCache;
use crate::key::Key;
use crate::kinds::Registry;
use crate::pipeline::{self, Pipeline};
use crate::run::{RunOptions, execute};
use crate::store::{Manifest, Status, Store};

/// Declarative, content-addressed pipelines for training DFlash speculative-decoding drafters.
#[derive(Parser)]
#[command(name = "dflash", version, about, max_term_width = 100)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Clone)]
struct StoreArg {
    /// The artifact store: a folder or a URL (s3://bucket/prefix, gs://, az://). Default: the
    /// pipeline's `store:`, else ./cache
    #[arg(long, env = "DFLASH_STORE", global = true)]
    store: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Run every stage whose output is not in the store
    Run {
        /// The pipeline file
        pipeline: PathBuf,
        /// Run only this stage and what it needs (repeatable)
        #[arg(long)]
        only: Vec<String>,
        /// Stages to run at once
        #[arg(long, short, default_value_t = default_jobs())]
        jobs: usize,
        /// Print one JSON object with the run's results on stdout
        #[arg(long)]
        json: bool,
        /// Run on a store that failed the create-only probe (it may replace objects in a race)
        #[arg(long)]
        allow_overwriting_store: bool,
        #[command(flatten)]
        store: StoreArg,
    },
    /// Show what would run and why, writing nothing
    Plan {
        /// The pipeline file
        pipeline: PathBuf,
        /// Print JSON on stdout
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArg,
    },
    /// The GPU-hours, wall-clock, storage and cost a pipeline needs, writing nothing
    Estimate {
        /// The pipeline file
        pipeline: PathBuf,
        /// The GPUs of one host: `8xH200`, `H100`, `4xA100`
        #[arg(long, default_value = "1xH200", value_parser = crate::estimate::Hardware::parse)]
        gpus: crate::estimate::Hardware,
        /// USD per GPU-hour (default: a typical rate for the GPU)
        #[arg(long)]
        price: Option<f64>,
        /// Warn when the plan would store more than this: `10TB`, `500GB`
        #[arg(long, default_value = "10TB", value_parser = units::parse_bytes)]
        max_storage: f64,
        /// Warn when a stage or the plan takes longer than this: `24h`, `3days`
        #[arg(long, value_parser = units::parse_hours)]
        budget: Option<f64>,
        /// Override an assumption, NAME=VALUE (repeatable; the table lists them)
        #[arg(long, value_name = "NAME=VALUE")]
        assume: Vec<String>,
        /// Print JSON on stdout
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArg,
    },
    /// Show one artifact's manifest
    Show {
        /// A key or digest prefix, or a stage id with --pipeline
        reference: String,
        /// Resolve a stage id against this pipeline
        #[arg(long, short)]
        pipeline: Option<PathBuf>,
        /// Print the log of the stage that made it (kept in the store beside the artifact:
        /// `train`'s pace is there) instead of the manifest
        #[arg(long)]
        log: bool,
        #[command(flatten)]
        store: StoreArg,
    },
    /// List committed artifacts
    Ls {
        /// Print JSON on stdout
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArg,
    },
    /// Copy an artifact's files into a new folder
    Export {
        /// A key or digest prefix, or a stage id with --pipeline
        reference: String,
        /// The folder to create (it must not exist, or be empty)
        dir: PathBuf,
        /// Resolve a stage id against this pipeline
        #[arg(long, short)]
        pipeline: Option<PathBuf>,
        /// Only the files whose path matches GLOB (repeatable; `*` stays within a folder, `**`
        /// crosses folders), e.g. a trained drafter without its checkpoints: `--files
        /// 'drafter/*' --files '*.json*'`
        #[arg(long, value_name = "GLOB")]
        files: Vec<String>,
        #[command(flatten)]
        store: StoreArg,
    },
    /// The provenance tree of an artifact, down to its external sources
    Lineage {
        /// A key or digest prefix, or a stage id with --pipeline
        reference: String,
        /// Resolve a stage id against this pipeline
        #[arg(long, short)]
        pipeline: Option<PathBuf>,
        /// Print JSON on stdout
        #[arg(long, conflicts_with_all = ["dot", "mermaid"])]
        json: bool,
        /// Print a Graphviz DOT graph
        #[arg(long, conflicts_with = "mermaid")]
        dot: bool,
        /// Print a Mermaid flowchart
        #[arg(long)]
        mermaid: bool,
        #[command(flatten)]
        store: StoreArg,
    },
    /// What changed between two runs (run ids) or two pipeline files, stage by stage
    Diff {
        /// A run id (see `dflash runs`) or a pipeline file
        a: String,
        /// A run id or a pipeline file
        b: String,
        /// Print JSON on stdout
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArg,
    },
    /// Write one run as a self-contained HTML page: the stage graph, timings, data summaries, charts
    Report {
        /// A run id or its prefix (see `dflash runs`), or `latest`
        run: String,
        /// The HTML file to write
        #[arg(long, short, default_value = "report.html")]
        output: PathBuf,
        /// Another run to set beside it: which stages made other artifacts, and each bench's
        /// tau in both runs
        #[arg(long)]
        against: Option<String>,
        #[command(flatten)]
        store: StoreArg,
    },
    /// List past runs
    Runs {
        /// Print JSON on stdout
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArg,
    },
    /// Re-hash every stored artifact's files and report any whose bytes don't match
    Verify {
        /// Print JSON on stdout
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        store: StoreArg,
    },
    /// Copy whole artifacts, finished shards and run records into another store, create-only
    Copy {
        /// The store to copy from: a folder or a URL
        #[arg(long)]
        from: String,
        /// The store to copy into (created if a folder that does not exist)
        #[arg(long)]
        to: String,
        /// Only the artifacts of this stage id (repeatable; default: every stage)
        #[arg(long)]
        stage: Vec<String>,
        /// Leave out an artifact with any file of this size or more (e.g. 4M)
        #[arg(long, value_parser = units::parse_bytes)]
        max_file_bytes: Option<f64>,
        /// Print JSON on stdout
        #[arg(long)]
        json: bool,
        /// Copy into a store that failed the create-only probe (it may replace objects in a race)
        #[arg(long)]
        allow_overwriting_store: bool,
    },
    /// List the stage kinds and their params
    Kinds,
}

fn default_jobs() -> usize {
    std::thread::available_parallelism().map_or(2, std::num::NonZero::get)
}

/// A failure with its exit code.
struct Failure {
    code: u8,
    report: Option<miette::Report>,
}

impl<E: Diagnostic + Send + Sync + 'static> From<E> for Failure {
    fn from(e: E) -> Self {
        Self {
            code: 2,
            report: Some(miette::Report::new(e)),
        }
    }
}

/// The id column's width: 24, or the longest id (a sweep's `ID@param=value,...`), so the
/// columns after it line up.
pub(crate) fn id_width(p: &Pipeline) -> usize {
    p.stages
        .iter()
        .map(|s| s.id.len())
        .max()
        .unwrap_or(0)
        .max(24)
}

/// A user-facing error raised by the CLI itself.
#[derive(Debug, thiserror::Error, Diagnostic)]
enum CliError {
    #[error("no artifact matches `{0}`")]
    #[diagnostic(
        code(dflash::cli::no_match),
        help("`dflash ls` lists artifacts; a stage id needs `--pipeline FILE`")
    )]
    NoMatch(String),
    #[error("`{0}` matches {1} artifacts")]
    #[diagnostic(code(dflash::cli::ambiguous), help("give more characters of the key"))]
    Ambiguous(String, usize),
    #[error("`{0}` is a matrix of {1} stages, each with its own artifact")]
    #[diagnostic(code(dflash::cli::matrix), help("name one: {2}"))]
    Matrix(String, usize, String),
    #[error("stage `{0}` is not done yet, so it has no artifact")]
    #[diagnostic(
        code(dflash::cli::not_done),
        help("run the pipeline first: `dflash run PIPELINE`")
    )]
    NotDone(String),
    #[error("the store holds no log of `{0}` ({1})")]
    #[diagnostic(
        code(dflash::cli::no_log),
        help(
            "a stage's log is stored beside its artifact; an artifact made before logs were kept, or copied by an earlier `dflash copy`, has none"
        )
    )]
    NoLog(String, String),
    #[error("`{0}` exists and is not empty; export never writes over files")]
    #[diagnostic(code(dflash::cli::export_target), help("pick a new folder"))]
    ExportTarget(String),
    #[error("`--files {0}` is not a glob: {1}")]
    #[diagnostic(
        code(dflash::cli::bad_glob),
        help("`*` and `?` match within a folder, `**` across folders, `[ab]` one of")
    )]
    BadGlob(String, String),
    #[error("`--files {0}` matches none of the {1} files of {2}")]
    #[diagnostic(code(dflash::cli::glob_matches_nothing), help("its files: {3}"))]
    GlobMatchesNothing(String, usize, String, String),
    #[error("cannot write `{0}`: {1}")]
    #[diagnostic(code(dflash::cli::write))]
    Write(String, std::io::Error),
    #[error("no run and no pipeline file matches `{0}`")]
    #[diagnostic(
        code(dflash::cli::no_run),
        help("`dflash runs` lists run ids; a pipeline file must exist")
    )]
    NoRun(String),
    #[error("{0}")]
    #[diagnostic(code(dflash::cli::usage), help("`dflash help` describes every option"))]
    Usage(String),
    #[error("cannot start the async runtime: {0}")]
    #[diagnostic(code(dflash::cli::runtime))]
    Runtime(std::io::Error),
}

/// The files of `m` that `export --files` asks for: all without globs, else those whose path
/// matches one; a glob that is malformed or matches nothing is an error (a typo would
/// otherwise export less than asked, silently).
fn chosen_files<'a>(
    m: &'a crate::store::Manifest,
    globs: &[String],
) -> Result<Vec<&'a crate::store::FileEntry>, CliError> {
    if globs.is_empty() {
        return Ok(m.files.iter().collect());
    }
    let options = glob::MatchOptions {
        case_sensitive: true,
        require_literal_separator: true,
        require_literal_leading_dot: false,
    };
    let mut patterns = Vec::new();
    for g in globs {
        let p = glob::Pattern::new(g).map_err(|e| CliError::BadGlob(g.clone(), e.msg.into()))?;
        if !m.files.iter().any(|f| p.matches_with(&f.path, options)) {
            // The artifact's top level, sorted: what a glob usually names.
            let top: std::collections::BTreeSet<String> = m
                .files
                .iter()
                .map(|f| match f.path.split_once('/') {
                    Some((d, _)) => format!("{d}/"),
                    None => f.path.clone(),
                })
                .collect();
            return Err(CliError::GlobMatchesNothing(
                g.clone(),
                m.files.len(),
                m.key.0.short(12),
                top.into_iter().collect::<Vec<_>>().join(", "),
            ));
        }
        patterns.push(p);
    }
    Ok(m.files
        .iter()
        .filter(|f| patterns.iter().any(|p| p.matches_with(&f.path, options)))
        .collect())
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    miette::set_hook(Box::new(|_| {
        Box::new(
            miette::MietteHandlerOpts::new()
                .terminal_links(false)
                .build(),
        )
    }))
    .ok();
    match dispatch(cli) {
        Ok(code) => ExitCode::from(code),
        Err(f) => {
            if let Some(r) = f.report {
                eprintln!("{r:?}");
            }
            ExitCode::from(f.code)
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, Failure> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::Runtime(e).into())
}

fn work_dir() -> PathBuf {
    std::env::var_os("DFLASH_WORK").map_or_else(|| PathBuf::from(".dflash"), PathBuf::from)
}

fn cwd() -> PathBuf {
    std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."))
}

fn open_store(arg: &StoreArg, pipeline: Option<&Pipeline>) -> Result<Store, Failure> {
    let loc = arg
        .store
        .clone()
        .or_else(|| pipeline.and_then(|p| p.store.clone()))
        .unwrap_or_else(|| "cache".to_owned());
    Ok(Store::open(&loc)?)
}

/// Load a pipeline for a command that only reads or sizes it (types and ranges checked).
fn load(path: &Path, registry: &Registry) -> Result<(Arc<Pipeline>, Graph), Failure> {
    load_checked(path, registry, None)
}

/// Load a pipeline with every check, as `plan` and `run` do: the kinds' own checks, against
/// local files, before anything runs; `only` narrows them to the stages `run --only` runs.
fn load_for_running(
    path: &Path,
    registry: &Registry,
    only: &[String],
) -> Result<(Arc<Pipeline>, Graph), Failure> {
    let cwd = cwd();
    load_checked(
        path,
        registry,
        Some(pipeline::KindChecks { cwd: &cwd, only }),
    )
}

fn load_checked(
    path: &Path,
    registry: &Registry,
    kind_checks: Option<pipeline::KindChecks<'_>>,
) -> Result<(Arc<Pipeline>, Graph), Failure> {
    let p = pipeline::load(path, registry, kind_checks)?;
    let g = Graph::build(&p).map_err(|e| Failure::from(*e))?;
    Ok((Arc::new(p), g))
}

/// The run whose id starts with `id` (`latest`: the last one).
fn find_run(
    runs: &[crate::store::RunRecord],
    id: &str,
) -> Result<crate::store::RunRecord, Failure> {
    if id == "latest" {
        return runs
            .last()
            .cloned()
            .ok_or_else(|| Failure::from(CliError::NoRun(id.to_owned())));
    }
    let hits: Vec<&crate::store::RunRecord> =
        runs.iter().filter(|r| r.run_id.starts_with(id)).collect();
    match hits.len() {
        1 => Ok(hits[0].clone()),
        0 => Err(Failure::from(CliError::NoRun(id.to_owned()))),
        n => Err(Failure::from(CliError::Ambiguous(id.to_owned(), n))),
    }
}

fn out(s: &str) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{s}");
}

fn dispatch(cli: Cli) -> Result<u8, Failure> {
    let registry = Registry::builtin();
    match cli.command {
        Command::Run {
            pipeline,
            only,
            jobs,
            json,
            allow_overwriting_store,
            store,
        } => {
            let (p, g) = load_for_running(&pipeline, &registry, &only)?;
            let store = open_store(&store, Some(&p))?;
            let opts = RunOptions {
                jobs,
                only,
                allow_overwriting_store,
                work_dir: work_dir(),
                cwd: cwd(),
            };
            let mut reporter = report::for_stderr();
            let record = runtime()?.block_on(execute(
                p.clone(),
                &g,
                registry,
                store,
                opts,
                reporter.as_mut(),
            ))?;
            let failed = record.stages.iter().any(|s| s.status == Status::Failed);
            let computed = record
                .stages
                .iter()
                .filter(|s| matches!(s.status, Status::Ran | Status::Resumed))
                .count();
            if json {
                let stages: Vec<_> = record
                    .stages
                    .iter()
                    .map(|s| serde_json::json!({"id": s.id, "kind": s.kind, "key": s.key, "status": s.status, "digest": s.digest, "seconds": s.seconds, "error": s.error}))
                    .collect();
                out(&serde_json::json!({"run_id": record.run_id, "stages": stages}).to_string());
            }
            if failed {
                eprintln!(
                    "run {} failed: {} of {} stages failed",
                    record.run_id,
                    record
                        .stages
                        .iter()
                        .filter(|s| s.status == Status::Failed)
                        .count(),
                    record.stages.len()
                );
                return Ok(1);
            }
            if computed == 0 {
                eprintln!(
                    "nothing to do: every stage is cached ({:.0} ms)",
                    record.seconds * 1000.0
                );
            }
            Ok(0)
        }
        Command::Plan {
            pipeline,
            json,
            store,
        } => {
            let (p, g) = load_for_running(&pipeline, &registry, &[])?;
            let store = open_store(&store, Some(&p))?;
            let hashes = HashCache::load(&work_dir(), &cwd());
            let plan =
                runtime()?.block_on(crate::plan::plan(&p, &g, &registry, &store, &hashes))?;
            hashes.save();
            if json {
                out(&serde_json::json!({ "stages": plan }).to_string());
            } else {
                let width = id_width(&p);
                for s in &plan {
                    let key = s.key.map_or_else(|| "-".into(), |k| k.0.short(12));
                    let state = serde_json::to_value(s.state)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default();
                    let line = format!(
                        "{:<8} {:<width$} {:<10} {key:<12} {}",
                        state,
                        s.id,
                        s.kind,
                        s.reason.as_deref().unwrap_or("")
                    );
                    out(line.trim_end());
                }
                let todo = plan
                    .iter()
                    .filter(|s| s.state != crate::plan::State::Done)
                    .count();
                eprintln!("{todo} of {} stages to run", plan.len());
            }
            Ok(0)
        }
        Command::Estimate {
            pipeline,
            gpus,
            price,
            max_storage,
            budget,
            assume,
            json,
            store,
        } => {
            let (p, g) = load(&pipeline, &registry)?;
            let store = open_store(&store, Some(&p))?;
            let mut assumptions = crate::estimate::Assumptions::defaults(&gpus);
            for a in &assume {
                assumptions
                    .apply(a)
                    .map_err(|e| CliError::Usage(format!("--assume {e}")))?;
            }
            if let Some(p) = price
                && !(p.is_finite() && p >= 0.0)
            {
                return Err(CliError::Usage(format!("--price {p} is not a price")).into());
            }
            let opts = crate::estimate::Options {
                price: price.unwrap_or(gpus.gpu.price),
                hardware: gpus,
                max_storage,
                budget_hours: budget,
                assumptions,
                base: cwd(),
            };
            let hashes = HashCache::load(&work_dir(), &cwd());
            let e = runtime()?.block_on(crate::estimate::estimate(
                &p, &g, &registry, &store, &hashes, &opts,
            ))?;
            hashes.save();
            if json {
                out(&serde_json::to_string(&e).expect("serializable"));
            } else {
                out(crate::estimate::render(&e).trim_end());
            }
            Ok(0)
        }
        Command::Show {
            reference,
            pipeline,
            log,
            store,
        } => {
            let rt = runtime()?;
            let (store, m) =
                rt.block_on(resolve(&reference, pipeline.as_deref(), &store, &registry))?;
            if !log {
                out(&serde_json::to_string_pretty(&m).expect("serializable"));
                return Ok(0);
            }
            let bytes = rt
                .block_on(store.stage_log(&m))?
                .ok_or_else(|| CliError::NoLog(m.lineage.stage_id.clone(), m.key.0.short(12)))?;
            let mut o = std::io::stdout().lock();
            let _ = o.write_all(&bytes);
            Ok(0)
        }
        Command::Ls { json, store } => {
            let store = open_store(&store, None)?;
            let manifests = runtime()?.block_on(async {
                let mut all = Vec::new();
                for k in store.keys().await? {
                    if let Some(m) = store.manifest(&k).await? {
                        all.push(m);
                    }
                }
                Ok::<_, crate::store::StoreError>(all)
            })?;
            let mut manifests = manifests;
            manifests.sort_by(|a, b| a.lineage.started.cmp(&b.lineage.started));
            if json {
                let rows: Vec<_> = manifests
                    .iter()
                    .map(|m| serde_json::json!({"key": m.key, "digest": m.digest, "stage": m.lineage.stage_id, "pipeline": m.lineage.pipeline, "kind": m.fingerprint.kind, "files": m.files.len(), "bytes": m.files.iter().map(|f| f.size).sum::<u64>(), "produced": m.lineage.started}))
                    .collect();
                out(&serde_json::Value::Array(rows).to_string());
            } else {
                for m in &manifests {
                    let bytes: u64 = m.files.iter().map(|f| f.size).sum();
                    out(&format!(
                        "{}  {:<24} {:<10} {:>4} files {:>10} B  {}",
                        m.key.0.short(12),
                        format!("{}/{}", m.lineage.pipeline, m.lineage.stage_id),
                        m.fingerprint.kind,
                        m.files.len(),
                        bytes,
                        m.lineage.started
                    ));
                }
            }
            Ok(0)
        }
        Command::Export {
            reference,
            dir,
            pipeline,
            files,
            store,
        } => {
            if dir.exists() && std::fs::read_dir(&dir).map_or(true, |mut d| d.next().is_some()) {
                return Err(CliError::ExportTarget(dir.display().to_string()).into());
            }
            let rt = runtime()?;
            let (store, m) =
                rt.block_on(resolve(&reference, pipeline.as_deref(), &store, &registry))?;
            let chosen = chosen_files(&m, &files)?;
            rt.block_on(async {
                for f in &chosen {
                    let target =
                        crate::run::safe_join_for_export(&dir, &f.path).map_err(|e| Failure {
                            code: 2,
                            report: Some(miette::Report::new(e)),
                        })?;
                    if let Some(parent) = target.parent() {
                        std::fs::create_dir_all(parent)
                            .map_err(|e| CliError::Write(parent.display().to_string(), e))?;
                    }
                    let file = std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .open(&target)
                        .map_err(|e| CliError::Write(target.display().to_string(), e))?;
                    // A part at a time (a checkpoint may be many GB); bytes that fail the
                    // check are removed, not left looking exported.
                    let mut out = std::io::BufWriter::new(file);
                    let written = store.get_blob_into(&f.digest, &mut out).await;
                    let flushed = out.flush();
                    if written.is_err() || flushed.is_err() {
                        let _ = std::fs::remove_file(&target);
                    }
                    written?;
                    flushed.map_err(|e| CliError::Write(target.display().to_string(), e))?;
                }
                Ok::<_, Failure>(())
            })?;
            eprintln!(
                "exported {} files of {} to {}{}",
                chosen.len(),
                m.key.0.short(12),
                dir.display(),
                if chosen.len() < m.files.len() {
                    format!(" ({} not matched by --files)", m.files.len() - chosen.len())
                } else {
                    String::new()
                }
            );
            Ok(0)
        }
        Command::Lineage {
            reference,
            pipeline,
            json,
            dot,
            mermaid,
            store,
        } => {
            let rt = runtime()?;
            let (store, m) =
                rt.block_on(resolve(&reference, pipeline.as_deref(), &store, &registry))?;
            let tree = rt.block_on(crate::lineage::tree(&store, &m))?;
            if json {
                out(&serde_json::to_string_pretty(&tree).expect("serializable"));
            } else if dot {
                out(crate::lineage::render_dot(&tree).trim_end());
            } else if mermaid {
                out(crate::lineage::render_mermaid(&tree).trim_end());
            } else {
                out(crate::lineage::render_text(&tree).trim_end());
            }
            Ok(0)
        }
        Command::Diff { a, b, json, store } => {
            let diffs = if Path::new(&a).is_file() && Path::new(&b).is_file() {
                let (pa, _) = load(Path::new(&a), &registry)?;
                let (pb, _) = load(Path::new(&b), &registry)?;
                crate::lineage::diff_pipelines(&pa, &pb)
            } else {
                let store = open_store(&store, None)?;
                runtime()?.block_on(async {
                    let runs = store.runs().await?;
                    let find = |id: &str| find_run(&runs, id);
                    // Two artifacts (key or digest prefixes) rather than two runs.
                    let is_run = |id: &str| runs.iter().any(|r| r.run_id.starts_with(id));
                    let is_hex =
                        |id: &str| id.len() >= 4 && id.chars().all(|c| c.is_ascii_hexdigit());
                    if !is_run(&a) && !is_run(&b) && is_hex(&a) && is_hex(&b) {
                        let (_, ma) = by_prefix(store.clone(), &a).await?;
                        let (_, mb) = by_prefix(store.clone(), &b).await?;
                        let change = if ma.key == mb.key { "same" } else { "changed" };
                        let details = if ma.key == mb.key {
                            Vec::new()
                        } else {
                            crate::lineage::manifest_changes(&ma, &mb)
                        };
                        let id = format!("{} -> {}", ma.lineage.stage_id, mb.lineage.stage_id);
                        return Ok(vec![crate::lineage::StageDiff {
                            id,
                            change,
                            details,
                        }]);
                    }
                    let (ra, rb) = (find(&a)?, find(&b)?);
                    Ok::<_, Failure>(crate::lineage::diff_runs(&store, &ra, &rb).await?)
                })?
            };
            if json {
                out(&serde_json::json!({ "stages": diffs }).to_string());
            } else {
                // Colour only on a terminal, and never when NO_COLOR is set (no-color.org).
                let colour =
                    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none();
                out(crate::lineage::render_diff(&diffs, colour).trim_end());
            }
            Ok(0)
        }
        Command::Report {
            run,
            output,
            against,
            store,
        } => {
            let store = open_store(&store, None)?;
            let html = runtime()?.block_on(async {
                let runs = store.runs().await?;
                let record = find_run(&runs, &run)?;
                let stages = crate::html::gather(&store, &record).await?;
                let other = match &against {
                    Some(a) => {
                        let r = find_run(&runs, a)?;
                        let s = crate::html::gather(&store, &r).await?;
                        Some((r, s))
                    }
                    None => None,
                };
                let against = other
                    .as_ref()
                    .map(|(run, stages)| crate::html::Against { run, stages });
                Ok::<_, Failure>(crate::html::render(&record, &stages, against.as_ref()))
            })?;
            std::fs::write(&output, html)
                .map_err(|e| Failure::from(CliError::Write(output.display().to_string(), e)))?;
            eprintln!("wrote {}", output.display());
            Ok(0)
        }
        Command::Runs { json, store } => {
            let store = open_store(&store, None)?;
            let runs = runtime()?.block_on(store.runs())?;
            if json {
                out(&serde_json::to_string(&runs).expect("serializable"));
            } else {
                for r in &runs {
                    let count = |st: Status| r.stages.iter().filter(|s| s.status == st).count();
                    out(&format!(
                        "{}  {:<16} ran {:>3}  cached {:>3}  failed {:>3}  {:>8.2}s",
                        r.run_id,
                        r.pipeline,
                        count(Status::Ran) + count(Status::Resumed),
                        count(Status::Cached),
                        count(Status::Failed),
                        r.seconds
                    ));
                }
            }
            Ok(0)
        }
        Command::Verify { json, store } => {
            let store = open_store(&store, None)?;
            let (checked, bad) = runtime()?.block_on(async {
                let mut checked = 0usize;
                let mut bad = Vec::new();
                for k in store.keys().await? {
                    let Some(m) = store.manifest(&k).await? else { continue };
                    for f in &m.files {
                        checked += 1;
                        // Read through, a part at a time, into nothing: each part and the
                        // whole checked, no file held in memory.
                        if let Err(e) = store.get_blob_into(&f.digest, &mut std::io::sink()).await {
                            // What is wrong with it: bytes that hash to another digest, no
                            // bytes at all (a partial copy of a store), or a failed read.
                            let problem = match e {
                                crate::store::StoreError::Corrupt { .. } => "corrupt",
                                crate::store::StoreError::Missing { .. } => "missing",
                                _ => "unreadable",
                            };
                            bad.push(serde_json::json!({"key": k, "stage": m.lineage.stage_id, "path": f.path, "problem": problem, "error": e.to_string()}));
                        }
                    }
                }
                Ok::<_, crate::store::StoreError>((checked, bad))
            })?;
            if json {
                out(&serde_json::json!({"checked": checked, "corrupt": bad}).to_string());
            } else {
                for b in &bad {
                    out(&format!(
                        "{:<10} {}  {}  {}",
                        b["problem"].as_str().unwrap_or_default(),
                        b["key"].as_str().unwrap_or_default(),
                        b["stage"].as_str().unwrap_or_default(),
                        b["path"].as_str().unwrap_or_default()
                    ));
                }
                let count = |p: &str| bad.iter().filter(|b| b["problem"] == p).count();
                eprintln!(
                    "checked {checked} files: {} corrupt, {} missing, {} unreadable",
                    count("corrupt"),
                    count("missing"),
                    count("unreadable")
                );
            }
            Ok(u8::from(!bad.is_empty()))
        }
        Command::Copy {
            from,
            to,
            stage,
            max_file_bytes,
            json,
            allow_overwriting_store,
        } => {
            let (src, dst) = (Store::open(&from)?, Store::open(&to)?);
            let filter = crate::store::copy::Filter {
                stages: stage,
                max_file_bytes: max_file_bytes.map(|b| b.ceil() as u64),
            };
            // Each artifact as it lands (stderr; a long copy to S3 shows its progress).
            let say = |stage: &str| {
                if !json {
                    eprintln!("copied   {stage}");
                }
            };
            let r = runtime()?.block_on(crate::store::copy::copy(
                &src,
                &dst,
                &filter,
                allow_overwriting_store,
                &say,
            ))?;
            if json {
                out(&serde_json::to_string(&r).expect("serializable"));
            } else {
                let left_out = |what: &[String], why: &str| {
                    if !what.is_empty() {
                        eprintln!("left out ({why}): {}", what.join(", "));
                    }
                };
                left_out(&r.too_large, "a file over --max-file-bytes");
                left_out(
                    &r.incomplete,
                    "a blob missing in the source: `dflash verify` it",
                );
                eprintln!(
                    "copied {} artifacts ({} already there), {} finished shards, {} run records: {} blobs, {} bytes",
                    r.copied.len(),
                    r.already_there,
                    r.shards,
                    r.run_records,
                    r.blobs,
                    r.bytes
                );
            }
            Ok(0)
        }
        Command::Kinds => {
            for name in registry.names() {
                let k = registry.get(name).expect("listed");
                out(&format!("{name} (v{}): {}", k.version(), k.summary()));
                for p in k.params() {
                    let mut req = if p.required {
                        "required".to_owned()
                    } else {
                        p.default
                            .as_ref()
                            .map_or_else(|| "optional".to_owned(), |d| format!("default {d}"))
                    };
                    if let Some(b) = &p.bounds {
                        req = format!("{req}; {}", b.describe());
                    }
                    if !p.keyed {
                        req.push_str("; operational, not in the key");
                    }
                    if p.content {
                        req.push_str(
                            "; a local file or folder: its content, not its path, in the key",
                        );
                    }
                    out(&format!(
                        "  {:<10} {} ({req}): {}",
                        p.name,
                        p.ty.describe(),
                        p.help
                    ));
                }
            }
            Ok(0)
        }
    }
}

/// Find the manifest a reference names.
async fn resolve(
    reference: &str,
    pipeline: Option<&Path>,
    arg: &StoreArg,
    registry: &Registry,
) -> Result<(Store, Manifest), Failure> {
    if let Some(path) = pipeline {
        let (p, g) = load(path, registry)?;
        let store = open_store(arg, Some(&p))?;
        if p.stages.iter().any(|s| s.id == reference) {
            let hashes = HashCache::load(&work_dir(), &cwd());
            hashes.save();
            let plan = crate::plan::plan(&p, &g, registry, &store, &hashes).await?;
            let line = plan.iter().find(|s| s.id == reference).expect("present");
            let m = match line.key {
                Some(k) if line.state == crate::plan::State::Done => store.manifest(&k).await?,
                _ => None,
            };
            return m
                .map(|m| (store, m))
                .ok_or_else(|| CliError::NotDone(reference.to_owned()).into());
        }
        let made: Vec<String> = p
            .stages
            .iter()
            .filter(|s| s.matrix_of.as_deref() == Some(reference))
            .map(|s| format!("`{}`", s.id))
            .collect();
        if !made.is_empty() {
            return Err(CliError::Matrix(reference.to_owned(), made.len(), made.join(", ")).into());
        }
        return by_prefix(store, reference).await;
    }
    by_prefix(open_store(arg, None)?, reference).await
}

async fn by_prefix(store: Store, reference: &str) -> Result<(Store, Manifest), Failure> {
    let r = reference.to_ascii_lowercase();
    if r.len() < 4 || !r.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(CliError::NoMatch(reference.to_owned()).into());
    }
    let keys: Vec<Key> = store.keys().await?;
    let by_key: Vec<&Key> = keys
        .iter()
        .filter(|k| k.to_string().starts_with(&r))
        .collect();
    if by_key.len() > 1 {
        return Err(CliError::Ambiguous(reference.to_owned(), by_key.len()).into());
    }
    if let Some(k) = by_key.first() {
        let m = store
            .manifest(k)
            .await?
            .ok_or_else(|| CliError::NoMatch(reference.to_owned()))?;
        return Ok((store, m));
    }
    let mut found = Vec::new();
    for k in &keys {
        if let Some(m) = store.manifest(k).await?
            && m.digest.to_hex().starts_with(&r)
        {
            found.push(m);
        }
    }
    match found.len() {
        0 => Err(CliError::NoMatch(reference.to_owned()).into()),
        1 => Ok((store, found.remove(0))),
        n => Err(CliError::Ambiguous(reference.to_owned(), n).into()),
    }
}
