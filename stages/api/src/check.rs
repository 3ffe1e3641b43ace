//! Checks of a stage's params that run before any stage does: what a kind may look at then (its
//! own resolved params, the params of every stage upstream of it, local files), and how it
//! reports what is wrong ([`Issue`]), so the runtime can point at the offending YAML.
//!
//! Ranges of single numbers are declared on the [`crate::Param`] itself and checked with the
//! types; [`crate::StageKind::check`] holds the rest: relations between params, between a stage
//! and the stages it reads from, and files that must exist. [`crate::StageKind::check_input`]
//! runs as soon as one upstream artifact exists, for facts only its data holds.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::PathSeg;

/// One thing wrong with a stage's params.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Issue {
    /// The param it concerns and the path below it (e.g. `target_layers`, 2); empty: the
    /// stage's params as a whole.
    pub at: Vec<PathSeg>,
    /// What is wrong, naming the offending value.
    pub message: String,
    /// How to fix it.
    pub help: Option<String>,
}

impl Issue {
    /// An issue with param `param`.
    pub fn new(param: &str, message: impl Into<String>) -> Self {
        Self {
            at: vec![PathSeg::Key(param.to_owned())],
            message: message.into(),
            help: None,
        }
    }

    /// The issue is with one item of the param (a list index or map key below it).
    #[must_use]
    pub fn below(mut self, seg: PathSeg) -> Self {
        self.at.push(seg);
        self
    }

    /// Add a hint.
    #[must_use]
    pub fn help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }
}

/// One stage of the pipeline, as another stage's check may see it.
#[derive(Clone, Debug)]
pub struct PipelineStage<'a> {
    /// Its id.
    pub id: &'a str,
    /// Its kind.
    pub kind: &'a str,
    /// Its resolved params.
    pub params: &'a Value,
    /// The ids of the stages it reads from.
    pub inputs: Vec<&'a str>,
}

/// Every stage of a pipeline by id, built once for all the checks.
#[derive(Clone, Debug, Default)]
pub struct Stages<'a> {
    list: Vec<PipelineStage<'a>>,
    index: HashMap<&'a str, usize>,
}

impl<'a> Stages<'a> {
    /// Index `list`.
    pub fn new(list: Vec<PipelineStage<'a>>) -> Self {
        let index = list.iter().enumerate().map(|(i, s)| (s.id, i)).collect();
        Self { list, index }
    }

    /// The stage with id `id`.
    pub fn get(&self, id: &str) -> Option<&PipelineStage<'a>> {
        self.index.get(id).map(|&i| &self.list[i])
    }

    /// The stages `ids` name and every stage upstream of them (through any number of others),
    /// nearest first; each once, whatever cycles the file may hold.
    pub fn with_upstream<'s>(
        &'s self,
        ids: impl IntoIterator<Item = &'s str>,
    ) -> Vec<&'s PipelineStage<'a>> {
        let mut seen: HashSet<&str> = HashSet::new();
        let mut queue: VecDeque<&str> = ids.into_iter().collect();
        let mut out = Vec::new();
        while let Some(id) = queue.pop_front() {
            if !seen.insert(id) {
                continue;
            }
            if let Some(s) = self.get(id) {
                out.push(s);
                queue.extend(s.inputs.iter().copied());
            }
        }
        out
    }
}

/// What a kind's [`crate::StageKind::check`] may look at.
#[derive(Clone, Copy, Debug)]
pub struct CheckEnv<'a> {
    /// The directory relative paths in params resolve against.
    pub cwd: &'a Path,
    /// The names this stage sees its inputs by, in order.
    pub inputs: &'a [&'a str],
    /// The ids of the stages those inputs come from, in the same order.
    pub input_stages: &'a [&'a str],
    /// Every stage of the pipeline.
    pub stages: &'a Stages<'a>,
}

impl<'a> CheckEnv<'a> {
    /// Every stage upstream of this one (through any number of others), nearest first; walked
    /// when asked, so checks that never ask cost nothing on a 10,000-stage pipeline.
    pub fn upstream(&self) -> Vec<&'a PipelineStage<'a>> {
        self.stages.with_upstream(self.input_stages.iter().copied())
    }

    /// The upstream stages of kind `kind`, nearest first.
    pub fn upstream_of_kind(&self, kind: &str) -> Vec<&'a PipelineStage<'a>> {
        self.upstream()
            .into_iter()
            .filter(|u| u.kind == kind)
            .collect()
    }

    /// A param's path resolved against the working directory.
    pub fn path(&self, value: &str) -> PathBuf {
        self.cwd.join(value)
    }

    /// An issue when `param` (a string) names no local file or folder; `what` says what it
    /// should name.
    pub fn must_exist(&self, params: &Value, param: &str, what: &str) -> Option<Issue> {
        let value = params[param].as_str()?;
        if self.path(value).exists() {
            return None;
        }
        Some(
            Issue::new(param, format!("`{value}` does not exist")).help(format!(
                "`{param}` is {what}; paths are relative to where dflash runs"
            )),
        )
    }
}

/// Whether `url` is an http(s) URL (a server's base URL, a file to download).
pub fn is_http_url(url: &str) -> bool {
    url.starts_with("http://") || url.starts_with("https://")
}

/// Small files of one upstream artifact, read once it is committed, for
/// [`crate::StageKind::check_input`].
#[derive(Clone, Debug)]
pub struct UpstreamOutput<'a> {
    /// The name the checked stage sees the input by.
    pub name: &'a str,
    /// The upstream stage's id.
    pub stage_id: &'a str,
    /// The files the kind asked for ([`crate::StageKind::input_files`]) that the artifact holds,
    /// by path.
    pub files: BTreeMap<String, Vec<u8>>,
}

impl UpstreamOutput<'_> {
    /// A file parsed as JSON, when present and valid.
    pub fn json(&self, path: &str) -> Option<Value> {
        serde_json::from_slice(self.files.get(path)?).ok()
    }
}
