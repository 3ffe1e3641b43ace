//! The bench loop: load the target, the drafters and the prompt sets; decode every prompt with
//! every method, interleaved per prompt (so drift in the machine's speed hits them alike); a
//! shard per four prompts and one per set, committed as they finish, so a rerun after a crash,
//! here or on another machine reading the same store, redoes only unfinished prompts; the
//! results in `results.json`, the manifest and a table.

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use dflash_model::nn::speculative::{self, Decoded, Proposer, Settings};
use dflash_model::nn::{Drafter, DrafterConfig, Target};
use dflash_stage_api::tokens;
use dflash_stage_api::{Input, StageContext, StageError, StageLog, StageOutput};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::Params;
use crate::report;
use crate::sets::{self, PromptSet, Rendering};

fn nn(what: &str) -> impl Fn(candle_core::Error) -> StageError + '_ {
    move |e| StageError::new(format!("{what}: {e}"))
}

/// One method's figures on one set.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MethodResult {
    /// Prompts decoded.
    pub prompts: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Seconds, prefill included.
    pub seconds: f64,
    /// Output tokens per second.
    pub tokens_per_second: f64,
    /// Mean tokens committed per verification round, the target's own token included.
    pub tau: f64,
    /// Per block position k = 1..B-1: the share of rounds whose proposal at k was accepted.
    pub acceptance: Vec<f64>,
    /// Tokens per second over autoregressive decoding's on the same prompts.
    pub speedup: f64,
    /// Under greedy decoding: prompts whose output equals autoregressive decoding's.
    pub identical: Option<u64>,
    /// Verification rounds.
    pub rounds: u64,
    /// Tokens the rounds committed.
    pub committed: u64,
    /// Milliseconds a round spent proposing (the drafter's pass, a tree's building, prompt
    /// lookup's search), mean over rounds; absent in results from before it was measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub propose_ms_per_round: Option<f64>,
    /// Milliseconds a round spent verifying (the target's pass and what follows), mean.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify_ms_per_round: Option<f64>,
    /// The tau at which this method's rounds would decode as fast as autoregressive decoding:
    /// its round time over the target's own step (autoregressive decoding's round). Above it
    /// the method speeds decoding up; its tau against this says by how much it misses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub break_even_tau: Option<f64>,
    /// A multi-turn set's figures turn by turn (MT-Bench's second turns restate the first,
    /// which prompt lookup copies: its tau there is another story than on first turns).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub by_turn: Vec<TurnResult>,
}

/// One turn's figures over a set's prompts.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TurnResult {
    /// Prompts that have this turn.
    pub prompts: u64,
    /// Tokens committed per verification round.
    pub tau: f64,
    /// Output tokens per second, prefill included.
    pub tokens_per_second: f64,
    /// Verification rounds.
    pub rounds: u64,
    /// Tokens the rounds committed.
    pub committed: u64,
}

/// Running totals for one method on one set: its figures summed turn by turn, and its prompts.
#[derive(Default)]
struct Totals {
    prompts: u64,
    identical: u64,
    /// Per turn: the figures summed and the prompts that had it.
    by_turn: Vec<(Figures, u64)>,
}

/// What one turn's decode adds to its method's totals (and, summed, the totals).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct Figures {
    tokens: u64,
    seconds: f64,
    rounds: u64,
    committed: u64,
    accepted_at: Vec<u64>,
    decode_seconds: f64,
    propose_seconds: f64,
}

impl Figures {
    fn add(&mut self, d: &Figures) {
        self.tokens += d.tokens;
        self.seconds += d.seconds;
        self.rounds += d.rounds;
        self.committed += d.committed;
        self.decode_seconds += d.decode_seconds;
        self.propose_seconds += d.propose_seconds;
        if self.accepted_at.len() < d.accepted_at.len() {
            self.accepted_at.resize(d.accepted_at.len(), 0);
        }
        for (t, a) in self.accepted_at.iter_mut().zip(&d.accepted_at) {
            *t += a;
        }
    }
}

impl From<&Decoded> for Figures {
    fn from(d: &Decoded) -> Self {
        Self {
            tokens: d.tokens.len() as u64,
            seconds: d.prefill_seconds + d.decode_seconds,
            rounds: d.rounds,
            committed: d.committed,
            accepted_at: d.accepted_at.clone(),
            decode_seconds: d.decode_seconds,
            propose_seconds: d.propose_seconds,
        }
    }
}

/// Prompts committed to the store together, as one shard (`prompts/<set>/<first>.json` in the
/// artifact): a set cut short loses at most this many prompts' work on another machine.
const PROMPTS_A_COMMIT: usize = 4;

