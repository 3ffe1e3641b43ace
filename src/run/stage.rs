//! One stage task: key -> cached? -> materialise inputs -> run -> upload -> commit.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use bytes::Bytes;
use dflash_stage_api::{Digest, Input, Progress, ShardSink, StageContext, StageError};
use tokio::runtime::Handle;

use super::{Event, Outcome, Shared};
use crate::key::{Key, artifact_digest};
use crate::store::manifest::{Lineage, LineageInput, MANIFEST_SCHEMA};
use crate::store::{FileEntry, Manifest, ShardRecord, Status, Store, StoreError};

fn failed(key: Option<Key>, e: StageError) -> Outcome {
    Outcome {
        status: Status::Failed,
        key,
        digest: None,
        error: Some(e),
        summary: None,
        seconds: None,
        accelerator: None,
    }
}

fn cached(key: Key, digest: Digest) -> Outcome {
    Outcome {
        status: Status::Cached,
        key: Some(key),
        digest: Some(digest),
        error: None,
        summary: None,
        seconds: None,
        accelerator: None,
    }
}

fn store_err(e: &StoreError) -> StageError {
    StageError::new(e.to_string())
}

pub(crate) async fn run_stage(
    shared: &Shared,
    i: usize,
    upstream: Vec<Digest>,
    upstream_keys: Vec<Key>,
) -> Outcome {
    let spec = &shared.pipeline.stages[i];
    let fp = match super::fingerprint(spec, &shared.registry, &upstream, &shared.hashes) {
        Ok(fp) => fp,
        Err(e) => return failed(None, e),
    };
    let key = fp.key();
    // A stage of the same key running now finishes first: then this one is cached.
    let working = shared.working_on(key);
    let _working = working.lock().await;
    match shared.store.manifest(&key).await {
        Ok(Some(m)) => return cached(key, m.digest),
        Ok(None) => {}
        Err(e) => return failed(Some(key), store_err(&e)),
    }
    // A stage that occupies the accelerator waits for the one running there to finish: two
    // trainings never share a GPU's memory. It is not "started" until it has it.
    let kind = shared.registry.get(&spec.kind).expect("validated").clone();
    let accelerator = if kind.uses_accelerator(&spec.params) {
        match shared.accelerator.clone().acquire_owned().await {
            Ok(permit) => Some(permit),
            Err(_) => return failed(Some(key), StageError::new("the run is closing")),
        }
    } else {
        None
    };
    if shared.cancel.is_cancelled() {
        return failed(Some(key), StageError::cancelled());
    }
    let _ = shared.events.send(Event::Started { stage: i });
    let began = std::time::Instant::now();
    let mut outcome = run_started(shared, i, key, fp, kind, upstream, upstream_keys).await;
    // The stage's own time, not the wait for the accelerator before it; the permit goes back
    // once the run has said the stage finished, so the next one's "started" follows it.
    outcome.seconds = Some(began.elapsed().as_secs_f64());
    outcome.accelerator = accelerator;
    outcome
}

