//! The `train` stage kind: the DFlash drafter, trained online against the frozen target.
//!
//! This crate declares the stage's params — the drafter's shape (layers, block size, tapped
//! target layers), the objective (anchors, gamma) and the recipe (epochs, AdamW, warmup + cosine,
//! clipping, accumulation, checkpoints) — so pipelines that train validate, `dflash plan`
//! explains them and `dflash estimate` sizes them. The loop ([`train_loop`]) runs the networks of
//! the shared `dflash-model` crate (candle) on CPU against a GGUF target.

mod train_loop;

use dflash_stage_api::{
    Param, ParamType, Pin, Pinner, StageContext, StageError, StageKind, StageOutput,
};
use serde::Deserialize;
use serde_json::json;

/// The `train` stage kind.
pub struct TrainKind;

/// The params, as the runtime resolved them (defaults filled in).
#[derive(Clone, Debug, Deserialize)]
pub struct Params {
    /// The frozen target: model folder, `.gguf` file or Hub id.
    pub target: String,
    /// Draft decoder layers.
    pub draft_layers: u64,
    /// Block size B.
    pub block_size: u64,
    /// Tapped target layers; empty: `taps` layers spread evenly.
    pub target_layers: Vec<u64>,
    /// How many target layers to tap when `target_layers` is empty.
    pub taps: u64,
    /// Anchors (blocks) sampled per sequence.
    pub anchors: u64,
    /// Passes over the data.
    pub epochs: u64,
    /// Sequences longer than this are cut.
    pub max_length: u64,
    /// Sequences per optimizer micro-step.
    pub batch_size: u64,
    /// Micro-steps per optimizer step.
    pub grad_accum: u64,
    /// Steps between checkpoints.
    pub checkpoint_every: u64,
}

impl Params {
    /// Read resolved params.
    pub fn parse(v: &serde_json::Value) -> Result<Self, StageError> {
        serde_json::from_value(v.clone())
            .map_err(|e| StageError::new(format!("bad `train` params: {e}")))
    }

    /// Sequences per optimizer step.
    pub fn sequences_per_step(&self) -> u64 {
        (self.batch_size * self.grad_accum).max(1)
    }
}

impl StageKind for TrainKind {
    fn name(&self) -> &'static str {
        "train"
    }

    fn version(&self) -> u32 {
        // 2: writes `training.json` (the target and the data's rendering) for `bench`.
        // The target file's content entered the key (a pin) with 2 as well.
        2
    }

    fn summary(&self) -> &'static str {
        "train a DFlash drafter online against the frozen target (CPU; GGUF targets)"
    }

    fn params(&self) -> Vec<Param> {
        let int = || ParamType::Int;
        let float = || ParamType::Float;
        vec![
            Param::new("target", ParamType::Str, "the frozen target: a `.gguf` file or a Hugging Face model folder (config.json + safetensors)").required(),
            Param::new("draft_layers", int(), "decoder layers of the drafter").default(5),
            Param::new("block_size", int(), "block size B: the anchor token and B-1 masked positions").default(16),
            Param::new("target_layers", ParamType::List(Box::new(int())), "target decoder layers (0-based) whose outputs feed the drafter; empty: `taps` layers spread from 1 to L-3").default(json!([])),
            Param::new("taps", int(), "how many target layers to tap when `target_layers` is empty").default(5),
            Param::new("mask_token_id", int(), "the mask token's id (null: the first id past the target's vocabulary in use)"),
            Param::new("anchors", int(), "blocks sampled per sequence, among positions whose next token is trained on").default(512),
            Param::new("gamma", float(), "loss weight decay over block positions, exp(-(k-1)/gamma) (null: 7 for B=16, 4 for B=8)"),
            Param::new("epochs", int(), "passes over the data").default(6),
            Param::new("max_length", int(), "longer sequences are cut to this many tokens").default(3072),
            Param::new("batch_size", int(), "sequences per micro-step").default(1),
            Param::new("grad_accum", int(), "micro-steps per optimizer step").default(1),
            Param::new("lr", float(), "AdamW peak learning rate").default(6e-4),
            Param::new("warmup", float(), "share of steps spent warming up").default(0.04),
            Param::new("schedule", ParamType::Enum(&["cosine", "constant"]), "learning-rate schedule after warmup").default("cosine"),
            Param::new("weight_decay", float(), "AdamW weight decay").default(0.0),
            Param::new("grad_clip", float(), "clip the gradients' global norm to this").default(1.0),
            Param::new("seed", int(), "seed for anchor sampling, data order and initialisation").default(0),
            Param::new("checkpoint_every", int(), "optimizer steps between checkpoints (operational: a resume is exact whatever it is)").default(1000).operational(),
            Param::new("max_steps", int(), "stop after this many optimizer steps (null: all epochs)"),
            Param::new("device", ParamType::Enum(dflash_model::nn::device::CHOICES), "where to train").default("auto"),
        ]
    }

    fn pin(&self, params: &serde_json::Value, pinner: &dyn Pinner) -> Result<Vec<Pin>, StageError> {
        // The frozen target enters the key by content: another model under the same name
        // retrains. (A path that is not there is refused when the stage runs, with the reason.)
        let target = params["target"].as_str().unwrap_or_default();
        if !std::path::Path::new(target).exists() {
            return Ok(Vec::new());
        }
        dflash_stage_api::pin_model(
            target,
            pinner,
            "`target:` is the frozen target: a .gguf file or a Hugging Face model folder",
        )
    }

    fn run(&self, ctx: &StageContext<'_>) -> Result<StageOutput, StageError> {
        let p = Params::parse(ctx.params)?;
        train_loop::run(ctx, &p)
    }
}