/// One prompt done, every method: its lines for `sets/<set>.jsonl`, and per method (in order)
/// each turn's figures and whether its output equals autoregressive decoding's. Kept in the
/// stage's resume folder as soon as the prompt is done, so a set cut short (Ctrl-C, a call's
/// time limit) resumes at its next prompt rather than its first, and committed to the store
/// [`PROMPTS_A_COMMIT`] prompts at a time, so the resume outlives the machine.
#[derive(Debug, Serialize, Deserialize)]
struct PromptDone {
    lines: String,
    methods: Vec<(Vec<Figures>, bool)>,
    /// Per method: whether a repeat's output differed from its first (`repeats` above 1).
    #[serde(default)]
    differed: Vec<bool>,
}

impl PromptDone {
    /// What an earlier attempt kept for this prompt, if it is whole and for these methods.
    fn read(path: &std::path::Path, methods: usize) -> Option<Self> {
        let done: Self = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
        (done.methods.len() == methods).then_some(done)
    }

    /// The prompts of group shard `shard` (file `file` in it), committed by an earlier attempt:
    /// `len` of them, each for the `methods` asked for.
    fn read_group(
        ctx: &StageContext<'_>,
        shard: &str,
        file: &str,
        (len, methods): (usize, usize),
    ) -> Result<Vec<Self>, StageError> {
        let group: Vec<Self> = serde_json::from_slice(&ctx.shards.read(shard, file)?)
            .map_err(|e| StageError::new(format!("shard {shard} is unreadable: {e}")))?;
        if group.len() != len || group.iter().any(|d| d.methods.len() != methods) {
            return Err(StageError::new(format!(
                "shard {shard} holds {} prompts where {len} were asked for",
                group.len()
            )));
        }
        Ok(group)
    }

    /// Commit `group` to the store as shard `shard` (file `file`) as soon as it is done: a run
    /// cut on a machine whose resume folder is then lost (a rented GPU, a CI runner) resumes
    /// from here on any machine that reads the store.
    fn commit_group(
        ctx: &StageContext<'_>,
        shard: &str,
        file: &str,
        group: &[Self],
    ) -> Result<(), StageError> {
        let root = ctx.scratch_dir.join(format!("shard-{shard}"));
        let path = root.join(file);
        std::fs::create_dir_all(path.parent().expect("under root"))?;
        std::fs::write(&path, serde_json::to_vec(group).expect("json"))?;
        ctx.shards.commit(shard, &root)?;
        let _ = std::fs::remove_dir_all(&root);
        Ok(())
    }

    /// Keep it: written aside, then renamed, so a kill mid-write leaves no half file.
    fn write(&self, path: &std::path::Path) -> std::io::Result<()> {
        let aside = path.with_extension("part");
        std::fs::write(&aside, serde_json::to_vec(self).expect("json"))?;
        std::fs::rename(&aside, path)
    }
}

impl Totals {
    /// A prompt done, every turn of it: `same` when each equals autoregressive decoding's.
    fn prompt_done(&mut self, same: bool) {
        self.prompts += 1;
        self.identical += u64::from(same);
    }

    /// Turn `turn` of a prompt decoded.
    fn turn_done(&mut self, turn: usize, f: &Figures) {
        if self.by_turn.len() <= turn {
            self.by_turn.resize_with(turn + 1, Default::default);
        }
        self.by_turn[turn].0.add(f);
        self.by_turn[turn].1 += 1;
    }

    /// Every turn's figures summed.
    fn sum(&self) -> Figures {
        let mut all = Figures::default();
        for (f, _) in &self.by_turn {
            all.add(f);
        }
        all
    }

    /// Output tokens per second, prefill included.
    fn tokens_per_second(&self) -> f64 {
        let f = self.sum();
        f.tokens as f64 / f.seconds.max(1e-9)
    }

    /// Milliseconds per round, proposing and verifying together, mean.
    fn round_ms(&self) -> f64 {
        let f = self.sum();
        f.decode_seconds * 1e3 / f.rounds.max(1) as f64
    }

