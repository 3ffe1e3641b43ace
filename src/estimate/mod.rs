//! `dflash estimate`: the compute, storage, time and money a pipeline needs, before anything runs.
//!
//! Every stage is sized from the best figure available, and each figure says which it is:
//! *measured* (a committed artifact's manifest, or dflash's own benchmarks), *declared* (the
//! stage's `expect:` block), a *param* (`limit`, `total`, `max_tokens`), *upstream* (carried from
//! the stage before) or *assumed* (a default, listed with its source in the assumptions table).
//! Work turns into time through [`hardware::Assumptions`]; the critical path through the DAG
//! gives the wall-clock. Alternatives the user should weigh — storing hidden states offline
//! against training online, how to split GPUs between target and drafter, single-GPU servers
//! against tensor parallelism — are costed side by side, and infeasible plans are warned about.
//! Writes nothing.

pub mod hardware;
mod render;
mod stages;

use std::collections::HashMap;
use std::path::PathBuf;

use serde::Serialize;

use crate::graph::Graph;
use crate::hashcache::HashCache;
use crate::kinds::Registry;
use crate::pipeline::Pipeline;
use crate::store::manifest::Manifest;
use crate::store::{Store, StoreError};

pub use hardware::{Assumptions, Hardware};
pub use render::render;

/// What the user asked for besides the pipeline.
#[derive(Clone, Debug)]
pub struct Options {
    /// `--gpus`.
    pub hardware: Hardware,
    /// USD per GPU-hour (`--price`; default: the GPU's typical rate).
    pub price: f64,
    /// Warn when the plan stores more than this many bytes.
    pub max_storage: f64,
    /// Warn when a stage or the whole plan takes longer than this many hours.
    pub budget_hours: Option<f64>,
    /// The throughput table, overrides applied.
    pub assumptions: Assumptions,
    /// Where relative model paths resolve (the working directory).
    pub base: PathBuf,
}

/// How a figure was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Basis {
    /// From a committed artifact or dflash's own measurements.
    Measured,
    /// From the stage's `expect:`.
    Declared,
    /// From a param of the stage.
    Param,
    /// Carried from upstream stages.
    Upstream,
    /// A default assumption.
    Assumed,
}

impl Basis {
    /// The one-letter mark the table uses.
    pub fn mark(self) -> char {
        match self {
            Self::Measured => 'm',
            Self::Declared => 'd',
            Self::Param => 'p',
            Self::Upstream => 'u',
            Self::Assumed => 'a',
        }
    }

    /// The weaker of two bases: a figure derived from an assumption is an assumption.
    fn weaker(self, other: Self) -> Self {
        let rank = |b: Self| match b {
            Self::Measured => 0,
            Self::Declared | Self::Param => 1,
            Self::Upstream => 2,
            Self::Assumed => 3,
        };
        if rank(other) > rank(self) {
            other
        } else {
            self
        }
    }
}

/// A number and how it was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Figure {
    /// The value.
    pub value: f64,
    /// Its basis.
    pub basis: Basis,
}

impl Figure {
    fn new(value: f64, basis: Basis) -> Self {
        Self { value, basis }
    }
    /// `self * other`, keeping the weaker basis.
    fn times(self, other: Self) -> Self {
        Self::new(self.value * other.value, self.basis.weaker(other.basis))
    }
}

/// What runs a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Resource {
    /// GPUs (counted in `gpus`).
    Gpu,
    /// This machine's CPU cores.
    Cpu,
    /// The network (downloads; not timed).
    Network,
    /// Unknown (a `command`).
    Unknown,
}

/// One stage sized.
#[derive(Clone, Debug, Serialize)]
pub struct StageEstimate {
    /// Stage id.
    pub id: String,
    /// Kind.
    pub kind: String,
    /// `done`, `partial` or `pending` in the store.
    pub state: String,
    /// Rows it outputs.
    pub rows: Option<Figure>,
    /// Tokens it works through (generated, tokenized, or trained on x epochs).
    pub tokens: Option<Figure>,
    /// What `tokens` counts.
    pub tokens_are: &'static str,
    /// Floating-point operations on GPUs.
    pub flops: Option<f64>,
    /// Bytes it writes to the store.
    pub storage_bytes: Option<Figure>,
    /// What runs it.
    pub resource: Resource,
    /// GPUs it occupies.
    pub gpus: u32,
    /// GPU-hours (0 when done).
    pub gpu_hours: f64,
    /// Wall-clock hours (0 when done; null when not estimated).
    pub wall_hours: Option<f64>,
    /// USD.
    pub cost: f64,
    /// How the figures were reached, and caveats.
    pub notes: Vec<String>,
    /// Per-row sizes handed to downstream stages.
    #[serde(skip)]
    pub(crate) data: Data,
}

