//! The `bench` stage kind: drafters measured the way the papers measure them. Every prompt of
//! every prompt set is decoded by the frozen target autoregressively (the reference), with
//! prompt lookup (an n-gram drafter), and with each drafter among the inputs, by speculative
//! decoding on the same device in the same run; per set and method it reports tau (tokens
//! committed per round, bonus included), acceptance per block position, output tokens/s and the
//! speedup over autoregressive decoding, and under greedy decoding whether the output is
//! identical to the autoregressive one (it must be: verification is lossless).
//!
//! Multi-turn prompts (MT-Bench) are asked turn by turn, each later user turn after the
//! method's reply to the one before, and `prompt_format` wraps HumanEval's and GSM8K's prompts
//! in the reference harness's instructions, as z-lab's `benchmark.py` does. Each method's output
//! tokens per prompt and turn go to `sets/<set>.jsonl`, so losslessness and tau can be checked
//! from the artifact alone; `prompts/<set>/<first>.json` holds the same prompts four at a time
//! as they were committed, so a cut run resumes from the store on any machine.
//!
//! Inputs are told apart by what they hold: a `train` artifact (a `drafter/` folder) is a
//! method, anything else is a prompt set — conversations (`download`, `mix`) rendered with the
//! target's chat template and `template_kwargs`, or token files (`tokenize`), whose prompt is
//! the part before the first trained token.

mod endpoint;
mod report;
mod run;
mod sets;

use dflash_stage_api::{
    CheckEnv, Issue, Param, ParamType, PathSeg, Pin, Pinner, StageContext, StageError, StageKind,
    StageOutput,
};
use serde::Deserialize;
use serde_json::json;

/// The `bench` stage kind.
pub struct BenchKind;

/// The params, as the runtime resolved them (defaults filled in).
#[derive(Clone, Debug, Deserialize)]
pub struct Params {
    /// The frozen target, a `.gguf` file (in-process mode).
    pub target: Option<String>,
    /// Endpoint mode: running servers by name (OpenAI-compatible base URLs).
    pub endpoints: serde_json::Map<String, serde_json::Value>,
    /// The model name sent to the endpoints (null: the first one's `/v1/models`).
    pub model: Option<String>,
    /// Prompts per set (the first ones).
    pub prompts: u64,
    /// The most output tokens per prompt.
    pub max_new_tokens: u64,
    /// 0: greedy.
    pub temperature: f64,
    /// Seeds sampled decoding.
    pub seed: u64,
    /// Baselines besides autoregressive decoding.
    pub baselines: Vec<String>,
    /// The longest suffix prompt lookup matches.
    pub ngram: u64,
    /// Block size for the n-gram baseline (null: the first drafter's, else 16).
    pub block_size: Option<u64>,
    /// Passed to the chat template (e.g. `enable_thinking`).
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Per prompt set: a preset's name or a template holding `{prompt}`.
    pub prompt_format: serde_json::Map<String, serde_json::Value>,
    /// Where the in-process decoding runs.
    pub device: String,
    /// How drafters' blocks are verified: `chain`, `tree` or `both` (side by side).
    pub verify: String,
    /// Tree verification: candidates per position.
    pub tree_width: u64,
    /// Tree verification: nodes per tree, its root included.
    pub tree_budget: u64,
    /// In-process mode: decodes of each prompt per method, the fastest kept.
    pub repeats: u64,
}

