//! Lineage: the provenance tree of an artifact, and diffs between two runs or two pipelines.
//!
//! Everything here reads manifests and run records from the store (or pipeline files) and never
//! writes. Diff wording is shared with `dflash plan` ([`crate::plan::why`]).

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;

use serde::Serialize;
use serde_json::Value;

use crate::key::Key;
use crate::pipeline::Pipeline;
use crate::plan::diff_values;
use crate::store::{Manifest, RunRecord, Store, StoreError};

/// One node of a provenance tree.
#[derive(Debug, Serialize)]
pub struct Node {
    /// Stage id it was produced for.
    pub stage: String,
    /// Kind and version.
    pub kind: String,
    /// Its key.
    pub key: Key,
    /// Its content digest.
    pub digest: String,
    /// Resolved params.
    pub params: Value,
    /// Pinned external sources (name -> identity).
    pub sources: Vec<(String, String)>,
    /// Data summaries.
    pub stats: serde_json::Map<String, Value>,
    /// Files and bytes.
    pub files: usize,
    /// Total bytes.
    pub bytes: u64,
    /// When and where.
    pub produced: String,
    /// Host.
    pub host: String,
    /// Upstream nodes.
    pub inputs: Vec<Node>,
}

/// Build the provenance tree below `manifest`.
pub async fn tree(store: &Store, manifest: &Manifest) -> Result<Node, StoreError> {
    let mut cache: HashMap<Key, Manifest> = HashMap::new();
    Box::pin(node(store, manifest, &mut cache)).await
}

async fn node(
    store: &Store,
    m: &Manifest,
    cache: &mut HashMap<Key, Manifest>,
) -> Result<Node, StoreError> {
    let mut inputs = Vec::new();
    for inp in &m.lineage.inputs {
        let up = match cache.get(&inp.key) {
            Some(u) => Some(u.clone()),
            None => store.manifest(&inp.key).await?,
        };
        if let Some(up) = up {
            cache.insert(inp.key, up.clone());
            inputs.push(Box::pin(node(store, &up, cache)).await?);
        }
    }
    Ok(Node {
        stage: m.lineage.stage_id.clone(),
        kind: format!("{} v{}", m.fingerprint.kind, m.fingerprint.kind_version),
        key: m.key,
        digest: m.digest.to_hex(),
        params: m.fingerprint.params.clone(),
        sources: m
            .fingerprint
            .pins
            .iter()
            .map(|p| (p.name.clone(), p.identity.clone()))
            .collect(),
        stats: m.stats.clone(),
        files: m.files.len(),
        bytes: m.files.iter().map(|f| f.size).sum(),
        produced: m.lineage.started.clone(),
        host: m.lineage.host.clone(),
        inputs,
    })
}

/// The tree as indented text.
pub fn render_text(n: &Node) -> String {
    let mut out = String::new();
    text(n, "", true, true, &mut BTreeSet::new(), &mut out);
    out
}

fn text(
    n: &Node,
    prefix: &str,
    last: bool,
    root: bool,
    seen: &mut BTreeSet<Key>,
    out: &mut String,
) {
    let branch = if root {
        ""
    } else if last {
        "└─ "
    } else {
        "├─ "
    };
    if !seen.insert(n.key) {
        let _ = writeln!(
            out,
            "{prefix}{branch}{} {} (shown above)",
            n.stage,
            n.key.0.short(12)
        );
        return;
    }
    let stats = if n.stats.is_empty() {
        String::new()
    } else {
        format!("  {}", Value::Object(n.stats.clone()))
    };
    let _ = writeln!(
        out,
        "{prefix}{branch}{} ({}) {}  {} files, {} B, {} on {}{stats}",
        n.stage,
        n.kind,
        n.key.0.short(12),
        n.files,
        n.bytes,
        n.produced,
        n.host
    );
    let child_prefix = if root {
        String::new()
    } else {
        format!("{prefix}{}", if last { "   " } else { "│  " })
    };
    let params = summary(&n.params);
    if !params.is_empty() {
        let _ = writeln!(
            out,
            "{child_prefix}{}params: {params}",
            if n.inputs.is_empty() { "   " } else { "│  " }
        );
    }
    for (name, id) in &n.sources {
        let _ = writeln!(
            out,
            "{child_prefix}{}source: {name} @ {}",
            if n.inputs.is_empty() { "   " } else { "│  " },
            &id[..id.len().min(12)]
        );
    }
    for (i, c) in n.inputs.iter().enumerate() {
        text(c, &child_prefix, i + 1 == n.inputs.len(), false, seen, out);
    }
}

/// Params in one line, leaving out empty values.
fn summary(params: &Value) -> String {
    let Value::Object(map) = params else {
        return params.to_string();
    };
    let parts: Vec<String> = map
        .iter()
        .filter(|(_, v)| {
            !(v.is_null()
                || v.as_array().is_some_and(Vec::is_empty)
                || v.as_object().is_some_and(serde_json::Map::is_empty))
        })
        .map(|(k, v)| {
            let s = v.to_string();
            let s = if s.chars().count() > 50 {
                format!("{}…", s.chars().take(47).collect::<String>())
            } else {
                s
            };
            format!("{k}={s}")
        })
        .collect();
    parts.join(" ")
}

