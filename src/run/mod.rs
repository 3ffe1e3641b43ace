//! The executor: runs a pipeline's stages in dependency order, independent ones concurrently.
//!
//! A dispatcher ([`execute`]) owns all state and selects over three event sources: finished
//! stage tasks, progress messages, and Ctrl-C. Each stage task ([`stage::run_stage`]) resolves
//! its key, adopts a committed manifest if there is one, and otherwise materialises its inputs,
//! runs the stage on a blocking thread, uploads its files and commits the manifest last.
//! Events go to a [`Reporter`] (the CLI draws progress bars or prints lines).

mod stage;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use dflash_stage_api::{Cancel, Digest, Pin, Pinner, StageError};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::graph::Graph;
use crate::key::{Fingerprint, FingerprintInput, KEY_SCHEMA, Key};
use crate::kinds::Registry;
use crate::pipeline::{Pipeline, StageSpec};
use crate::store::{RunRecord, StageResult, Status, Store};

/// How to run.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Stages at once.
    pub jobs: usize,
    /// Run only these stages (and what they need); empty: all.
    pub only: Vec<String>,
    /// Run even on a store that failed the create-only probe.
    pub allow_overwriting_store: bool,
    /// Local working folder (logs, scratch, hash cache).
    pub work_dir: PathBuf,
    /// Where relative paths in params resolve.
    pub cwd: PathBuf,
}

/// What the dispatcher tells the reporter.
#[derive(Debug, Clone)]
pub enum Event {
    /// The run began.
    RunStarted {
        /// Its id.
        run_id: String,
    },
    /// A stage started computing (not sent for cached stages).
    Started {
        /// Stage index.
        stage: usize,
    },
    /// A stage reported progress.
    Progress {
        /// Stage index.
        stage: usize,
        /// Units done.
        done: u64,
        /// Units in all, when known.
        total: Option<u64>,
        /// What it is doing.
        message: String,
    },
    /// A stage reached a final status.
    Finished {
        /// Stage index.
        stage: usize,
        /// The result.
        result: StageResult,
        /// Its log, when it failed and has one.
        log: Option<PathBuf>,
    },
    /// A check against an upstream artifact found that a stage cannot run; it fails when it
    /// would have started, and stages that only feed it keep their (cached) work.
    Doomed {
        /// Stage index.
        stage: usize,
        /// Why, one line per problem with `file:line:col`.
        error: String,
    },
    /// Ctrl-C was pressed; running stages are being stopped.
    Cancelling,
}

/// Receives events as the run goes.
pub trait Reporter: Send {
    /// One event.
    fn event(&mut self, pipeline: &Pipeline, event: &Event);
}

/// The run could not start or was interrupted.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum RunError {
    /// A store problem before or after the stages.
    #[error(transparent)]
    #[diagnostic(transparent)]
    Store(#[from] crate::store::StoreError),
    /// An `--only` name that is not a stage.
    #[error("`--only {0}`: no stage has that id")]
    #[diagnostic(
        code(dflash::run::unknown_stage),
        help("`dflash plan PIPELINE` lists the stage ids")
    )]
    UnknownStage(String),
    /// The local working folder could not be created.
    #[error("cannot create working folder `{0}`: {1}")]
    #[diagnostic(code(dflash::run::work_dir))]
    WorkDir(String, std::io::Error),
}

/// The result of one stage task.
pub(crate) struct Outcome {
    pub status: Status,
    pub key: Option<Key>,
    pub digest: Option<Digest>,
    pub error: Option<StageError>,
    pub summary: Option<String>,
    /// Seconds from the moment the stage started (it had the accelerator, where it needs
    /// one); `None` for a stage that never started (cached, refused), timed from its task's
    /// start.
    pub seconds: Option<f64>,
    /// The accelerator, held until the run has reported this stage finished.
    pub accelerator: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// Build a stage's fingerprint from its upstream digests (in input order) and its pins.
pub fn fingerprint(
    spec: &StageSpec,
    registry: &Registry,
    upstream: &[Digest],
    pinner: &dyn Pinner,
) -> Result<Fingerprint, StageError> {
    let kind = registry
        .get(&spec.kind)
        .expect("validated pipelines name known kinds");
    // Pinning may block on the network (resolving a Hub revision): leave the async context
    // for it, so a stage's blocking client can't stall or break the runtime's workers.
    let pin = || kind.pin(&spec.params, pinner);
    let pins: Vec<Pin> = match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(pin)?
        }
        _ => pin()?,
    };
    // Operational params (servers, limits, retries, shard sizes) say how the work is done, not
    // what it produces: they stay out of the key, so changing one resumes what is saved.
    // A content path (a model file or folder) enters by its pinned bytes, not its name: a
    // renamed copy keeps the key. Only when the kind pinned it, so a value is never dropped
    // without what it stands for.
    let mut params = spec.params.clone();
    if let Some(map) = params.as_object_mut() {
        for p in kind.params() {
            if !p.keyed || (p.content && pins.iter().any(|pin| pin.stands_for(p.name))) {
                map.remove(p.name);
            }
        }
    }
    Ok(Fingerprint {
        schema: KEY_SCHEMA,
        kind: spec.kind.clone(),
        kind_version: kind.version(),
        params,
        inputs: spec
            .inputs
            .iter()
            .zip(upstream)
            .map(|(i, d)| FingerprintInput {
                name: i.name.clone(),
                digest: *d,
            })
            .collect(),
        pins,
    })
}