    fn result(
        &self,
        reference_tps: Option<f64>,
        greedy: bool,
        step_ms: Option<f64>,
    ) -> MethodResult {
        let f = &self.sum();
        let tps = self.tokens_per_second();
        let rounds = f.rounds.max(1) as f64;
        MethodResult {
            prompts: self.prompts,
            output_tokens: f.tokens,
            seconds: f.seconds,
            tokens_per_second: tps,
            tau: f.committed as f64 / rounds,
            acceptance: f.accepted_at.iter().map(|&a| a as f64 / rounds).collect(),
            speedup: reference_tps.map_or(1.0, |r| tps / r.max(1e-9)),
            identical: greedy.then_some(self.identical),
            rounds: f.rounds,
            committed: f.committed,
            propose_ms_per_round: Some(f.propose_seconds * 1e3 / rounds),
            verify_ms_per_round: Some((f.decode_seconds - f.propose_seconds) * 1e3 / rounds),
            break_even_tau: step_ms
                .filter(|s| *s > 0.0 && f.rounds > 0)
                .map(|s| self.round_ms() / s),
            // Only where some prompt has more than one turn.
            by_turn: if self.by_turn.len() > 1 {
                self.by_turn
                    .iter()
                    .map(|(f, prompts)| TurnResult {
                        prompts: *prompts,
                        tau: f.committed as f64 / f.rounds.max(1) as f64,
                        tokens_per_second: f.tokens as f64 / f.seconds.max(1e-9),
                        rounds: f.rounds,
                        committed: f.committed,
                    })
                    .collect()
            } else {
                Vec::new()
            },
        }
    }
}

/// A method: a name and what proposes.
enum Method {
    Autoregressive,
    Ngram {
        n: usize,
        block: usize,
    },
    Drafter(std::rc::Rc<Drafter>),
    /// A drafter verified as a tree of its top `width` tokens per position, `budget` nodes,
    /// with prompt lookup's continuations grafted on when `lookup` (its n-gram) is above 0.
    DrafterTree {
        drafter: std::rc::Rc<Drafter>,
        width: usize,
        budget: usize,
        lookup: usize,
    },
}

impl Method {
    fn proposer(&self) -> Proposer<'_> {
        match self {
            Self::Autoregressive => Proposer::Autoregressive,
            Self::Ngram { n, .. } => Proposer::Ngram { n: *n },
            Self::Drafter(d) => Proposer::Drafter(d),
            Self::DrafterTree {
                drafter,
                width,
                budget,
                lookup,
            } => Proposer::DrafterTree {
                drafter,
                width: *width,
                budget: *budget,
                lookup: *lookup,
            },
        }
    }

    fn block(&self) -> usize {
        match self {
            Self::Autoregressive => 1,
            Self::Ngram { block, .. } => *block,
            Self::Drafter(d) | Self::DrafterTree { drafter: d, .. } => d.config.block_size,
        }
    }
}