fn walk<'a>(
    n: &'a Node,
    seen: &mut BTreeSet<Key>,
    nodes: &mut Vec<&'a Node>,
    edges: &mut BTreeSet<(Key, Key)>,
) {
    if !seen.insert(n.key) {
        return;
    }
    nodes.push(n);
    for c in &n.inputs {
        edges.insert((c.key, n.key));
        walk(c, seen, nodes, edges);
    }
}

/// Draw the tree as a graph, each artifact once: `node` formats a node, `edge` an edge
/// (upstream, downstream).
fn render_graph(
    n: &Node,
    header: &str,
    footer: &str,
    node: impl Fn(&Node) -> String,
    edge: impl Fn(&Key, &Key) -> String,
) -> String {
    let (mut seen, mut nodes, mut edges) = (BTreeSet::new(), Vec::new(), BTreeSet::new());
    walk(n, &mut seen, &mut nodes, &mut edges);
    let mut out = header.to_owned();
    for n in nodes {
        let _ = writeln!(out, "{}", node(n));
    }
    for (a, b) in &edges {
        let _ = writeln!(out, "{}", edge(a, b));
    }
    out.push_str(footer);
    out
}

/// The tree as a Graphviz DOT graph.
pub fn render_dot(n: &Node) -> String {
    render_graph(
        n,
        "digraph lineage {\n  rankdir=LR;\n  node [shape=box];\n",
        "}\n",
        |n| {
            format!(
                "  \"{k}\" [label=\"{}\\n{}\\n{k}\"];",
                n.stage,
                n.kind,
                k = n.key.0.short(12)
            )
        },
        |a, b| format!("  \"{}\" -> \"{}\";", a.0.short(12), b.0.short(12)),
    )
}

/// The tree as a Mermaid flowchart.
pub fn render_mermaid(n: &Node) -> String {
    render_graph(
        n,
        "flowchart LR\n",
        "",
        |n| {
            format!(
                "  k{k}[\"{} ({})<br/>{k}\"]",
                n.stage,
                n.kind,
                k = n.key.0.short(12)
            )
        },
        |a, b| format!("  k{} --> k{}", a.0.short(12), b.0.short(12)),
    )
}

/// One stage's line in a diff.
#[derive(Debug, Serialize)]
pub struct StageDiff {
    /// Stage id.
    pub id: String,
    /// `same`, `changed`, `added` or `removed`.
    pub change: &'static str,
    /// What changed, in the words `plan` uses.
    pub details: Vec<String>,
}

/// Diff two runs stage by stage, reading their manifests for the causes.
#[allow(clippy::many_single_char_names)] // a/b: the two sides, as in the CLI
pub async fn diff_runs(
    store: &Store,
    a: &RunRecord,
    b: &RunRecord,
) -> Result<Vec<StageDiff>, StoreError> {
    let mut ids: Vec<&str> = a.stages.iter().map(|s| s.id.as_str()).collect();
    for s in &b.stages {
        if !ids.contains(&s.id.as_str()) {
            ids.push(&s.id);
        }
    }
    let mut out = Vec::new();
    for id in ids {
        let sa = a.stages.iter().find(|s| s.id == id);
        let sb = b.stages.iter().find(|s| s.id == id);
        let d = match (sa, sb) {
            (Some(_), None) => StageDiff {
                id: id.into(),
                change: "removed",
                details: vec![],
            },
            (None, Some(_)) => StageDiff {
                id: id.into(),
                change: "added",
                details: vec![],
            },
            (Some(x), Some(y)) if x.key == y.key => StageDiff {
                id: id.into(),
                change: "same",
                details: vec![],
            },
            (Some(x), Some(y)) => {
                let ma = match x.key {
                    Some(k) => store.manifest(&k).await?,
                    None => None,
                };
                let mb = match y.key {
                    Some(k) => store.manifest(&k).await?,
                    None => None,
                };
                let details = match (ma, mb) {
                    (Some(ma), Some(mb)) => manifest_changes(&ma, &mb),
                    _ => vec![format!(
                        "status {} -> {}",
                        x.status.as_str(),
                        y.status.as_str()
                    )],
                };
                StageDiff {
                    id: id.into(),
                    change: "changed",
                    details,
                }
            }
            (None, None) => continue,
        };
        out.push(d);
    }
    Ok(out)
}

