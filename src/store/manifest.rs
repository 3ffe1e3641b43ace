//! What the store holds besides blobs: the [`Manifest`] that commits an artifact, the
//! [`ShardRecord`] of partial progress, and the [`RunRecord`] of each run.

use dflash_stage_api::Digest;
use serde::{Deserialize, Serialize};

use crate::key::{Fingerprint, Key};

/// Version of the manifest format.
pub const MANIFEST_SCHEMA: u32 = 1;

/// One file of an artifact.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Path inside the artifact, `/`-separated.
    pub path: String,
    /// blake3 of the bytes; the blob's name.
    pub digest: Digest,
    /// Size in bytes.
    pub size: u64,
}

/// The commit record of one artifact. Written last and create-only: no manifest, not done.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_SCHEMA`].
    pub schema: u32,
    /// The key this artifact is stored under.
    pub key: Key,
    /// Content digest of the file list (what dependants' keys use).
    pub digest: Digest,
    /// Everything that went into the key.
    pub fingerprint: Fingerprint,
    /// The files.
    pub files: Vec<FileEntry>,
    /// Data summaries from the stage.
    pub stats: serde_json::Map<String, serde_json::Value>,
    /// How it was produced.
    pub lineage: Lineage,
}

/// Provenance that does not enter the key.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Lineage {
    /// The stage id and pipeline name it was produced for.
    pub stage_id: String,
    /// Pipeline name.
    pub pipeline: String,
    /// Upstream artifacts: name, key, digest.
    pub inputs: Vec<LineageInput>,
    /// dflash version.
    pub tool_version: String,
    /// RFC 3339 start time.
    pub started: String,
    /// Seconds the stage took.
    pub seconds: f64,
    /// The machine's host name.
    pub host: String,
    /// The run that produced it.
    pub run_id: String,
    /// The stage's log, stored as a blob (not part of the artifact's digest).
    pub log: Option<FileEntry>,
}

/// One upstream artifact in lineage.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LineageInput {
    /// The name the stage saw it by.
    pub name: String,
    /// The upstream stage id.
    pub stage_id: String,
    /// Its key.
    pub key: Key,
    /// Its content digest.
    pub digest: Digest,
}

/// One committed shard of partial progress under a key.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ShardRecord {
    /// Shard name.
    pub name: String,
    /// Its files.
    pub files: Vec<FileEntry>,
}

/// Status of a stage in a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Computed in this run.
    Ran,
    /// Found in the store.
    Cached,
    /// Computed in this run, reusing shards from an earlier attempt.
    Resumed,
    /// Failed.
    Failed,
    /// Not run (not selected, an upstream failed, or the run was cancelled).
    Skipped,
}

impl Status {
    /// The word used in output.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ran => "ran",
            Self::Cached => "cached",
            Self::Resumed => "resumed",
            Self::Failed => "failed",
            Self::Skipped => "skipped",
        }
    }
}

/// One stage's line in a run record (and in `run --json`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StageResult {
    /// Stage id.
    pub id: String,
    /// Stage kind.
    pub kind: String,
    /// Its key, when it could be computed.
    pub key: Option<Key>,
    /// What happened.
    pub status: Status,
    /// Output digest, when done.
    pub digest: Option<Digest>,
    /// Wall seconds spent on it in this run.
    pub seconds: f64,
    /// The error, when failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// What to do about the error, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
    /// The stage's terminal report, for this run's output only (not stored in run records).
    #[serde(skip)]
    pub summary: Option<String>,
}

/// The record of one run, written once when the run ends.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunRecord {
    /// The run id (time-sortable).
    pub run_id: String,
    /// Pipeline name.
    pub pipeline: String,
    /// Pipeline file path as given.
    pub pipeline_path: String,
    /// blake3 of the pipeline file.
    pub pipeline_digest: Digest,
    /// RFC 3339 start.
    pub started: String,
    /// Seconds.
    pub seconds: f64,
    /// Per stage, in pipeline order.
    pub stages: Vec<StageResult>,
}