/// Load a `train` artifact's exported drafter, checked against the target, its blocks `block`
/// long where given (a DFlash drafter's weights do not depend on its block; a DFlash 2 drafter's
/// convolutions do); with its training record and the block it was trained with.
fn load_drafter(
    input: &Input,
    target: &Target,
    block: Option<u64>,
) -> Result<(Drafter, Value, usize), StageError> {
    let dir = input.dir.join("drafter");
    let bad = |what: String| {
        StageError::new(format!("drafter `{}`: {what}", input.name))
            .with_help("bench takes the drafters `train` exports")
    };
    let config: Value = serde_json::from_slice(&std::fs::read(dir.join("config.json"))?)
        .map_err(|e| bad(format!("config.json: {e}")))?;
    let mut config =
        DrafterConfig::from_hf_config(&config).map_err(|e| bad(format!("config.json: {e}")))?;
    let trained = config.block_size;
    if let Some(b) = block.map(|b| b as usize)
        && b != config.block_size
    {
        if config.dflash2.is_some() {
            return Err(StageError::new(format!(
                "drafter `{}` is a DFlash 2 drafter trained with blocks of {}; `block_size` asks {b}",
                input.name, config.block_size
            ))
            .with_help("a DFlash 2 drafter runs at its own block: leave `block_size` out"));
        }
        config.block_size = b;
    }
    let tc = &target.config;
    if config.hidden != tc.hidden || config.vocab != tc.vocab {
        return Err(bad(format!(
            "hidden size {} and vocabulary {} do not fit the target's {} and {}: it was trained against another model",
            config.hidden, config.vocab, tc.hidden, tc.vocab
        )));
    }
    if let Some(l) = config.target_layers.iter().find(|&&l| l >= tc.layers) {
        return Err(bad(format!(
            "it taps layer {l}; the target has {} layers",
            tc.layers
        )));
    }
    let tensors: HashMap<String, Tensor> =
        candle_core::safetensors::load(dir.join("model.safetensors"), target.embed.device())
            .map_err(|e| bad(format!("model.safetensors: {e}")))?
            .into_iter()
            .map(|(k, t)| Ok((k, t.to_dtype(DType::F32)?)))
            .collect::<Result<_, candle_core::Error>>()
            .map_err(|e| bad(e.to_string()))?;
    let drafter = Drafter::from_tensors(config, &tensors).map_err(|e| bad(e.to_string()))?;
    let training: Value = std::fs::read(input.dir.join(tokens::TRAINING_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null);
    Ok((drafter, training, trained))
}

/// The warnings a drafter's training record raises against this bench.
fn mismatches(
    name: &str,
    training: &Value,
    p: &Params,
    pins: &[dflash_stage_api::Pin],
    sets: &[PromptSet],
) -> Vec<String> {
    let mut out = Vec::new();
    let file = |s: &str| {
        std::path::Path::new(s)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
    };
    // By content where the drafter's record has it (a renamed copy is the same target), else
    // by file name.
    let ours: serde_json::Map<String, Value> = pins
        .iter()
        .filter(|pin| pin.stands_for("target"))
        .map(|pin| (pin.name.clone(), Value::String(pin.identity.clone())))
        .collect();
    let other_target = match training["target_content"].as_object() {
        Some(theirs) if !theirs.is_empty() && !ours.is_empty() => theirs != &ours,
        _ => match (training["target"].as_str(), &p.target) {
            (Some(t), Some(b)) => file(t) != file(b),
            _ => false,
        },
    };
    if other_target
        && let Some(t) = training["target"].as_str()
        && let Some(bench_target) = &p.target
    {
        let how = if file(t) == file(bench_target) {
            " (the same name, other bytes)"
        } else {
            ""
        };
        out.push(format!(
            "drafter `{name}` was trained against `{t}`; it is benchmarked against `{bench_target}`{how}"
        ));
    }
    let trained = training["data"].as_array().and_then(|d| {
        d.iter()
            .map(|d| &d["template_kwargs"])
            .find(|k| !k.is_null())
    });
    if let Some(trained) = trained {
        for s in sets.iter().filter(|s| !s.template_kwargs.is_null()) {
            if &s.template_kwargs != trained {
                out.push(format!(
                    "drafter `{name}` was trained on data rendered with template_kwargs {trained}; set `{}` is rendered with {}: thinking mode at training and at serving must match, or acceptance collapses",
                    s.name, s.template_kwargs
                ));
            }
        }
    }
    out
}

/// Bench; see the module docs.
pub fn run(ctx: &StageContext<'_>, p: &Params) -> Result<StageOutput, StageError> {
    if !p.endpoints.is_empty() {
        return run_endpoints(ctx, p);
    }
    let Some(target_path) = &p.target else {
        return Err(StageError::new(
            "bench needs `target:` (a GGUF file or model folder, decoded in process) or `endpoints:` (running servers)",
        ));
    };
    let device = dflash_model::nn::device::select(&p.device)?;
    let path = ctx.cwd.join(target_path);
    let target = Target::load(&path, &device).map_err(nn("loading the target"))?;
    let mut log = StageLog::open(ctx.log_path).ok();
    let mut say = |line: &str| {
        if let Some(l) = log.as_mut() {
            l.line(line);
        }
    };
    // A target without a tokenizer can still run token sets (no stop tokens, no text).
    let mut rendering = match Rendering::load(&path, &p.template_kwargs) {
        Ok(r) => Some(r),
        Err(e) => {
            say(&format!("no tokenizer or chat template in the target: {e}"));
            None
        }
    };
    let mut drafters = Vec::new();
    let mut set_inputs = Vec::new();
    let mut warnings = Vec::new();
    for input in ctx.inputs {
        if sets::is_drafter(input) {
            let (drafter, training, trained) = load_drafter(input, &target, p.block_size)?;
            if trained != drafter.config.block_size {
                warnings.push(format!(
                    "drafter `{}` was trained with blocks of {trained}; it runs with blocks of {} (`block_size`): positions past {trained} propose what it never learned",
                    input.name, drafter.config.block_size
                ));
            }
            drafters.push((input.name.clone(), (drafter, training)));
        } else {
            set_inputs.push(input);
        }
    }
    let formats = formats(p, &set_inputs)?;
    let mut prompt_sets = Vec::new();
    for (input, format) in set_inputs.iter().zip(&formats) {
        prompt_sets.push(sets::read_set(
            input,
            p.prompts as usize,
            rendering.as_mut(),
            &p.template_kwargs,
            format,
        )?);
    }
    if prompt_sets.iter().all(|s| s.prompts.is_empty()) {
        return Err(StageError::new("no prompts to benchmark on").with_help(
            "give bench prompt sets as inputs: `download` (MT-Bench, HumanEval, GSM8K), `mix` or `tokenize` stages",
        ));
    }
    for (name, (_, training)) in &drafters {
        warnings.extend(mismatches(name, training, p, ctx.pins, &prompt_sets));
    }
    for w in &warnings {
        say(&format!("warning: {w}"));
    }
    let block = p.block_size.map_or_else(
        || {
            drafters
                .first()
                .map_or(16, |(_, (d, _))| d.config.block_size)
        },
        |b| b as usize,
    );
    let mut methods: Vec<(String, Method)> =
        vec![("autoregressive".into(), Method::Autoregressive)];
    if p.baselines.iter().any(|b| b == "ngram") {
        methods.push((
            "ngram".into(),
            Method::Ngram {
                n: p.ngram.max(1) as usize,
                block: block.max(2),
            },
        ));
    }
    // Each drafter verified as a chain (its greedy block), a tree, a tree with prompt
    // lookup's guess grafted on, or several side by side.
    let forms: &[&str] = match p.verify.as_str() {
        "tree" => &["tree"],
        "tree+lookup" => &["tree+lookup"],
        "both" => &["chain", "tree"],
        "all" => &["chain", "tree", "tree+lookup"],
        _ => &["chain"],
    };
    for (name, (d, _)) in drafters {
        let d = std::rc::Rc::new(d);
        for &form in forms {
            let tree = |lookup: usize| Method::DrafterTree {
                drafter: d.clone(),
                width: p.tree_width.max(1) as usize,
                budget: p.tree_budget.max(2) as usize,
                lookup,
            };
            methods.push(match form {
                "chain" => (name.clone(), Method::Drafter(d.clone())),
                "tree" => (format!("{name}+tree"), tree(0)),
                _ => (format!("{name}+{form}"), tree(p.ngram.max(1) as usize)),
            });
        }
    }
    let stop = rendering
        .as_ref()
        .map(|r| r.stop().to_vec())
        .unwrap_or_default();
    let settings = |m: &Method, i: usize| Settings {
        block_size: m.block(),
        max_new_tokens: p.max_new_tokens as usize,
        temperature: p.temperature,
        seed: p.seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        stop: stop.clone(),
        profile: false,
    };
    let greedy = p.temperature <= 0.0;

    // Warm up (allocations, caches) so the first method timed pays no first-call costs.
    if let Some(first) = prompt_sets.iter().find_map(|s| s.prompts.first()) {
        for (_, m) in &methods {
            let mut s = settings(m, 0);
            s.max_new_tokens = s.max_new_tokens.min(4);
            speculative::decode(&target, &m.proposer(), &first.ids, &s).map_err(nn("warm-up"))?;
        }
    }

    let done = ctx.shards.done();
    let total: u64 = prompt_sets
        .iter()
        .map(|s| s.prompts.len() as u64)
        .sum::<u64>()
        * methods.len() as u64;
    let mut finished = 0u64;
    let mut results: serde_json::Map<String, Value> = serde_json::Map::new();
    let asked = Asked {
        target: &target,
        methods: &methods,
        greedy,
        repeats: p.repeats.max(1) as usize,
    };
    for set in &prompt_sets {
        let shard = format!("set-{}", set.name);
        let summary_file = format!("sets/{}.json", set.name);
        if done.contains(&shard) {
            let bytes = ctx.shards.read(&shard, &summary_file)?;
            let v: Value = serde_json::from_slice(&bytes)
                .map_err(|e| StageError::new(format!("shard {shard} is unreadable: {e}")))?;
            results.insert(set.name.clone(), v);
            finished += set.prompts.len() as u64 * methods.len() as u64;
            continue;
        }
        let mut totals: Vec<Totals> = methods.iter().map(|_| Totals::default()).collect();
        // Per method: prompts whose repeats output differently.
        let mut differed = vec![0u64; methods.len()];
        let mut lines = String::new();
        let kept = ctx.resume_dir.join(&shard);
        std::fs::create_dir_all(&kept)?;
        let mut resumed = 0usize;
        let indexed: Vec<(usize, &sets::Prompt)> = set.prompts.iter().enumerate().collect();
        for group in indexed.chunks(PROMPTS_A_COMMIT) {
            let first = group[0].0;
            let group_shard = format!("{shard}-prompts-{first:06}");
            let group_file = format!("prompts/{}/{first:06}.json", set.name);
            let group_done = if done.contains(&group_shard) {
                let stored = PromptDone::read_group(
                    ctx,
                    &group_shard,
                    &group_file,
                    (group.len(), methods.len()),
                )?;
                resumed += group.len();
                finished += (group.len() * methods.len()) as u64;
                stored
            } else {
                let mut group_done = Vec::with_capacity(group.len());
                for &(i, prompt) in group {
                    let file = kept.join(format!("prompt-{i:06}.json"));
                    let done = if let Some(kept) = PromptDone::read(&file, methods.len()) {
                        resumed += 1;
                        finished += methods.len() as u64;
                        kept
                    } else {
                        let done = asked.decode(
                            ctx,
                            prompt,
                            rendering.as_mut(),
                            &|m| settings(m, i),
                            &mut |name| {
                                finished += 1;
                                ctx.progress.set(
                                    finished,
                                    Some(total),
                                    &format!(
                                        "{}: prompt {}/{} {name}",
                                        set.name,
                                        i + 1,
                                        set.prompts.len()
                                    ),
                                );
                            },
                        )?;
                        done.write(&file)?;
                        done
                    };
                    group_done.push(done);
                }
                PromptDone::commit_group(ctx, &group_shard, &group_file, &group_done)?;
                group_done
            };
            for done in &group_done {
                for (t, (figures, same)) in totals.iter_mut().zip(&done.methods) {
                    for (turn, f) in figures.iter().enumerate() {
                        t.turn_done(turn, f);
                    }
                    t.prompt_done(*same);
                }
                for (n, &d) in differed.iter_mut().zip(&done.differed) {
                    *n += u64::from(d);
                }
                lines.push_str(&done.lines);
            }
        }
        for ((name, _), &n) in methods.iter().zip(&differed) {
            if n > 0 {
                let w = format!(
                    "{}: {name}'s repeats output different tokens on {n} of {} prompts: its decoding is not deterministic on this device, and the decode reported is each prompt's fastest",
                    set.name,
                    set.prompts.len()
                );
                say(&w);
                warnings.push(w);
            }
        }
        if resumed > 0 {
            say(&format!(
                "{}: {resumed} of {} prompts decoded by an earlier attempt, kept",
                set.name,
                set.prompts.len()
            ));
        }
        let reference_tps = totals.first().map(Totals::tokens_per_second);
        // The target's own step: autoregressive decoding's round.
        let step_ms = totals.first().map(Totals::round_ms);
        let mut by_method = serde_json::Map::new();
        for (j, ((name, _), t)) in methods.iter().zip(&totals).enumerate() {
            // The reference is identical to itself by definition: not a finding.
            let r = t.result(reference_tps, greedy && j > 0, step_ms);
            by_method.insert(name.clone(), serde_json::to_value(r).expect("json"));
        }
        let mut v = json!({"prompts": set.prompts.len(), "skipped": set.skipped,
            "template_kwargs": set.template_kwargs, "methods": by_method});
        if set.prompts.is_empty() {
            v["methods"] = json!({});
        }
        let root = ctx.scratch_dir.join(format!("shard-{shard}"));
        std::fs::create_dir_all(root.join("sets"))?;
        std::fs::write(
            root.join(&summary_file),
            serde_json::to_vec_pretty(&v).expect("json"),
        )?;
        std::fs::write(root.join(format!("sets/{}.jsonl", set.name)), lines)?;
        ctx.shards.commit(&shard, &root)?;
        let _ = std::fs::remove_dir_all(&root);
        results.insert(set.name.clone(), v);
    }

    finish(ctx, p, &results, &warnings)
}

/// What every prompt of a set is decoded with.
struct Asked<'a> {
    target: &'a Target,
    methods: &'a [(String, Method)],
    greedy: bool,
    /// Decodes of each prompt per method, the fastest kept (`repeats`).
    repeats: usize,
}

