//! The `train` stage kind: the DFlash drafter, trained online against the frozen target.
//!
//! This crate declares the stage's params — the drafter's shape (layers, block size, tapped
//! target layers), the objective (anchors, gamma) and the recipe (epochs, AdamW, warmup + cosine,
//! clipping, accumulation, checkpoints) — so pipelines that train validate, `dflash plan`
//! explains them and `dflash estimate` sizes them. The loop ([`train_loop`]) runs the networks of
//! the shared `dflash-model` crate (candle) on CPU against a GGUF target.

pub mod pace;
mod train_loop;

use dflash_model::ModelShape;
use dflash_stage_api::{
    CheckEnv, Issue, Param, ParamType, PathSeg, Pin, Pinner, StageContext, StageError, StageKind,
    StageOutput, UpstreamOutput, tokens,
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
    /// AdamW's moments: `f32` or `bf16`.
    #[serde(default = "f32_moments")]
    pub optimizer_moments: String,
}

fn f32_moments() -> String {
    "f32".to_owned()
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

    /// Whether AdamW's moments are kept in bf16 (`optimizer_moments: bf16`).
    pub fn bf16_moments(&self) -> bool {
        self.optimizer_moments == "bf16"
    }

    /// Bytes a trainable parameter's two AdamW moments take: 8 in f32, 4 in bf16.
    pub fn moment_bytes(&self) -> f64 {
        if self.bf16_moments() { 4.0 } else { 8.0 }
    }
}

/// What the target's shape makes wrong: tapped layers it does not have, a mask token past its
/// vocabulary.
fn target_issues(params: &serde_json::Value, shape: &ModelShape, target: &str) -> Vec<Issue> {
    let mut issues = Vec::new();
    let layers = shape.layers;
    let listed: Vec<u64> = params["target_layers"]
        .as_array()
        .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
        .unwrap_or_default();
    for (i, &l) in listed.iter().enumerate() {
        if l >= layers {
            issues.push(
                Issue::new(
                    "target_layers",
                    format!("layer {l} does not exist: `{target}` has {layers} layers"),
                )
                .below(PathSeg::Index(i))
                .help(format!("`target_layers` are 0-based, below {layers}")),
            );
        } else if listed[..i].contains(&l) {
            issues.push(
                Issue::new("target_layers", format!("layer {l} is listed twice"))
                    .below(PathSeg::Index(i))
                    .help("each tapped layer feeds the drafter once"),
            );
        }
    }
    if listed.is_empty()
        && let Some(taps) = params["taps"].as_u64()
        && taps > layers
    {
        issues.push(
            Issue::new(
                "taps",
                format!("{taps} taps, but `{target}` has only {layers} layers"),
            )
            .help(format!(
                "tap at most {layers} layers (the reference taps 5)"
            )),
        );
    }
    if let Some(m) = params["mask_token_id"].as_u64()
        && m >= shape.vocab
    {
        issues.push(
            Issue::new(
                "mask_token_id",
                format!("{m} is past the target's vocabulary: `{target}` has {} tokens", shape.vocab),
            )
            .help("pick a token the data never uses, below the vocabulary size (a reserved or special token)"),
        );
    }
    issues
}

/// The keys `dflash2:` takes.
const DFLASH2_KEYS: [&str; 4] = [
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
];

/// DFlash 2's settings from the params: `None` for `head: dflash`; an error names a key that is
/// not one, or a value the target's shape rules out.
pub fn dflash2_settings(
    params: &serde_json::Value,
    hidden: u64,
    vocab: u64,
) -> Result<Option<dflash_model::Dflash2Config>, Issue> {
    let given = params["dflash2"].as_object().cloned().unwrap_or_default();
    if params["head"] != "dflash2" {
        if let Some(k) = given.keys().next() {
            return Err(Issue::new(
                "dflash2",
                format!("`{k}` is set, but `head` is not `dflash2`"),
            )
            .help("set `head: dflash2` to train a DFlash 2 drafter, or remove `dflash2:`"));
        }
        return Ok(None);
    }
    let mut c = dflash_model::Dflash2Config::for_hidden(hidden as usize);
    for (k, v) in &given {
        let n = v.as_u64().unwrap_or(0) as usize;
        match k.as_str() {
            "conv_kernel_size" => c.conv_kernel_size = n,
            "conv_group_size" => c.conv_group_size = n,
            "selector_rank" => c.selector_rank = n,
            "selector_top_k" => c.selector_top_k = n,
            _ => {
                return Err(
                    Issue::new("dflash2", format!("`{k}` is not a DFlash 2 setting"))
                        .below(PathSeg::Key(k.clone()))
                        .help(format!("the settings are {}", DFLASH2_KEYS.join(", "))),
                );
            }
        }
    }
    if let Some(problem) = c.problem(hidden as usize, vocab as usize) {
        return Err(Issue::new("dflash2", problem).help(format!(
            "the target's hidden size is {hidden}; defaults: {:?}",
            dflash_model::Dflash2Config::for_hidden(hidden as usize)
        )));
    }
    Ok(Some(c))
}