/// A new time-sortable run id, e.g. `20261202T141019.123Z-3f9a1c`.
pub fn new_run_id() -> String {
    let now = std::time::SystemTime::now();
    let stamp = humantime::format_rfc3339_millis(now)
        .to_string()
        .replace(['-', ':'], "");
    let nanos = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let salt = Digest::of(format!("{nanos}-{}", std::process::id()).as_bytes()).short(6);
    format!("{stamp}-{salt}")
}

/// Stages to run: the `--only` ones and everything upstream of them.
fn selection(pipeline: &Pipeline, graph: &Graph, only: &[String]) -> Result<Vec<bool>, RunError> {
    if only.is_empty() {
        return Ok(vec![true; pipeline.stages.len()]);
    }
    let mut selected = vec![false; pipeline.stages.len()];
    let mut stack = Vec::new();
    for name in &crate::pipeline::expand_matrix_names(&pipeline.stages, only) {
        let i = pipeline
            .stages
            .iter()
            .position(|s| &s.id == name)
            .ok_or_else(|| RunError::UnknownStage(name.clone()))?;
        stack.push(i);
    }
    while let Some(i) = stack.pop() {
        if !std::mem::replace(&mut selected[i], true) {
            stack.extend(graph.upstream(i));
        }
    }
    Ok(selected)
}

/// Shared by every stage task.
pub(crate) struct Shared {
    pub pipeline: Arc<Pipeline>,
    pub registry: Registry,
    pub store: Store,
    pub opts: RunOptions,
    pub run_id: String,
    pub hashes: crate::hashcache::HashCache,
    pub cancel: Cancel,
    pub events: mpsc::UnboundedSender<Event>,
    /// One permit: the stage running on the accelerator now
    /// ([`dflash_stage_api::StageKind::uses_accelerator`]).
    pub accelerator: Arc<tokio::sync::Semaphore>,
    /// One lock per key being worked on: stages of the same key (a sweep's variant equal to a
    /// stage beside it) run one after the other, so the second finds the first's artifact.
    pub working: std::sync::Mutex<HashMap<Key, Arc<tokio::sync::Mutex<()>>>>,
}

impl Shared {
    /// The lock of stages computing `key`.
    pub(crate) fn working_on(&self, key: Key) -> Arc<tokio::sync::Mutex<()>> {
        let mut working = self
            .working
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        working.entry(key).or_default().clone()
    }
}