impl Asked<'_> {
    /// Decode `prompt` with every method in turn, the first (autoregressive decoding) the
    /// reference whose tokens every other must equal under greedy decoding; `each` is told as
    /// each method finishes. With `repeats` above 1 the methods take turns that many times
    /// (so a slow spell of a busy machine falls on every method alike) and each method's
    /// fastest decode is the one reported; a repeat whose output differs from the method's
    /// first is recorded (`repeats_differed`): decoding that is not deterministic.
    fn decode(
        &self,
        ctx: &StageContext<'_>,
        prompt: &sets::Prompt,
        mut rendering: Option<&mut Rendering>,
        settings: &dyn Fn(&Method) -> Settings,
        each: &mut dyn FnMut(&str),
    ) -> Result<PromptDone, StageError> {
        let mut done = PromptDone {
            lines: String::new(),
            methods: Vec::with_capacity(self.methods.len()),
            differed: Vec::with_capacity(self.methods.len()),
        };
        // Per method: its fastest decode so far, every repeat's seconds, whether a repeat's
        // output differed from its first.
        let mut best: Vec<Option<Turns>> = self.methods.iter().map(|_| None).collect();
        let mut seconds: Vec<Vec<f64>> = vec![Vec::new(); self.methods.len()];
        let mut differed = vec![false; self.methods.len()];
        for repeat in 0..self.repeats.max(1) {
            for (j, (name, m)) in self.methods.iter().enumerate() {
                let turns = decode_turns(
                    ctx,
                    self.target,
                    m,
                    prompt,
                    rendering.as_deref_mut(),
                    &settings(m),
                )?;
                let took = total_seconds(&turns);
                seconds[j].push(took);
                match &best[j] {
                    None => best[j] = Some(turns),
                    Some(kept) => {
                        differed[j] |= !same_tokens(kept, &turns);
                        if took < total_seconds(kept) {
                            best[j] = Some(turns);
                        }
                    }
                }
                if repeat + 1 == self.repeats.max(1) {
                    each(name);
                }
            }
        }
        let mut reference: Option<&Turns> = None;
        for (j, (name, _)) in self.methods.iter().enumerate() {
            let turns = best[j].as_ref().expect("decoded at least once");
            let same = reference.is_none_or(|r| same_tokens(r, turns));
            for (turn, (prompt_ids, d)) in turns.iter().enumerate() {
                let mut line = json!({"id": prompt.id, "turn": turn, "method": name,
                    "prompt_tokens": prompt_ids.len(), "output_tokens": d.tokens.len(),
                    "rounds": d.rounds, "committed": d.committed, "tau": d.tau(),
                    "seconds": d.prefill_seconds + d.decode_seconds, "stopped": d.stopped,
                    "prompt": prompt_ids, "tokens": d.tokens});
                if seconds[j].len() > 1 {
                    // Every turn's repeats together: the decode kept is the fastest whole one.
                    line["repeats_seconds"] = json!(seconds[j]);
                    line["repeats_differed"] = json!(differed[j]);
                }
                match reference {
                    None => {
                        if let Some(r) = rendering.as_deref() {
                            line["text"] = Value::String(r.decode(&d.tokens));
                        }
                    }
                    Some(r) if self.greedy => {
                        let r = r.get(turn).map(|(_, d)| &d.tokens);
                        line["identical"] = Value::Bool(r == Some(&d.tokens));
                    }
                    Some(_) => {}
                }
                done.lines.push_str(&line.to_string());
                done.lines.push('\n');
            }
            done.methods
                .push((turns.iter().map(|(_, d)| Figures::from(d)).collect(), same));
            done.differed.push(differed[j]);
            if reference.is_none() {
                reference = Some(turns);
            }
        }
        Ok(done)
    }
}