/// Per-row sizes flowing along an edge of the DAG.
#[derive(Clone, Debug, Default)]
pub(crate) struct Data {
    pub rows: Option<Figure>,
    /// User turns over all rows, where counted (a multi-turn benchmark's bench asks each).
    pub user_turns: Option<Figure>,
    pub prompt_tokens: Option<Figure>,
    pub output_tokens: Option<Figure>,
    pub tokens: Option<Figure>,
    pub trained_share: Option<Figure>,
}

/// One way of doing a stage's work, costed.
#[derive(Clone, Debug, Serialize)]
pub struct Choice {
    /// What it is.
    pub label: String,
    /// Bytes stored.
    pub storage_bytes: f64,
    /// GPU-hours.
    pub gpu_hours: f64,
    /// Wall-clock hours.
    pub wall_hours: f64,
    /// Whether the pipeline as written does this.
    pub chosen: bool,
    /// Consequences worth knowing.
    pub note: String,
}

/// Alternatives for one stage, side by side.
#[derive(Clone, Debug, Serialize)]
pub struct Alternative {
    /// Stage id.
    pub stage: String,
    /// The question (e.g. "hidden states: offline or online").
    pub question: String,
    /// The choices.
    pub choices: Vec<Choice>,
}

/// Sums over the stages still to run.
#[derive(Clone, Debug, Serialize)]
pub struct Totals {
    /// GPU-hours.
    pub gpu_hours: f64,
    /// Wall-clock along the critical path.
    pub wall_hours: f64,
    /// USD.
    pub cost: f64,
    /// Bytes the stages still to run will write.
    pub storage_bytes: f64,
    /// Bytes already stored by done stages.
    pub stored_bytes: f64,
}

/// The whole estimate.
#[derive(Clone, Debug, Serialize)]
pub struct Estimate {
    /// Pipeline name.
    pub pipeline: String,
    /// `--gpus`.
    pub hardware: String,
    /// USD per GPU-hour.
    pub price: f64,
    /// Per stage, in run order.
    pub stages: Vec<StageEstimate>,
    /// Totals.
    pub totals: Totals,
    /// Stage ids on the longest wall-clock path.
    pub critical_path: Vec<String>,
    /// Alternatives.
    pub alternatives: Vec<Alternative>,
    /// Infeasible or risky plans.
    pub warnings: Vec<String>,
    /// The throughput table used.
    pub assumptions: Assumptions,
}