impl StageKind for BenchKind {
    fn name(&self) -> &'static str {
        "bench"
    }

    fn version(&self) -> u32 {
        // 2: multi-turn sets ask each user turn after the reply to the one before; every
        // method's tokens are recorded per turn.
        2
    }

    fn uses_accelerator(&self, params: &serde_json::Value) -> bool {
        // In process it decodes the target; in endpoint mode the servers do, elsewhere.
        params["target"].is_string()
    }

    fn summary(&self) -> &'static str {
        "measure drafters by speculative decoding: tau, acceptance per position, tokens/s, speedup"
    }

    fn params(&self) -> Vec<Param> {
        let int = || ParamType::Int;
        vec![
            Param::new("target", ParamType::Str, "the frozen target the drafters were trained against: a `.gguf` file or Hugging Face model folder (in-process mode)").content(),
            Param::new("endpoints", ParamType::Map(Box::new(ParamType::Str)), "endpoint mode: running OpenAI-compatible servers by name, e.g. {plain: 'http://127.0.0.1:30000/v1', dflash: 'http://127.0.0.1:30001/v1'}; the first is the speedup's reference").default(json!({})),
            Param::new("model", ParamType::Str, "endpoint mode: the model name sent (null: what the first endpoint lists)"),
            Param::new("prompts", int(), "prompts per set (the first ones)").default(80).at_least(1.0),
            Param::new("max_new_tokens", int(), "the most output tokens per prompt").default(256).at_least(1.0),
            Param::new("temperature", ParamType::Float, "0: greedy (the papers' T = 0); above 0, sampled with lossless verification").default(0.0).at_least(0.0),
            Param::new("seed", int(), "seed for sampled decoding").default(0).at_least(0.0),
            Param::new("baselines", ParamType::List(Box::new(ParamType::Enum(&["ngram"]))), "baselines besides autoregressive decoding, which always runs: `ngram` is prompt lookup").default(json!(["ngram"])),
            Param::new("ngram", int(), "the longest suffix prompt lookup matches").default(3).at_least(1.0),
            Param::new("block_size", int(), "every method's block: prompt lookup drafts one token fewer, each DFlash drafter proposes blocks of this size (null: the first drafter's trained block, else 16). A DFlash drafter's weights do not depend on its block, so one trained at 8 runs at 16: the positions past its training propose little, but `tree+lookup` grafts prompt lookup's paths to the block's end").at_least(2.0),
            Param::new("template_kwargs", ParamType::Map(Box::new(ParamType::Any)), "passed to the chat template, e.g. {enable_thinking: false}; must match what the drafter was trained with").default(json!({})),
            Param::new("prompt_format", ParamType::Map(Box::new(ParamType::Str)), "per prompt set, how each user turn is asked: a preset of z-lab's benchmark harness (humaneval, gsm8k, math) or a template holding {prompt}, e.g. {humaneval: humaneval, gsm8k: gsm8k}; sets not named are asked as they are").default(json!({})),
            Param::new("device", ParamType::Enum(dflash_model::nn::device::CHOICES), "where the in-process decoding runs (`auto`: GPU 0 when this build and machine have one); every method runs on it").default("auto"),
            Param::new("verify", ParamType::Enum(&["chain", "tree", "tree+lookup", "both", "all"]), "how a drafter's block is verified: `chain` (its likeliest token per position), `tree` (a tree of its likeliest tokens per position, one target pass over all of it, the longest path the target agrees with committed; method `<drafter>+tree`), `tree+lookup` (that tree with up to three of prompt lookup's continuations, matching the last `ngram` tokens, grafted on as more paths within the budget; method `<drafter>+tree+lookup`), `both` (chain and tree side by side) or `all` (the three)").default("chain"),
            Param::new("tree_width", int(), "tree verification: candidates per block position (at most 32)").default(8).between(1.0, 32.0),
            Param::new("repeats", int(), "in-process mode: how many times each method decodes each prompt, the methods taking turns; the fastest decode is the one reported (a busy or shared machine slows some decodes, never speeds one up); a repeat whose output differs from the first is a warning: decoding that is not deterministic").default(1).between(1.0, 20.0),
            Param::new("tree_budget", int(), "tree verification: nodes per tree, the round's first token included (the target pass's width; on an H100 a pass over 128 tokens of SmolLM2 costs what one over 64 does, and the tree's tau rises; on a CPU a pass costs by its tokens: for SmolLM2 on two cores 8 to 16 paid best, 4 and 32 less)").default(128).at_least(2.0),
        ]
    }

    fn pin(&self, params: &serde_json::Value, pinner: &dyn Pinner) -> Result<Vec<Pin>, StageError> {
        // The target enters the key by content: another file under the same name reruns.
        // Endpoint mode has none: the servers are named by their URLs in the params.
        let Some(target) = params["target"].as_str() else {
            return Ok(Vec::new());
        };
        dflash_stage_api::pin_model(
            "target",
            target,
            pinner,
            "`target:` is the model the drafters were trained against: a .gguf file or a Hugging Face model folder",
        )
    }

    fn check(&self, params: &serde_json::Value, env: &CheckEnv<'_>) -> Vec<Issue> {
        let mut issues = Vec::new();
        let endpoints = params["endpoints"].as_object().cloned().unwrap_or_default();
        match (params["target"].as_str(), endpoints.is_empty()) {
            (None, true) => issues.push(Issue {
                at: Vec::new(),
                message: "bench has nothing to decode with".into(),
                help: Some("give `target:` (a GGUF file or model folder, decoded in process) or `endpoints:` (running servers)".into()),
            }),
            (Some(_), false) => issues.push(
                Issue::new("endpoints", "both `target:` and `endpoints:` are given; bench decodes in process or on servers, not both")
                    .help("drop `endpoints:` to decode the target in process, or `target:` to measure the servers"),
            ),
            (Some(_), true) => issues.extend(env.must_exist(
                params,
                "target",
                "the model the drafters were trained against: a .gguf file or a Hugging Face model folder",
            )),
            (None, false) => {}
        }
        if !endpoints.is_empty() && params["repeats"].as_u64().is_some_and(|r| r > 1) {
            issues.push(
                Issue::new("repeats", "repeats are for in-process decoding; with `endpoints:` the servers' prompt caches would answer a repeat faster than a first ask")
                    .help("leave `repeats` out in endpoint mode, or run more prompts (`prompts:`) for steadier figures"),
            );
        }
        for (name, url) in &endpoints {
            if !url.as_str().is_some_and(dflash_stage_api::is_http_url) {
                issues.push(
                    Issue::new(
                        "endpoints",
                        format!("endpoint `{name}` is {url}, not an http(s) URL"),
                    )
                    .below(PathSeg::Key(name.clone()))
                    .help("endpoints are base URLs ending in /v1, e.g. http://127.0.0.1:30000/v1"),
                );
            }
        }
        for (set, format) in params["prompt_format"].as_object().into_iter().flatten() {
            if !env.inputs.contains(&set.as_str()) {
                issues.push(
                    Issue::new(
                        "prompt_format",
                        format!("`{set}` is not a prompt set among the inputs"),
                    )
                    .below(PathSeg::Key(set.clone()))
                    .help(format!(
                        "its keys are the input names: {}",
                        env.inputs.join(", ")
                    )),
                );
            } else if format.as_str().and_then(sets::Format::parse).is_none() {
                issues.push(
                    Issue::new(
                        "prompt_format",
                        format!("{format} is neither a preset nor a template holding {{prompt}}"),
                    )
                    .below(PathSeg::Key(set.clone()))
                    .help(format!(
                        "use a preset ({}) or a template such as \"Answer briefly: {{prompt}}\"",
                        sets::preset_names()
                    )),
                );
            }
        }
        // A DFlash 2 drafter's convolutions run over the block it was trained with; a DFlash
        // drafter runs at any block (`block_size`'s help).
        if let Some(b) = params["block_size"].as_u64() {
            for train in env.upstream_of_kind("train") {
                if train.params["head"].as_str() == Some("dflash2")
                    && let Some(trained) = train.params["block_size"].as_u64()
                    && trained != b
                {
                    issues.push(
                        Issue::new("block_size", format!("{b}, but DFlash 2 drafter `{}` was trained with blocks of {trained}", train.id))
                            .help("a DFlash 2 drafter runs at its own block: leave `block_size` out (a DFlash drafter may run at another)"),
                    );
                }
            }
        }
        issues
    }

    fn run(&self, ctx: &StageContext<'_>) -> Result<StageOutput, StageError> {
        let p: Params = ctx.params()?;
        run::run(ctx, &p)
    }
}