/// Where `init`'s drafter is not the one these params describe: each differing setting, by the
/// param that sets it.
fn init_issues(
    params: &serde_json::Value,
    shape: &ModelShape,
    dir: &std::path::Path,
) -> Vec<Issue> {
    let config = match read_init(dir) {
        Ok(c) => c,
        Err(e) => return vec![Issue::new("init", e).help("`init` is a drafter folder as `dflash export` writes it: drafter/config.json + model.safetensors")],
    };
    let taps: Vec<u64> = match params["target_layers"].as_array() {
        Some(a) if !a.is_empty() => a.iter().filter_map(serde_json::Value::as_u64).collect(),
        _ => dflash_model::drafter::spread_target_layers(
            shape.layers,
            params["taps"].as_u64().unwrap_or(5),
        ),
    };
    let drafter_taps: Vec<u64> = config.target_layers.iter().map(|&l| l as u64).collect();
    let dflash2 = dflash2_settings(params, shape.hidden, shape.vocab)
        .ok()
        .flatten();
    let mut differ = Vec::new();
    let mut check = |param: &str, ours: String, theirs: String| {
        if ours != theirs {
            differ.push(
                Issue::new(
                    param,
                    format!("`init`'s drafter has {theirs}, these params give {ours}"),
                )
                .help(format!(
                    "set `{param}` to match `init` (or start from a drafter of this shape)"
                )),
            );
        }
    };
    let layers = |n: u64| format!("{n} layer{}", if n == 1 { "" } else { "s" });
    check(
        "draft_layers",
        layers(params["draft_layers"].as_u64().unwrap_or(0)),
        layers(config.layers as u64),
    );
    // A DFlash drafter's weights do not depend on its block (positions are rotary, the block's
    // rows share every weight), so one trained with blocks of 8 may go on with 16; a DFlash 2
    // drafter's convolutions run over its block, so its block must stay.
    if config.dflash2.is_some() {
        check(
            "block_size",
            format!("blocks of {}", params["block_size"]),
            format!("blocks of {}", config.block_size),
        );
    }
    check(
        "target_layers",
        format!("taps {taps:?}"),
        format!("taps {drafter_taps:?}"),
    );
    check(
        "mask_token_id",
        format!("mask token {}", params["mask_token_id"]),
        format!("mask token {}", config.mask_token_id),
    );
    // A DFlash drafter may start a DFlash 2 one: its tensors are the shared ones, the
    // convolutions and the selector start where a fresh DFlash 2 drafter does (the identity),
    // so it begins decoding as the DFlash drafter did.
    if !(dflash2.is_some() && config.dflash2.is_none()) {
        check(
            "head",
            describe_head(dflash2.as_ref()),
            describe_head(config.dflash2.as_ref()),
        );
    }
    check(
        "target",
        format!("hidden size {}", shape.hidden),
        format!("hidden size {}", config.hidden),
    );
    differ
}

/// A head as messages show it.
fn describe_head(d: Option<&dflash_model::Dflash2Config>) -> String {
    match d {
        None => "head dflash".into(),
        Some(d) => format!(
            "head dflash2 (conv_kernel_size {}, conv_group_size {}, selector_rank {}, selector_top_k {})",
            d.conv_kernel_size, d.conv_group_size, d.selector_rank, d.selector_top_k
        ),
    }
}

