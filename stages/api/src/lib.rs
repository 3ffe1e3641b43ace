//! The contract between the dflash runtime and its stage kinds.
//!
//! The runtime (the `dflash` crate) knows stages only through this crate: a stage kind describes its
//! typed params ([`Param`]), optionally pins external sources into its key ([`StageKind::pin`]), and
//! turns a [`StageContext`] — local folders holding its inputs, an empty output folder, a shard sink
//! for partial progress — into files in that output folder. The runtime hashes, uploads and commits
//! those files; a stage never touches the store directly, so a stage can't break the
//! never-overwrite promise.

mod cancel;
mod check;
mod context;
#[cfg(feature = "dataset")]
pub mod dataset;
mod digest;
mod error;
mod figures;
pub mod gguf;
mod log;
mod params;
pub mod process;
#[cfg(feature = "remote")]
pub mod remote;
#[cfg(feature = "dataset")]
pub mod tokens;

pub use cancel::Cancel;
pub use check::{CheckEnv, Issue, PipelineStage, Stages, UpstreamOutput, is_http_url};
pub use context::{Input, Pin, Pinner, Progress, ShardSink, StageContext, StageOutput, pin_model};
pub use digest::{Digest, DigestParseError};
pub use error::StageError;
pub use figures::thousands;
pub use log::StageLog;
pub use params::{Bounds, Mismatch, Param, ParamType, PathSeg, describe_value, show_number};

/// One kind of stage (`command`, `download`, `mix`, ...): its schema, version and behaviour.
///
/// `run` is blocking: the runtime calls it on a blocking thread, so CPU-bound stages need no
/// async plumbing and I/O-bound ones may start their own runtime.
pub trait StageKind: Send + Sync {
    /// The name used as `kind:` in a pipeline file.
    fn name(&self) -> &'static str;

    /// The implementation version. Bump it whenever the output for the same inputs changes;
    /// it enters every key of this kind, so bumping it invalidates exactly this kind's artifacts.
    fn version(&self) -> u32;

    /// One line for `--help` style listings.
    fn summary(&self) -> &'static str;

    /// The typed params this kind accepts. Defaults are filled in before hashing.
    fn params(&self) -> Vec<Param>;

    /// Pinned identities of external sources (a local file's content digest, a dataset's commit
    /// sha, an object's etag). They enter the key; they must never contain secrets or paths that
    /// differ between machines.
    fn pin(&self, params: &serde_json::Value, pinner: &dyn Pinner) -> Result<Vec<Pin>, StageError> {
        let _ = (params, pinner);
        Ok(Vec::new())
    }

    /// Check the params before any stage runs (`dflash plan`, `dflash run`, `dflash estimate`):
    /// relations between them, against the stages upstream, and local files that must exist
    /// (a model's header may be read; nothing is downloaded or computed). Single numbers'
    /// ranges are declared on the params instead. Every issue is reported at once.
    fn check(&self, params: &serde_json::Value, env: &CheckEnv<'_>) -> Vec<Issue> {
        let _ = (params, env);
        Vec::new()
    }

    /// Whether running with these params occupies the machine's accelerator (a GPU, or without
    /// one all its cores): a training step, in-process generation or decoding. The runtime runs
    /// one such stage at a time, so two of them never share a GPU's memory (two trainings of a
    /// large target would not fit) or split its time; the rest run beside them.
    fn uses_accelerator(&self, params: &serde_json::Value) -> bool {
        let _ = params;
        false
    }

    /// Small files of an upstream artifact that [`StageKind::check_input`] reads (e.g.
    /// `tokenize.json`).
    fn input_files(&self) -> &'static [&'static str] {
        &[]
    }

    /// Check the params against one upstream artifact as soon as it is committed, before this
    /// stage (or anything else waiting for it) runs: for facts only the data holds.
    fn check_input(
        &self,
        params: &serde_json::Value,
        cwd: &std::path::Path,
        input: &UpstreamOutput<'_>,
    ) -> Vec<Issue> {
        let _ = (params, cwd, input);
        Vec::new()
    }

    /// Produce the output files in `ctx.out_dir`.
    fn run(&self, ctx: &StageContext<'_>) -> Result<StageOutput, StageError>;
}
