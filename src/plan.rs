//! `dflash plan`: per stage, its key, whether it is done, and the first reason it must run.
//!
//! Writes nothing. A stage whose upstream is not done has no key yet (it depends on upstream
//! content). The reason compares the stage's new fingerprint with the one recorded the last time
//! a stage of that id ran in this pipeline (from run records and manifests).

use std::collections::HashMap;

use dflash_stage_api::Digest;
use serde::Serialize;
use serde_json::Value;

use crate::graph::Graph;
use crate::hashcache::HashCache;
use crate::key::{Fingerprint, Key};
use crate::kinds::Registry;
use crate::pipeline::Pipeline;
use crate::store::{Store, StoreError};

/// A stage's state in the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Committed.
    Done,
    /// Shards of an earlier attempt exist.
    Partial,
    /// Nothing stored.
    Pending,
}

/// One line of a plan.
#[derive(Clone, Debug, Serialize)]
pub struct PlannedStage {
    /// Stage id.
    pub id: String,
    /// Kind.
    pub kind: String,
    /// Key, when computable.
    pub key: Option<Key>,
    /// State.
    pub state: State,
    /// Why it must run (null when done).
    pub reason: Option<String>,
}

/// Compute the plan.
pub async fn plan(
    pipeline: &Pipeline,
    graph: &Graph,
    registry: &Registry,
    store: &Store,
    hashes: &HashCache,
) -> Result<Vec<PlannedStage>, StoreError> {
    let n = pipeline.stages.len();
    let mut digests: Vec<Option<Digest>> = vec![None; n];
    let mut out: Vec<Option<PlannedStage>> = vec![None; n];
    let history = History::load(pipeline, store).await?;
    // One listing says which keys are committed; run records already know most of their
    // digests (a key's manifest is immutable, so a recorded digest stays true). Only keys
    // missing from the records cost a manifest read: 10,000 stages plan in one listing.
    let committed: std::collections::HashSet<Key> = store.keys().await?.into_iter().collect();
    for &i in &graph.order {
        let spec = &pipeline.stages[i];
        let ups = &graph.inputs[i];
        let line = |key, state, reason| PlannedStage {
            id: spec.id.clone(),
            kind: spec.kind.clone(),
            key,
            state,
            reason,
        };
        if let Some(&blocked) = ups.iter().find(|&&u| digests[u].is_none()) {
            let up = &pipeline.stages[blocked].id;
            out[i] = Some(line(
                None,
                State::Pending,
                Some(format!("upstream `{up}` must run first")),
            ));
            continue;
        }
        let upstream: Vec<Digest> = ups.iter().map(|&u| digests[u].expect("checked")).collect();
        let fp = match crate::run::fingerprint(spec, registry, &upstream, hashes) {
            Ok(fp) => fp,
            Err(e) => {
                out[i] = Some(line(
                    None,
                    State::Pending,
                    Some(format!("cannot compute key: {}", e.message)),
                ));
                continue;
            }
        };
        let key = fp.key();
        if committed.contains(&key) {
            let digest = match history.digests.get(&key) {
                Some(d) => Some(*d),
                None => store.manifest(&key).await?.map(|m| m.digest),
            };
            if let Some(d) = digest {
                digests[i] = Some(d);
                out[i] = Some(line(Some(key), State::Done, None));
                continue;
            }
        }
        let state = if store.shards(&key).await?.is_empty() {
            State::Pending
        } else {
            State::Partial
        };
        let reason = if let Some((run, error)) = history.failed.get(&key) {
            format!("failed in run {run}: {error}")
        } else {
            match history.previous(store, &spec.id).await? {
                None => "never run".to_owned(),
                Some(old) => why(&old, &fp, spec),
            }
        };
        out[i] = Some(line(Some(key), state, Some(reason)));
    }
    Ok(out
        .into_iter()
        .map(|s| s.expect("every stage planned"))
        .collect())
}