/// Each turn's prompt tokens and decode, as [`decode_turns`] returns them.
type Turns = Vec<(Vec<u32>, Decoded)>;

/// A prompt's decode time over its turns, prefill included.
fn total_seconds(turns: &Turns) -> f64 {
    turns
        .iter()
        .map(|(_, d)| d.prefill_seconds + d.decode_seconds)
        .sum()
}

/// Whether two decodes of a prompt output the same tokens turn by turn.
fn same_tokens(a: &Turns, b: &Turns) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|((_, x), (_, y))| x.tokens == y.tokens)
}

/// Decode every turn of `prompt` with `m`: the first as read, each later user turn after the
/// method's own reply to the one before is appended (z-lab's harness does the same for
/// MT-Bench). Returns each turn's prompt tokens and decode.
fn decode_turns(
    ctx: &StageContext<'_>,
    target: &Target,
    m: &Method,
    prompt: &sets::Prompt,
    mut rendering: Option<&mut Rendering>,
    s: &Settings,
) -> Result<Vec<(Vec<u32>, Decoded)>, StageError> {
    let mut out = Vec::with_capacity(1 + prompt.later.len());
    let mut messages = prompt.messages.clone();
    let mut ids = prompt.ids.clone();
    for turn in 0..=prompt.later.len() {
        if ctx.cancel.is_cancelled() {
            return Err(StageError::cancelled());
        }
        if turn > 0 {
            let Some(r) = rendering.as_deref_mut() else {
                break;
            };
            let (_, last): &(Vec<u32>, Decoded) = out.last().expect("a turn before");
            messages.push(sets::assistant(r.decode(&last.tokens)));
            messages.push(sets::user(prompt.later[turn - 1].clone()));
            ids = r.render(&messages)?;
        }
        let d = speculative::decode(target, &m.proposer(), &ids, s).map_err(nn("decoding"))?;
        out.push((std::mem::take(&mut ids), d));
    }
    Ok(out)
}