/// Run the pipeline; returns the run record (also stored) whatever the stages' outcomes.
pub async fn execute(
    pipeline: Arc<Pipeline>,
    graph: &Graph,
    registry: Registry,
    store: Store,
    opts: RunOptions,
    reporter: &mut dyn Reporter,
) -> Result<RunRecord, RunError> {
    let selected = selection(&pipeline, graph, &opts.only)?;
    std::fs::create_dir_all(&opts.work_dir)
        .map_err(|e| RunError::WorkDir(opts.work_dir.display().to_string(), e))?;
    let run_id = new_run_id();
    let started = std::time::SystemTime::now();
    let t0 = Instant::now();
    store
        .begin_run(
            &run_id,
            &serde_json::json!({
                "run_id": run_id,
                "pipeline": pipeline.name,
                "pipeline_digest": pipeline.digest,
                "started": humantime::format_rfc3339_millis(started).to_string(),
                "tool_version": env!("CARGO_PKG_VERSION"),
            }),
            opts.allow_overwriting_store,
        )
        .await?;
    reporter.event(
        &pipeline,
        &Event::RunStarted {
            run_id: run_id.clone(),
        },
    );

    let (tx, mut rx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared {
        hashes: crate::hashcache::HashCache::load(&opts.work_dir, &opts.cwd),
        pipeline: pipeline.clone(),
        registry,
        store: store.clone(),
        opts,
        run_id: run_id.clone(),
        cancel: Cancel::new(),
        events: tx,
        accelerator: Arc::new(tokio::sync::Semaphore::new(1)),
        working: std::sync::Mutex::default(),
    });

    let n = pipeline.stages.len();
    let mut results: Vec<Option<StageResult>> = vec![None; n];
    let mut digests: Vec<Option<Digest>> = vec![None; n];
    let mut keys: Vec<Option<Key>> = vec![None; n];
    let mut waiting: Vec<usize> = (0..n).map(|i| graph.upstream(i).count()).collect();
    let mut ready: std::collections::VecDeque<usize> = graph
        .order
        .iter()
        .copied()
        .filter(|&i| waiting[i] == 0)
        .collect();
    // Stages found unable to run by a check against an upstream artifact: the failure, kept
    // until the stage would have started.
    let mut doomed: Vec<Option<StageResult>> = vec![None; n];
    let mut tasks: JoinSet<(usize, f64, Outcome)> = JoinSet::new();
    let mut cancelled = false;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);

    let finish = |i: usize,
                  result: StageResult,
                  log: Option<PathBuf>,
                  results: &mut Vec<Option<StageResult>>,
                  reporter: &mut dyn Reporter| {
        reporter.event(
            &pipeline,
            &Event::Finished {
                stage: i,
                result: result.clone(),
                log,
            },
        );
        results[i] = Some(result);
    };

    loop {
        while !cancelled && tasks.len() < shared.opts.jobs.max(1) {
            let Some(i) = ready.pop_front() else { break };
            let spec = &pipeline.stages[i];
            if !selected[i] {
                finish(
                    i,
                    skipped(spec, Some(NOT_ASKED)),
                    None,
                    &mut results,
                    reporter,
                );
                continue;
            }
            if let Some(result) = doomed[i].take() {
                finish(i, result, None, &mut results, reporter);
                continue;
            }
            let upstream: Vec<Digest> = graph.inputs[i]
                .iter()
                .map(|&u| digests[u].expect("upstream finished before downstream is ready"))
                .collect();
            let upstream_keys: Vec<Key> = graph.inputs[i]
                .iter()
                .map(|&u| keys[u].expect("upstream finished"))
                .collect();
            let shared = shared.clone();
            tasks.spawn(async move {
                let t = Instant::now();
                let outcome = stage::run_stage(&shared, i, upstream, upstream_keys).await;
                (i, t.elapsed().as_secs_f64(), outcome)
            });
        }
        if tasks.is_empty() {
            break;
        }
        tokio::select! {
            Some(joined) = tasks.join_next() => {
                let (i, waited_and_ran, mut outcome) = match joined {
                    Ok(v) => v,
                    Err(e) => std::panic::resume_unwind(e.into_panic()),
                };
                let seconds = outcome.seconds.unwrap_or(waited_and_ran);
                let accelerator = outcome.accelerator.take();
                let spec = &pipeline.stages[i];
                let log = outcome.error.as_ref().and_then(|e| e.log.clone());
                let result = StageResult {
                    id: spec.id.clone(),
                    kind: spec.kind.clone(),
                    key: outcome.key,
                    status: outcome.status,
                    digest: outcome.digest,
                    seconds,
                    error: outcome.error.as_ref().map(|e| e.message.clone()),
                    hint: outcome.error.as_ref().and_then(|e| e.help.clone()),
                    summary: outcome.summary.clone(),
                };
                keys[i] = outcome.key;
                let ok = matches!(outcome.status, Status::Ran | Status::Cached | Status::Resumed);
                finish(i, result, log, &mut results, reporter);
                drop(accelerator);
                if ok {
                    digests[i] = outcome.digest;
                    if let Some(key) = outcome.key {
                        for d in graph.downstream(i) {
                            if selected[d] && doomed[d].is_none() {
                                doomed[d] = check_against(&shared, d, i, &key).await;
                                if let Some(r) = &doomed[d] {
                                    // Said now, not when the stage would have started.
                                    reporter.event(&pipeline, &Event::Doomed {
                                        stage: d,
                                        error: r.error.clone().unwrap_or_default(),
                                    });
                                }
                            }
                        }
                    }
                    for d in graph.downstream(i) {
                        waiting[d] -= 1;
                        if waiting[d] == 0 {
                            ready.push_back(d);
                        }
                    }
                }
            }
            Some(ev) = rx.recv() => reporter.event(&pipeline, &ev),
            _ = &mut ctrl_c, if !cancelled => {
                cancelled = true;
                shared.cancel.cancel();
                reporter.event(&pipeline, &Event::Cancelling);
            }
        }
    }
    while let Ok(ev) = rx.try_recv() {
        reporter.event(&pipeline, &ev);
    }
    shared.hashes.save();

    // Whatever never became ready was refused by a check against upstream data (that reason
    // stays its record), blocked by a failure, or by cancellation.
    let mut stages = Vec::with_capacity(n);
    for (i, r) in results.into_iter().enumerate() {
        let r = r.unwrap_or_else(|| {
            let spec = &pipeline.stages[i];
            // Downstream of a stage `--only` left out is left out too (the selection is closed
            // upstream), and never became ready: say so, not that something failed.
            let why = if !selected[i] {
                NOT_ASKED
            } else if cancelled {
                "cancelled"
            } else {
                "an upstream stage failed"
            };
            let result = doomed[i].take().unwrap_or_else(|| skipped(spec, Some(why)));
            reporter.event(
                &pipeline,
                &Event::Finished {
                    stage: i,
                    result: result.clone(),
                    log: None,
                },
            );
            result
        });
        stages.push(r);
    }
    let record = RunRecord {
        run_id,
        pipeline: pipeline.name.clone(),
        pipeline_path: pipeline.path.display().to_string(),
        pipeline_digest: pipeline.digest,
        started: humantime::format_rfc3339_millis(started).to_string(),
        seconds: t0.elapsed().as_secs_f64(),
        stages,
    };
    store.end_run(&record).await?;
    Ok(record)
}

