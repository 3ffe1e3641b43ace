//! [`StageContext`]: everything a running stage may see and do, and the small traits the runtime
//! implements behind it (shards, progress, pinning).

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::{Cancel, Digest, StageError};

/// One upstream artifact, materialised as a local folder.
#[derive(Clone, Debug)]
pub struct Input {
    /// The name the stage sees it by: the upstream stage id, or the role in a map of inputs.
    pub name: String,
    /// The upstream stage's id in the pipeline.
    pub stage_id: String,
    /// A local folder holding the artifact's files (a private copy: the stage may not change
    /// the stored artifact through it).
    pub dir: PathBuf,
    /// The artifact's content digest.
    pub digest: Digest,
}

/// A pinned identity of an external source; it enters the key.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Pin {
    /// What is pinned, e.g. `file:scripts/prep.py` or `hf:nvidia/Nemotron@main`.
    pub name: String,
    /// Its identity, e.g. a content digest or a commit sha.
    pub identity: String,
}

impl Pin {
    /// Whether it pins the content of param `param`: named `<param>` (a file) or
    /// `<param>:<file>` (a folder's files), as [`pin_model`] names them.
    pub fn stands_for(&self, param: &str) -> bool {
        self.name
            .strip_prefix(param)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(':'))
    }
}

/// Services the runtime offers while a stage computes its pins.
pub trait Pinner: Sync {
    /// The blake3 digest of a local file, relative to the working directory. Unchanged files are
    /// not re-read (the runtime keeps a stat cache).
    fn file_digest(&self, path: &Path) -> Result<Digest, StageError>;
}

/// The pins of a local model given by param `param`, by content alone, so another model under
/// the same name reruns the stage and the same model under another name does not: one pin named
/// `<param>` for a file (a GGUF), one named `<param>:<file>` per file that defines the model for
/// a Hugging Face folder (configs, tokenizer, chat template, weights). Declare the param
/// [`crate::Param::content`] so its path stays out of the key. `help` says what the param should
/// name when nothing is there.
pub fn pin_model(
    param: &str,
    path: &str,
    pinner: &dyn Pinner,
    help: &str,
) -> Result<Vec<Pin>, StageError> {
    let p = Path::new(path);
    let pin = |file: &Path, name: String| -> Result<Pin, StageError> {
        Ok(Pin {
            name,
            identity: pinner.file_digest(file)?.to_hex(),
        })
    };
    if p.is_file() {
        return Ok(vec![pin(p, param.to_owned())?]);
    }
    if p.join("config.json").is_file() {
        let mut files: Vec<String> = std::fs::read_dir(p)
            .map_err(|e| StageError::new(format!("cannot list `{path}`: {e}")))?
            .filter_map(Result::ok)
            .filter(|e| e.path().is_file())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| defines_model(n))
            .collect();
        files.sort();
        return files
            .into_iter()
            .map(|n| pin(&p.join(&n), format!("{param}:{n}")))
            .collect();
    }
    let what = if p.is_dir() {
        format!("the folder `{path}` has no config.json")
    } else {
        format!("the model `{path}` does not exist")
    };
    Err(StageError::new(what).with_help(help))
}

/// Whether a file in a Hugging Face model folder is part of what the model computes (READMEs,
/// licences and images are not).
fn defines_model(name: &str) -> bool {
    let ext = Path::new(name)
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    matches!(ext.as_deref(), Some("safetensors" | "json" | "jinja")) || name == "tokenizer.model"
}

/// Partial progress that survives a crash: each shard is committed to the store (create-only)
/// as soon as it is complete, and a rerun of the same key sees which shards are done.
pub trait ShardSink: Sync {
    /// Names of the shards committed by earlier attempts at this key.
    fn done(&self) -> Vec<String>;

    /// Commit the files under `dir` as shard `name`. They become part of the artifact, at their
    /// paths relative to `dir`. Committing a name twice is an error.
    fn commit(&self, name: &str, dir: &Path) -> Result<(), StageError>;

    /// The bytes of file `path` (relative to the shard) of shard `name`, committed by this or an
    /// earlier attempt, so a resumed stage can read back what it already made (e.g. a small
    /// per-shard report) without redoing it.
    fn read(&self, name: &str, path: &str) -> Result<Vec<u8>, StageError>;
}

/// Progress reporting for long work.
pub trait Progress: Sync {
    /// `done` units of `total` (when known) are finished.
    fn set(&self, done: u64, total: Option<u64>, message: &str);
}

/// What the runtime hands a running stage.
pub struct StageContext<'a> {
    /// The stage's id in the pipeline.
    pub stage_id: &'a str,
    /// The resolved params (defaults filled in), as hashed into the key.
    pub params: &'a Value,
    /// The pinned identities of external sources, as they entered the key: a stage fetches
    /// exactly what these name (the commit sha a branch resolved to when the key was made).
    pub pins: &'a [Pin],
    /// The upstream artifacts, in the order the pipeline lists them.
    pub inputs: &'a [Input],
    /// An empty folder; every file left in it becomes part of the artifact.
    pub out_dir: &'a Path,
    /// A private scratch folder, discarded after the stage.
    pub scratch_dir: &'a Path,
    /// The stage's log file; a stage appends what a user would want to read when it fails.
    pub log_path: &'a Path,
    /// A folder private to this key that survives a crash or Ctrl-C and is removed once the key
    /// is committed: for partial downloads and similar work finer than a shard.
    pub resume_dir: &'a Path,
    /// The directory `dflash` was started in; relative paths in params are relative to it.
    pub cwd: &'a Path,
    /// Where to commit shards of partial progress.
    pub shards: &'a dyn ShardSink,
    /// Where to report progress.
    pub progress: &'a dyn Progress,
    /// Set when the run is cancelled; long work should check it and stop.
    pub cancel: &'a Cancel,
}

impl StageContext<'_> {
    /// Deserialize the resolved params into the stage's own struct.
    pub fn params<T: DeserializeOwned>(&self) -> Result<T, StageError> {
        serde_json::from_value(self.params.clone()).map_err(|e| {
            StageError::new(format!(
                "params of stage `{}` do not fit: {e}",
                self.stage_id
            ))
        })
    }
}

/// What a stage returns besides its files.
#[derive(Clone, Debug, Default)]
pub struct StageOutput {
    /// Data summaries for the manifest (row and token counts, ...).
    pub stats: serde_json::Map<String, Value>,
    /// A short report for the terminal, printed under the stage's line when it ran (e.g. a
    /// mix's composition table).
    pub summary: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::Pin;

    #[test]
    fn a_pin_stands_for_its_param_only() {
        let pin = |name: &str| Pin {
            name: name.into(),
            identity: String::new(),
        };
        assert!(pin("target").stands_for("target"));
        assert!(pin("target:config.json").stands_for("target"));
        assert!(!pin("targets").stands_for("target"));
        assert!(!pin("model").stands_for("target"));
    }
}