/// Size the pipeline. Reads manifests; writes nothing.
pub async fn estimate(
    pipeline: &Pipeline,
    graph: &Graph,
    registry: &Registry,
    store: &Store,
    hashes: &HashCache,
    opts: &Options,
) -> Result<Estimate, StoreError> {
    let plan = crate::plan::plan(pipeline, graph, registry, store, hashes).await?;
    let mut manifests: HashMap<String, Manifest> = HashMap::new();
    for line in &plan {
        if line.state == crate::plan::State::Done
            && let Some(key) = line.key
            && let Some(m) = store.manifest(&key).await?
        {
            manifests.insert(line.id.clone(), m);
        }
    }
    // Earlier generate artifacts measured how fast a model's servers answered.
    let mut generated = Vec::new();
    for key in store.keys().await? {
        if let Some(m) = store.manifest(&key).await?
            && m.fingerprint.kind == "generate"
        {
            generated.push(m);
        }
    }
    let mut assumptions = opts.assumptions.clone();
    let mut sizer = stages::Sizer {
        opts,
        assumptions: &mut assumptions,
        generated: &generated,
        warnings: Vec::new(),
        alternatives: Vec::new(),
    };
    let n = pipeline.stages.len();
    let mut out: Vec<Option<StageEstimate>> = vec![None; n];
    // Stages with the same kind, params and (recursively) inputs have one key: the runtime
    // does their work once (a sweep's variant equal to a stage beside it), so it is counted once.
    let mut work: Vec<String> = vec![String::new(); n];
    let mut first_of: HashMap<String, usize> = HashMap::new();
    for &i in &graph.order {
        let spec = &pipeline.stages[i];
        let ups: Vec<&Data> = graph.inputs[i]
            .iter()
            .map(|&u| &out[u].as_ref().expect("upstream sized first").data)
            .collect();
        let state = plan
            .iter()
            .find(|l| l.id == spec.id)
            .map_or(crate::plan::State::Pending, |l| l.state);
        let up_kinds: Vec<&str> = graph.inputs[i]
            .iter()
            .map(|&u| pipeline.stages[u].kind.as_str())
            .collect();
        let mut sized = sizer.size(spec, &ups, &up_kinds, state, manifests.get(&spec.id));
        let inputs: Vec<&str> = graph.inputs[i].iter().map(|&u| work[u].as_str()).collect();
        work[i] = blake3::hash(
            format!(
                "{}\u{0}{}\u{0}{}",
                spec.kind,
                spec.params,
                inputs.join("\u{0}")
            )
            .as_bytes(),
        )
        .to_hex()
        .to_string();
        match first_of.get(&work[i]) {
            Some(&j) if sized.state != "done" => {
                sized.gpu_hours = 0.0;
                sized.cost = 0.0;
                sized.wall_hours = Some(0.0);
                sized.storage_bytes = None;
                sized.notes.push(format!(
                    "the same work as `{}` (one key): done once",
                    pipeline.stages[j].id
                ));
            }
            _ => {
                first_of.entry(work[i].clone()).or_insert(i);
            }
        }
        out[i] = Some(sized);
    }
    let (warnings, alternatives) = (sizer.warnings, sizer.alternatives);
    let stages: Vec<StageEstimate> = graph
        .order
        .iter()
        .map(|&i| out[i].clone().expect("sized"))
        .collect();

    // The critical path: the longest chain of wall-clock through the DAG, where GPU stages
    // also wait for each other (the runtime runs one at a time: `StageKind::uses_accelerator`),
    // so a GPU stage may follow the one before it on the GPU rather than an input.
    let mut finish = vec![0.0f64; n];
    let mut via: Vec<Option<usize>> = vec![None; n];
    let mut gpu_free: (f64, Option<usize>) = (0.0, None);
    for &i in &graph.order {
        let own = out[i].as_ref().and_then(|s| s.wall_hours).unwrap_or(0.0);
        let spec = &pipeline.stages[i];
        let on_gpu = out[i]
            .as_ref()
            .is_some_and(|s| matches!(s.resource, Resource::Gpu) && s.state != "done")
            && registry
                .get(&spec.kind)
                .is_some_and(|k| k.uses_accelerator(&spec.params));
        let (mut start, mut from) = graph.inputs[i]
            .iter()
            .map(|&u| (finish[u], Some(u)))
            .fold((0.0, None), |a, b| if b.0 > a.0 { b } else { a });
        if on_gpu && gpu_free.0 > start {
            (start, from) = gpu_free;
        }
        finish[i] = start + own;
        via[i] = from;
        if on_gpu {
            gpu_free = (finish[i], Some(i));
        }
    }
    let mut path = Vec::new();
    let mut at = (0..n).max_by(|&a, &b| finish[a].total_cmp(&finish[b]));
    while let Some(i) = at {
        path.push(pipeline.stages[i].id.clone());
        at = via[i];
    }
    path.reverse();
    let wall = finish.iter().copied().fold(0.0, f64::max);
    let pending = |s: &&StageEstimate| s.state != "done";
    let totals = Totals {
        gpu_hours: stages.iter().filter(pending).map(|s| s.gpu_hours).sum(),
        wall_hours: wall,
        cost: stages.iter().filter(pending).map(|s| s.cost).sum(),
        storage_bytes: stages
            .iter()
            .filter(pending)
            .filter_map(|s| s.storage_bytes.map(|f| f.value))
            .sum(),
        stored_bytes: stages
            .iter()
            .filter(|s| s.state == "done")
            .filter_map(|s| s.storage_bytes.map(|f| f.value))
            .sum(),
    };
    let mut warnings = warnings;
    if totals.storage_bytes > opts.max_storage {
        warnings.push(format!(
            "the plan writes {} to the store, over the limit of {} (--max-storage)",
            render::bytes(totals.storage_bytes),
            render::bytes(opts.max_storage)
        ));
    }
    if let Some(b) = opts.budget_hours
        && wall > b
    {
        warnings.push(format!(
            "the plan takes {} of wall-clock, over the budget of {} (--budget)",
            render::hours(wall),
            render::hours(b)
        ));
    }
    Ok(Estimate {
        pipeline: pipeline.name.clone(),
        hardware: opts.hardware.to_string(),
        price: opts.price,
        stages,
        totals,
        critical_path: path,
        alternatives,
        warnings,
        assumptions,
    })
}