/// The drafter config of an `init` folder (the folder itself, or one holding `drafter/`).
pub fn read_init(dir: &std::path::Path) -> Result<dflash_model::nn::DrafterConfig, String> {
    let dir = init_folder(dir);
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
    dflash_model::nn::DrafterConfig::from_hf_config(&v)
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// `dir`, or `dir/drafter` where `dir` is a whole exported artifact.
pub fn init_folder(dir: &std::path::Path) -> std::path::PathBuf {
    if !dir.join("config.json").is_file() && dir.join("drafter/config.json").is_file() {
        dir.join("drafter")
    } else {
        dir.to_path_buf()
    }
}

fn dflash2_issues(params: &serde_json::Value, shape: &ModelShape) -> Vec<Issue> {
    match dflash2_settings(params, shape.hidden, shape.vocab) {
        Ok(_) => Vec::new(),
        Err(issue) => vec![issue],
    }
}

impl StageKind for TrainKind {
    fn name(&self) -> &'static str {
        "train"
    }

    fn version(&self) -> u32 {
        // 2: writes `training.json` (the target and the data's rendering) for `bench`.
        // The target file's content entered the key (a pin) with 2 as well.
        // 3: `training.json` holds the target's content digests (`target_content`).
        // 4: the held-out (`eval` split) loss and acceptance in the metrics and stats.
        4
    }

    fn uses_accelerator(&self, _params: &serde_json::Value) -> bool {
        true
    }

    fn summary(&self) -> &'static str {
        "train a DFlash drafter online against the frozen target (CPU or CUDA; GGUF or Hugging Face targets)"
    }

    fn params(&self) -> Vec<Param> {
        let int = || ParamType::Int;
        let float = || ParamType::Float;
        vec![
            Param::new("target", ParamType::Str, "the frozen target: a `.gguf` file or a Hugging Face model folder (config.json + safetensors)").required().content(),
            Param::new("draft_layers", int(), "decoder layers of the drafter").default(5).at_least(1.0),
            Param::new("block_size", int(), "block size B: the anchor token and B-1 masked positions").default(16).at_least(2.0),
            Param::new("target_layers", ParamType::List(Box::new(int())), "target decoder layers (0-based) whose outputs feed the drafter; empty: `taps` layers spread from 1 to L-3").default(json!([])).at_least(0.0),
            Param::new("taps", int(), "how many target layers to tap when `target_layers` is empty").default(5).at_least(1.0),
            Param::new("mask_token_id", int(), "the mask token's id: a token the data never uses, below the target's vocabulary size (Qwen3: 151669)").required().at_least(0.0),
            Param::new("head", ParamType::Enum(&["dflash", "dflash2"]), "the drafter: `dflash`, or `dflash2` (DFlash 2: grouped dynamic causal convolutions around each layer's attention and MLP, and a candidate selector; exported as `DFlash2DraftModel`)").default("dflash"),
            Param::new("dflash2", ParamType::Map(Box::new(int())), "DFlash 2's settings, with `head: dflash2`: `conv_kernel_size` (4), `conv_group_size` (64, or the largest divisor of the hidden size below it), `selector_rank` (64), `selector_top_k` (8)").default(json!({})),
            Param::new("init", ParamType::Str, "start from this drafter instead of a random one: a `drafter/` folder in the reference layout (config.json + model.safetensors: dflash's export, or a published DFlash drafter), of the shape these params give (a DFlash drafter may start a `head: dflash2` one: its DFlash 2 tensors start as a fresh one's); pinned by content").content(),
            Param::new("anchors", int(), "blocks sampled per sequence, among positions whose next token is trained on").default(512).at_least(1.0),
            Param::new("gamma", float(), "loss weight decay over block positions, exp(-(k-1)/gamma) (null: 7 for B=16, 4 for B=8)").above(0.0),
            Param::new("epochs", int(), "passes over the data").default(6).at_least(1.0),
            Param::new("max_length", int(), "longer sequences are cut to this many tokens").default(3072).at_least(2.0),
            Param::new("batch_size", int(), "sequences per micro-step").default(1).at_least(1.0),
            Param::new("grad_accum", int(), "micro-steps per optimizer step").default(1).at_least(1.0),
            Param::new("lr", float(), "AdamW peak learning rate").default(6e-4).above(0.0),
            Param::new("warmup", float(), "share of steps spent warming up").default(0.04).between(0.0, 1.0),
            Param::new("schedule", ParamType::Enum(&["cosine", "constant"]), "learning-rate schedule after warmup").default("cosine"),
            Param::new("weight_decay", float(), "AdamW weight decay").default(0.0).at_least(0.0),
            Param::new("grad_clip", float(), "clip the gradients' global norm to this").default(1.0).above(0.0),
            Param::new("optimizer_moments", ParamType::Enum(&["f32", "bf16"]), "AdamW's moments: `f32`, or `bf16` (half their memory: 4.2 GB less for a 1B drafter; stepped in f32 and stored back by stochastic rounding, so the second moment's 0.1% a step is not lost; the weights stay f32)").default("f32"),
            Param::new("seed", int(), "seed for anchor sampling, data order and initialisation").default(0).at_least(0.0),
            Param::new("checkpoint_every", int(), "optimizer steps between checkpoints (operational: a resume is exact whatever it is)").default(1000).operational().at_least(1.0),
            Param::new("eval_every", int(), "optimizer steps between evaluations on the held-out sequences (the inputs' `eval` split: mix's `eval_fraction`); also before the first step and after the last (operational: the drafter is the same whatever it is)").default(200).operational().at_least(1.0),
            Param::new("eval_sequences", int(), "held-out sequences evaluated, the first of the `eval` split (0: none)").default(64).operational().at_least(0.0),
            Param::new("max_steps", int(), "stop after this many optimizer steps (null: all epochs; 0: the drafter as initialised, a baseline)").at_least(0.0),
            Param::new("device", ParamType::Enum(dflash_model::nn::device::CHOICES), "where to train").default("auto"),
        ]
    }

    fn pin(&self, params: &serde_json::Value, pinner: &dyn Pinner) -> Result<Vec<Pin>, StageError> {
        // The frozen target enters the key by content: another model under the same name
        // retrains. (A path that is not there is refused when the stage runs, with the reason.)
        let target = params["target"].as_str().unwrap_or_default();
        let mut pins = Vec::new();
        if std::path::Path::new(target).exists() {
            pins = dflash_stage_api::pin_model(
                "target",
                target,
                pinner,
                "`target:` is the frozen target: a .gguf file or a Hugging Face model folder",
            )?;
        }
        // The starting drafter, by content too.
        if let Some(init) = params["init"].as_str()
            && std::path::Path::new(init).exists()
        {
            let folder = init_folder(std::path::Path::new(init));
            pins.extend(dflash_stage_api::pin_model(
                "init",
                &folder.to_string_lossy(),
                pinner,
                "`init:` is a drafter folder: config.json + model.safetensors",
            )?);
        }
        Ok(pins)
    }

    fn check(&self, params: &serde_json::Value, env: &CheckEnv<'_>) -> Vec<Issue> {
        let mut issues = Vec::new();
        let (block, max_length) = (params["block_size"].as_u64(), params["max_length"].as_u64());
        if let (Some(b), Some(m)) = (block, max_length)
            && m <= b
        {
            issues.push(
                Issue::new("max_length", format!("{m} leaves no room for a block of {b} after an anchor"))
                    .help("`max_length` must exceed `block_size`; the story trains at 3072 with blocks of 16"),
            );
        }
        if let Some(missing) = env.must_exist(
            params,
            "target",
            "the frozen target: a .gguf file or a Hugging Face model folder",
        ) {
            issues.push(missing);
            return issues;
        }
        let target = params["target"].as_str().unwrap_or_default();
        // The target's header (GGUF metadata or config.json), never its weights.
        let shape = match ModelShape::locate(target, env.cwd) {
            Ok(s) => s,
            Err(e) => {
                let mut issue = Issue::new("target", e.message);
                if let Some(h) = e.help {
                    issue = issue.help(h);
                }
                issues.push(issue);
                return issues;
            }
        };
        issues.extend(target_issues(params, &shape, target));
        issues.extend(dflash2_issues(params, &shape));
        if let Some(missing) = env.must_exist(
            params,
            "init",
            "a drafter folder to start from (config.json + model.safetensors)",
        ) {
            issues.push(missing);
        } else if let Some(init) = params["init"].as_str() {
            issues.extend(init_issues(params, &shape, &env.path(init)));
        }
        issues
    }

    fn input_files(&self) -> &'static [&'static str] {
        &[tokens::RENDERING_FILE]
    }

    fn check_input(
        &self,
        params: &serde_json::Value,
        cwd: &std::path::Path,
        input: &UpstreamOutput<'_>,
    ) -> Vec<Issue> {
        // Tokens from another tokenizer than the target's: ids past its embedding table.
        let Some(vocab) = input
            .json(tokens::RENDERING_FILE)
            .and_then(|r| r["vocab_size"].as_u64())
        else {
            return Vec::new();
        };
        let target = params["target"].as_str().unwrap_or_default();
        let Ok(shape) = ModelShape::locate(target, cwd) else {
            return Vec::new();
        };
        if vocab <= shape.vocab {
            return Vec::new();
        }
        vec![Issue::new(
            "target",
            format!(
                "the data was tokenized with a vocabulary of {vocab} tokens, but the target `{target}` has {} embedding rows",
                shape.vocab
            ),
        )
        .help(format!(
            "tokenize `{}` with the target's own tokenizer (the same model file), or train against the model that tokenizer belongs to",
            input.stage_id
        ))]
    }

    fn run(&self, ctx: &StageContext<'_>) -> Result<StageOutput, StageError> {
        let p = Params::parse(ctx.params)?;
        train_loop::run(ctx, &p)
    }
}