/// The first difference between an old and a new fingerprint, in words.
pub fn why(old: &Fingerprint, new: &Fingerprint, spec: &crate::pipeline::StageSpec) -> String {
    if old.kind != new.kind {
        return format!("kind changed: `{}` -> `{}`", old.kind, new.kind);
    }
    if old.kind_version != new.kind_version {
        return format!(
            "`{}` version changed: {} -> {}",
            new.kind, old.kind_version, new.kind_version
        );
    }
    if old.schema != new.schema {
        return format!("key schema changed: {} -> {}", old.schema, new.schema);
    }
    let mut changes = Vec::new();
    diff_values("", &old.params, &new.params, &mut changes);
    if let Some(first) = changes.first() {
        let more = if changes.len() > 1 {
            format!(" (and {} more)", changes.len() - 1)
        } else {
            String::new()
        };
        return format!("param {first}{more}");
    }
    let old_names: Vec<&str> = old.inputs.iter().map(|i| i.name.as_str()).collect();
    let new_names: Vec<&str> = new.inputs.iter().map(|i| i.name.as_str()).collect();
    if old_names != new_names {
        return format!(
            "inputs changed: [{}] -> [{}]",
            old_names.join(", "),
            new_names.join(", ")
        );
    }
    for (o, n) in old.inputs.iter().zip(&new.inputs) {
        if o.digest != n.digest {
            let up = spec
                .inputs
                .iter()
                .find(|i| i.name == n.name)
                .map_or(n.name.as_str(), |i| i.stage.as_str());
            return format!(
                "input `{up}` changed: {} -> {}",
                o.digest.short(12),
                n.digest.short(12)
            );
        }
    }
    for n in &new.pins {
        match old.pins.iter().find(|o| o.name == n.name) {
            None => return format!("new source `{}`", n.name),
            Some(o) if o.identity != n.identity => {
                return format!(
                    "source `{}` changed: {} -> {}",
                    n.name,
                    short(&o.identity),
                    short(&n.identity)
                );
            }
            _ => {}
        }
    }
    if let Some(o) = old
        .pins
        .iter()
        .find(|o| !new.pins.iter().any(|n| n.name == o.name))
    {
        return format!("source `{}` removed", o.name);
    }
    "not in the store (same inputs as the last run; its artifact was never committed)".to_owned()
}

fn short(s: &str) -> &str {
    &s[..s.len().min(12)]
}

/// Param paths whose values differ, as `path: old -> new`.
pub fn diff_values(path: &str, old: &Value, new: &Value, out: &mut Vec<String>) {
    match (old, new) {
        (Value::Object(a), Value::Object(b)) => {
            let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let sub = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                diff_values(
                    &sub,
                    a.get(k.as_str()).unwrap_or(&Value::Null),
                    b.get(k.as_str()).unwrap_or(&Value::Null),
                    out,
                );
            }
        }
        (a, b) if a != b => out.push(format!("`{path}`: {} -> {}", compact(a), compact(b))),
        _ => {}
    }
}

fn compact(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 60 {
        format!("{}…", s.chars().take(57).collect::<String>())
    } else {
        s
    }
}

/// The last recorded key of each stage id of this pipeline.
struct History {
    last: HashMap<String, Key>,
    digests: HashMap<Key, Digest>,
    /// Keys whose latest attempt failed: the run id and the error.
    failed: HashMap<Key, (String, String)>,
}

impl History {
    async fn load(pipeline: &Pipeline, store: &Store) -> Result<Self, StoreError> {
        let mut last = HashMap::new();
        let mut digests = HashMap::new();
        let mut failed = HashMap::new();
        for run in store.runs().await? {
            for s in &run.stages {
                if let (Some(k), Some(d)) = (s.key, s.digest) {
                    digests.insert(k, d);
                }
                if let (crate::store::Status::Failed, Some(k)) = (s.status, s.key) {
                    failed.insert(k, (run.run_id.clone(), s.error.clone().unwrap_or_default()));
                }
            }
            if run.pipeline != pipeline.name {
                continue;
            }
            for s in run.stages {
                let committed = matches!(
                    s.status,
                    crate::store::Status::Ran
                        | crate::store::Status::Cached
                        | crate::store::Status::Resumed
                );
                if let (true, Some(k)) = (committed, s.key) {
                    last.insert(s.id, k);
                }
            }
        }
        Ok(Self {
            last,
            digests,
            failed,
        })
    }

    async fn previous(&self, store: &Store, id: &str) -> Result<Option<Fingerprint>, StoreError> {
        let Some(key) = self.last.get(id) else {
            return Ok(None);
        };
        Ok(store.manifest(key).await?.map(|m| m.fingerprint))
    }
}