/// Every difference between two artifacts' manifests: cause first, then the output.
pub fn manifest_changes(a: &Manifest, b: &Manifest) -> Vec<String> {
    let (fa, fb) = (&a.fingerprint, &b.fingerprint);
    let mut out = Vec::new();
    if fa.kind != fb.kind || fa.kind_version != fb.kind_version {
        out.push(format!(
            "kind {} v{} -> {} v{}",
            fa.kind, fa.kind_version, fb.kind, fb.kind_version
        ));
    }
    let mut params = Vec::new();
    diff_values("", &fa.params, &fb.params, &mut params);
    out.extend(params.into_iter().map(|p| format!("param {p}")));
    for ib in &fb.inputs {
        match fa.inputs.iter().find(|ia| ia.name == ib.name) {
            None => out.push(format!("input `{}` added", ib.name)),
            Some(ia) if ia.digest != ib.digest => out.push(format!(
                "input `{}` changed: {} -> {}",
                ib.name,
                ia.digest.short(12),
                ib.digest.short(12)
            )),
            _ => {}
        }
    }
    for ia in &fa.inputs {
        if !fb.inputs.iter().any(|ib| ib.name == ia.name) {
            out.push(format!("input `{}` removed", ia.name));
        }
    }
    for pb in &fb.pins {
        match fa.pins.iter().find(|pa| pa.name == pb.name) {
            None => out.push(format!("source `{}` added", pb.name)),
            Some(pa) if pa.identity != pb.identity => {
                out.push(format!("source `{}` changed", pb.name));
            }
            _ => {}
        }
    }
    if a.digest == b.digest {
        out.push("output unchanged (dependants stay cached)".into());
    } else {
        let bytes = |m: &Manifest| m.files.iter().map(|f| f.size).sum::<u64>();
        out.push(format!(
            "output {} -> {} ({} -> {} files, {} -> {} B)",
            a.digest.short(12),
            b.digest.short(12),
            a.files.len(),
            b.files.len(),
            bytes(a),
            bytes(b)
        ));
        let mut stats = Vec::new();
        diff_values(
            "",
            &Value::Object(a.stats.clone()),
            &Value::Object(b.stats.clone()),
            &mut stats,
        );
        out.extend(stats.into_iter().map(|s| format!("stat {s}")));
    }
    out
}

/// Diff two pipeline files by their declarations (kinds, inputs, resolved params).
pub fn diff_pipelines(a: &Pipeline, b: &Pipeline) -> Vec<StageDiff> {
    let mut out = Vec::new();
    for sa in &a.stages {
        let Some(sb) = b.stages.iter().find(|s| s.id == sa.id) else {
            out.push(StageDiff {
                id: sa.id.clone(),
                change: "removed",
                details: vec![],
            });
            continue;
        };
        let mut details = Vec::new();
        if sa.kind != sb.kind {
            details.push(format!("kind `{}` -> `{}`", sa.kind, sb.kind));
        }
        let mut params = Vec::new();
        diff_values("", &sa.params, &sb.params, &mut params);
        details.extend(params.into_iter().map(|p| format!("param {p}")));
        if sa.inputs != sb.inputs {
            let show = |s: &crate::pipeline::StageSpec| {
                s.inputs
                    .iter()
                    .map(|i| i.stage.clone())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            details.push(format!("inputs [{}] -> [{}]", show(sa), show(sb)));
        }
        out.push(StageDiff {
            id: sa.id.clone(),
            change: if details.is_empty() {
                "same"
            } else {
                "changed"
            },
            details,
        });
    }
    for sb in &b.stages {
        if !a.stages.iter().any(|s| s.id == sb.id) {
            out.push(StageDiff {
                id: sb.id.clone(),
                change: "added",
                details: vec![],
            });
        }
    }
    // A changed stage changes everything downstream of it: say so, with the cause. Repeat until
    // nothing moves, since file order need not be dependency order.
    loop {
        let changed: Vec<String> = out
            .iter()
            .filter(|d| d.change != "same")
            .map(|d| d.id.clone())
            .collect();
        let mut moved = false;
        for d in out.iter_mut().filter(|d| d.change == "same") {
            if let Some(spec) = b.stages.iter().find(|s| s.id == d.id)
                && let Some(up) = spec.inputs.iter().find(|i| changed.contains(&i.stage))
            {
                d.change = "changed";
                d.details
                    .push(format!("input `{}` changed (upstream)", up.stage));
                moved = true;
            }
        }
        if !moved {
            return out;
        }
    }
}

/// A diff as aligned text; `colour` marks each stage's change in ANSI colours (for a terminal).
pub fn render_diff(diffs: &[StageDiff], colour: bool) -> String {
    let mut out = String::new();
    for d in diffs {
        let code = match d.change {
            "changed" => "33",
            "added" => "32",
            "removed" => "31",
            _ => "2",
        };
        if colour {
            let _ = writeln!(out, "\x1b[{code}m{:<8}\x1b[0m {}", d.change, d.id);
        } else {
            let _ = writeln!(out, "{:<8} {}", d.change, d.id);
        }
        for det in &d.details {
            let _ = writeln!(out, "           {det}");
        }
    }
    out
}