/// Each prompt set's format (`prompt_format`), checked: a preset or a template with `{prompt}`,
/// for a set that is among the inputs.
fn formats(p: &Params, sets: &[&Input]) -> Result<Vec<sets::Format>, StageError> {
    let presets = sets::preset_names;
    if let Some(name) = p
        .prompt_format
        .keys()
        .find(|k| !sets.iter().any(|s| &s.name == *k))
    {
        return Err(StageError::new(format!(
            "`prompt_format` names `{name}`, which is not a prompt set among the inputs"
        ))
        .with_help(format!(
            "its keys are the prompt sets' input names: {}",
            sets.iter()
                .map(|s| s.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    sets.iter()
        .map(|s| match p.prompt_format.get(&s.name) {
            None => Ok(sets::Format::default()),
            Some(v) => v.as_str().and_then(sets::Format::parse).ok_or_else(|| {
                StageError::new(format!(
                    "`prompt_format` of `{}` is {v}: neither a preset nor a template holding {{prompt}}",
                    s.name
                ))
                .with_help(format!(
                    "use a preset ({}) or a template such as \"Answer briefly: {{prompt}}\"",
                    presets()
                ))
            }),
        })
        .collect()
}

/// Endpoint mode ([`crate::endpoint`]).
fn run_endpoints(ctx: &StageContext<'_>, p: &Params) -> Result<StageOutput, StageError> {
    if let Some((name, _)) = p
        .endpoints
        .iter()
        .find(|(_, u)| !u.as_str().is_some_and(dflash_stage_api::is_http_url))
    {
        return Err(
            StageError::new(format!("endpoint `{name}` is not an http(s) URL"))
                .with_help("endpoints are base URLs ending in /v1, e.g. http://127.0.0.1:30000/v1"),
        );
    }
    if let Some(input) = ctx.inputs.iter().find(|i| sets::is_drafter(i)) {
        return Err(StageError::new(format!(
            "input `{}` is a drafter; in endpoint mode the servers hold the drafters",
            input.name
        )));
    }
    let inputs: Vec<&Input> = ctx.inputs.iter().collect();
    let formats = formats(p, &inputs)?;
    let mut sets = Vec::new();
    for (input, format) in inputs.iter().zip(&formats) {
        sets.push(sets::read_messages(
            input,
            p.prompts as usize,
            &p.template_kwargs,
            format,
        )?);
    }
    if sets.iter().all(|(s, _)| s.prompts.is_empty()) {
        return Err(StageError::new("no prompts to benchmark on"));
    }
    let results = crate::endpoint::run(ctx, p, &sets)?;
    finish(ctx, p, &results, &[])
}

/// Write `results.json`; the manifest's figures and the table.
fn finish(
    ctx: &StageContext<'_>,
    p: &Params,
    results: &serde_json::Map<String, Value>,
    warnings: &[String],
) -> Result<StageOutput, StageError> {
    let all = json!({"target": p.target, "endpoints": p.endpoints.keys().collect::<Vec<_>>(),
        "temperature": p.temperature, "max_new_tokens": p.max_new_tokens, "sets": results,
        "warnings": warnings});
    std::fs::write(
        ctx.out_dir.join("results.json"),
        serde_json::to_vec_pretty(&all).expect("json"),
    )?;
    let table = report::table(results, warnings);
    let mut stats = serde_json::Map::new();
    stats.insert("sets".into(), Value::Object(compact(results)));
    stats.insert("temperature".into(), json!(p.temperature));
    stats.insert("warnings".into(), json!(warnings));
    Ok(StageOutput {
        stats,
        summary: Some(table),
    })
}

/// What the manifest keeps per set and method: the figures users compare (`dflash diff` shows
/// their changes), not the counts behind them.
fn compact(results: &serde_json::Map<String, Value>) -> serde_json::Map<String, Value> {
    results
        .iter()
        .map(|(set, v)| {
            let methods: serde_json::Map<String, Value> = v["methods"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(m, r)| {
                    // Null stays null (an endpoint that reports no accept length).
                    let round = |x: &Value| x.as_f64().map(|x| (x * 1000.0).round() / 1000.0);
                    let mut o = json!({"tau": round(&r["tau"]), "speedup": round(&r["speedup"]),
                        "tokens_per_second": round(&r["tokens_per_second"]),
                        "acceptance": r["acceptance"].as_array().map(|a| a.iter().map(round).collect::<Vec<_>>())});
                    if !r["identical"].is_null() {
                        o["identical"] = r["identical"].clone();
                    }
                    for k in ["propose_ms_per_round", "verify_ms_per_round", "break_even_tau"] {
                        if !r[k].is_null() {
                            o[k] = json!(round(&r[k]));
                        }
                    }
                    if let Some(turns) = r["by_turn"].as_array() {
                        o["tau_by_turn"] =
                            json!(turns.iter().map(|t| round(&t["tau"])).collect::<Vec<_>>());
                    }
                    if !r["latency_p50"].is_null() {
                        o["latency_p50"] = json!(round(&r["latency_p50"]));
                        o["latency_p90"] = json!(round(&r["latency_p90"]));
                    }
                    (m.clone(), o)
                })
                .collect();
            (set.clone(), json!({"prompts": v["prompts"], "methods": methods}))
        })
        .collect()
}