/// The stage once it may start: materialise its inputs, run it, upload, commit.
async fn run_started(
    shared: &Shared,
    i: usize,
    key: Key,
    fp: crate::key::Fingerprint,
    kind: std::sync::Arc<dyn dflash_stage_api::StageKind>,
    upstream: Vec<Digest>,
    upstream_keys: Vec<Key>,
) -> Outcome {
    let spec = &shared.pipeline.stages[i];
    let earlier = match shared.store.shards(&key).await {
        Ok(s) => s,
        Err(e) => return failed(Some(key), store_err(&e)),
    };
    let resumed = !earlier.is_empty();

    let work =
        shared
            .opts
            .work_dir
            .join("work")
            .join(format!("{}-{}", key.0.short(16), shared.run_id));
    let log_dir = shared.opts.work_dir.join("logs").join(&shared.run_id);
    let log_path = log_dir.join(format!("{}.log", spec.id));
    let out_dir = work.join("out");
    let scratch = work.join("scratch");
    // Per key, not per run: what a crashed attempt left here is what the next one resumes from.
    let resume = shared.opts.work_dir.join("resume").join(key.0.short(16));
    let result = async {
        for d in [&out_dir, &scratch, &log_dir, &resume] {
            std::fs::create_dir_all(d)
                .map_err(|e| StageError::new(format!("cannot create `{}`: {e}", d.display())))?;
        }
        std::fs::write(&log_path, b"").map_err(StageError::from)?;
        let mut inputs = Vec::new();
        for ((inp, digest), ukey) in spec.inputs.iter().zip(&upstream).zip(&upstream_keys) {
            let dir = work.join("in").join(&inp.name);
            materialise(&shared.store, ukey, &dir).await?;
            inputs.push(Input {
                name: inp.name.clone(),
                stage_id: inp.stage.clone(),
                dir,
                digest: *digest,
            });
        }
        let started = std::time::SystemTime::now();
        let t0 = std::time::Instant::now();
        let sink = Shards {
            store: shared.store.clone(),
            key,
            handle: Handle::current(),
            done: earlier.iter().map(|s| s.name.clone()).collect(),
            committed: Mutex::new(earlier),
        };
        let progress = Reporter {
            stage: i,
            events: shared.events.clone(),
        };
        let kind = kind.clone();
        let pins = fp.pins.clone();
        let (params, cwd, cancel) = (
            spec.params.clone(),
            shared.opts.cwd.clone(),
            shared.cancel.clone(),
        );
        let (out2, scratch2, resume2, log2, id) = (
            out_dir.clone(),
            scratch.clone(),
            resume.clone(),
            log_path.clone(),
            spec.id.clone(),
        );
        let (output, sink) = tokio::task::spawn_blocking(move || {
            let ctx = StageContext {
                stage_id: &id,
                params: &params,
                pins: &pins,
                inputs: &inputs,
                out_dir: &out2,
                scratch_dir: &scratch2,
                resume_dir: &resume2,
                log_path: &log2,
                cwd: &cwd,
                shards: &sink,
                progress: &progress,
                cancel: &cancel,
            };
            (kind.run(&ctx), sink)
        })
        .await
        .map_err(|e| StageError::new(format!("stage panicked: {e}")))?;
        let output = output.map_err(|e| {
            if e.log.is_none() && !e.cancelled {
                e.with_log(&log_path)
            } else {
                e
            }
        })?;
        if shared.cancel.is_cancelled() {
            return Err(StageError::cancelled());
        }
        // Files: every committed shard's, then the output folder's.
        let mut files: Vec<FileEntry> = sink
            .committed
            .into_inner()
            .expect("not poisoned")
            .into_iter()
            .flat_map(|s| s.files)
            .collect();
        for f in upload_dir(&shared.store, &out_dir).await? {
            if files.iter().any(|g| g.path == f.path) {
                return Err(StageError::new(format!(
                    "`{}` is written both by a shard and to the output folder",
                    f.path
                )));
            }
            files.push(f);
        }
        files.sort_by(|a, b| a.path.cmp(&b.path));
        let log_bytes = std::fs::read(&log_path).unwrap_or_default();
        let log = shared
            .store
            .put_blob(Bytes::from(log_bytes))
            .await
            .map_err(|e| store_err(&e))?;
        let listed: Vec<(String, Digest, u64)> = files
            .iter()
            .map(|f| (f.path.clone(), f.digest, f.size))
            .collect();
        let manifest = Manifest {
            schema: MANIFEST_SCHEMA,
            key,
            digest: artifact_digest(&listed),
            fingerprint: fp,
            files,
            stats: output.stats,
            lineage: Lineage {
                stage_id: spec.id.clone(),
                pipeline: shared.pipeline.name.clone(),
                inputs: spec
                    .inputs
                    .iter()
                    .zip(&upstream)
                    .zip(&upstream_keys)
                    .map(|((inp, d), k)| LineageInput {
                        name: inp.name.clone(),
                        stage_id: inp.stage.clone(),
                        key: *k,
                        digest: *d,
                    })
                    .collect(),
                tool_version: env!("CARGO_PKG_VERSION").to_owned(),
                started: humantime::format_rfc3339_millis(started).to_string(),
                seconds: t0.elapsed().as_secs_f64(),
                host: gethostname::gethostname().to_string_lossy().into_owned(),
                run_id: shared.run_id.clone(),
                log: Some(FileEntry {
                    path: format!("{}.log", spec.id),
                    ..log
                }),
            },
        };
        // Crash-test hook: die the hardest way right before the commit, to prove that a crash
        // between uploads and manifest leaves nothing visible as done.
        if std::env::var_os("DFLASH_FAILPOINT").is_some_and(|v| v == "before-manifest") {
            std::process::abort();
        }
        // Create-only: if a racing run committed first, adopt its manifest.
        let committed = shared
            .store
            .commit(&manifest)
            .await
            .map_err(|e| store_err(&e))?;
        Ok::<(Digest, Option<String>), StageError>((committed.digest, output.summary))
    }
    .await;
    let _ = std::fs::remove_dir_all(&work);
    if result.is_ok() {
        let _ = std::fs::remove_dir_all(&resume);
    }
    match result {
        Ok((digest, summary)) => Outcome {
            status: if resumed {
                Status::Resumed
            } else {
                Status::Ran
            },
            key: Some(key),
            digest: Some(digest),
            error: None,
            summary,
            seconds: None,
            accelerator: None,
        },
        Err(e) => failed(Some(key), e),
    }
}