/// Check stage `d`'s params against the artifact upstream stage `u` just committed under `key`
/// ([`dflash_stage_api::StageKind::check_input`]); the failed result `d` will have, if any.
/// A file that can't be read is left to the stage itself, which reads it again.
async fn check_against(shared: &Shared, d: usize, u: usize, key: &Key) -> Option<StageResult> {
    let spec = &shared.pipeline.stages[d];
    let kind = shared.registry.get(&spec.kind)?;
    let wanted = kind.input_files();
    if wanted.is_empty() {
        return None;
    }
    let upstream = &shared.pipeline.stages[u];
    let manifest = shared.store.manifest(key).await.ok()??;
    let mut files = std::collections::BTreeMap::new();
    for f in manifest
        .files
        .iter()
        .filter(|f| wanted.contains(&f.path.as_str()))
    {
        if let Ok(bytes) = shared.store.get_blob(&f.digest).await {
            files.insert(f.path.clone(), bytes.to_vec());
        }
    }
    let mut issues = Vec::new();
    for input in spec.inputs.iter().filter(|i| i.stage == upstream.id) {
        let output = dflash_stage_api::UpstreamOutput {
            name: &input.name,
            stage_id: &upstream.id,
            files: files.clone(),
        };
        issues.extend(kind.check_input(&spec.params, &shared.opts.cwd, &output));
    }
    let first = issues.first()?;
    let lines: Vec<String> = issues
        .iter()
        .map(|issue| shared.pipeline.issue_line(&spec.id, issue, &upstream.id))
        .collect();
    Some(StageResult {
        id: spec.id.clone(),
        kind: spec.kind.clone(),
        key: None,
        status: Status::Failed,
        digest: None,
        seconds: 0.0,
        error: Some(lines.join("\n")),
        hint: first.help.clone(),
        summary: None,
    })
}

/// The result of a stage that did not run.
/// Why a stage `--only` did not select was skipped.
const NOT_ASKED: &str = "not asked for (`--only` runs the stages it names and what they need)";

fn skipped(spec: &StageSpec, why: Option<&str>) -> StageResult {
    StageResult {
        id: spec.id.clone(),
        kind: spec.kind.clone(),
        key: None,
        status: Status::Skipped,
        digest: None,
        seconds: 0.0,
        error: why.map(str::to_owned),
        hint: None,
        summary: None,
    }
}

/// Join an artifact path under an export folder, refusing paths that would escape it.
pub fn safe_join_for_export(dir: &std::path::Path, rel: &str) -> Result<PathBuf, StageError> {
    stage::safe_join(dir, rel)
}