/// Copy an upstream artifact's files into `dir`, checking every blob against its digest.
async fn materialise(store: &Store, key: &Key, dir: &Path) -> Result<(), StageError> {
    let manifest = store
        .manifest(key)
        .await
        .map_err(|e| store_err(&e))?
        .ok_or_else(|| StageError::new(format!("upstream artifact {key} has no manifest")))?;
    std::fs::create_dir_all(dir)?;
    for f in &manifest.files {
        let target = safe_join(dir, &f.path)?;
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        // A part at a time: an upstream file of any size holds one part in memory.
        let mut file = std::io::BufWriter::new(std::fs::File::create(&target)?);
        store
            .get_blob_into(&f.digest, &mut file)
            .await
            .map_err(|e| store_err(&e))?;
        std::io::Write::flush(&mut file)?;
    }
    Ok(())
}

/// Join an artifact-relative path under `dir`, refusing anything that would escape it.
pub(crate) fn safe_join(dir: &Path, rel: &str) -> Result<PathBuf, StageError> {
    let p = Path::new(rel);
    if p.components()
        .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(StageError::new(format!(
            "artifact path `{rel}` is not a plain relative path"
        )));
    }
    Ok(dir.join(p))
}

/// Upload every file under `dir` as a blob; returns entries with paths relative to `dir`.
async fn upload_dir(store: &Store, dir: &Path) -> Result<Vec<FileEntry>, StageError> {
    let mut out = Vec::new();
    for entry in walkdir::WalkDir::new(dir).sort_by_file_name() {
        let entry = entry.map_err(|e| StageError::new(e.to_string()))?;
        if entry.file_type().is_dir() {
            continue;
        }
        let rel = entry.path().strip_prefix(dir).expect("under dir");
        let rel = rel
            .to_str()
            .ok_or_else(|| {
                StageError::new(format!("output file name `{}` is not UTF-8", rel.display()))
            })?
            .to_owned();
        if !entry.file_type().is_file() {
            return Err(StageError::new(format!(
                "output `{rel}` is not a regular file (links are not stored)"
            )));
        }
        let blob = store
            .put_file(entry.path())
            .await
            .map_err(|e| store_err(&e))?;
        out.push(FileEntry { path: rel, ..blob });
    }
    Ok(out)
}

struct Shards {
    store: Store,
    key: Key,
    handle: Handle,
    done: Vec<String>,
    committed: Mutex<Vec<ShardRecord>>,
}

impl ShardSink for Shards {
    fn done(&self) -> Vec<String> {
        self.done.clone()
    }

    fn commit(&self, name: &str, dir: &Path) -> Result<(), StageError> {
        if self
            .committed
            .lock()
            .expect("not poisoned")
            .iter()
            .any(|s| s.name == name)
        {
            return Err(StageError::new(format!("shard `{name}` committed twice")));
        }
        let record = self.handle.block_on(async {
            let files = upload_dir(&self.store, dir).await?;
            let record = ShardRecord {
                name: name.to_owned(),
                files,
            };
            // Existed: a racing run finished this shard first; its record is as good as ours.
            self.store
                .put_shard(&self.key, &record)
                .await
                .map_err(|e| store_err(&e))?;
            Ok::<_, StageError>(record)
        })?;
        self.committed.lock().expect("not poisoned").push(record);
        Ok(())
    }

    fn read(&self, name: &str, path: &str) -> Result<Vec<u8>, StageError> {
        let entry = self
            .committed
            .lock()
            .expect("not poisoned")
            .iter()
            .find(|s| s.name == name)
            .and_then(|s| s.files.iter().find(|f| f.path == path).cloned())
            .ok_or_else(|| {
                StageError::new(format!("shard `{name}` has no committed file `{path}`"))
            })?;
        let bytes = self
            .handle
            .block_on(self.store.get_blob(&entry.digest))
            .map_err(|e| store_err(&e))?;
        Ok(bytes.to_vec())
    }
}

struct Reporter {
    stage: usize,
    events: tokio::sync::mpsc::UnboundedSender<Event>,
}

impl Progress for Reporter {
    fn set(&self, done: u64, total: Option<u64>, message: &str) {
        let _ = self.events.send(Event::Progress {
            stage: self.stage,
            done,
            total,
            message: message.to_owned(),
        });
    }
}
