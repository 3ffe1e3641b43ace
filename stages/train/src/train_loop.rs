//! The training loop: token sequences from the `tokenize` artifact, the frozen target's taps
//! computed online for each sequence, the drafter's loss summed over a step's sequences
//! (gradient accumulation), AdamW under warmup + cosine with clipping; metrics per step;
//! checkpoints committed as shards (create-only) from which a rerun resumes exactly — data
//! order and anchors are functions of (seed, position), so a checkpoint needs only the weights,
//! the moments and the step; the drafter exported in the Hugging Face layout at the end.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::time::Instant;

use candle_core::{DType, Tensor};
use dflash_model::nn::objective::{self, Batch, StepMetrics};
use dflash_model::nn::{AdamW, Drafter, DrafterConfig, Schedule, Target};
use dflash_stage_api::tokens::{self, TokenRow};
use dflash_stage_api::{StageContext, StageError, StageOutput};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use serde_json::{Value, json};

use crate::Params;
use crate::pace::Pace;

fn nn(what: &str) -> impl Fn(candle_core::Error) -> StageError + '_ {
    move |e| StageError::new(format!("{what}: {e}"))
}

/// One split (`train`, or `eval`: mix's `eval_fraction`) of every input's token files, cut to
/// `max_length`, input by input.
fn sequences(
    ctx: &StageContext<'_>,
    split: &str,
    max_length: usize,
) -> Result<Vec<TokenRow>, StageError> {
    Ok(by_input(ctx, split, max_length)?
        .into_iter()
        .flatten()
        .collect())
}

/// One split of each input's token files, a list per input.
fn by_input(
    ctx: &StageContext<'_>,
    split: &str,
    max_length: usize,
) -> Result<Vec<Vec<TokenRow>>, StageError> {
    let mut out = Vec::new();
    for input in ctx.inputs {
        let mut rows = Vec::new();
        for f in tokens::files(&input.dir, split)? {
            rows.extend(tokens::read(&f, max_length)?);
        }
        out.push(rows);
    }
    Ok(out)
}

/// The first `n` of several lists taken in turn (the first of each, then the second of each,
/// ...), so every input's held-out rows are scored, not only the first input's.
fn in_turn<T>(lists: Vec<Vec<T>>, n: usize) -> Vec<T> {
    let mut iters: Vec<_> = lists.into_iter().map(Vec::into_iter).collect();
    let mut out = Vec::new();
    while out.len() < n {
        let before = out.len();
        for it in &mut iters {
            if out.len() < n
                && let Some(row) = it.next()
            {
                out.push(row);
            }
        }
        if out.len() == before {
            break;
        }
    }
    out
}

/// What one evaluation measured, as the metrics line and the stats carry it.
fn eval_json(m: &StepMetrics, sequences: usize) -> Value {
    json!({"loss": m.loss, "accuracy": m.accuracy(), "tau": m.tau(),
        "tau_per_round": m.tau_per_round(), "sequences": sequences})
}

/// A 64-bit mix of the seed and a position (SplitMix64's finaliser), for per-sequence streams.
fn mix(seed: u64, a: u64, b: u64) -> u64 {
    let mut z =
        seed ^ a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The sequence at global position `i` (epoch `i / n`, shuffled per epoch by the seed).
fn order(seed: u64, n: usize, epoch: u64) -> Vec<usize> {
    let mut o: Vec<usize> = (0..n).collect();
    o.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(mix(
        seed, epoch, 0,
    )));
    o
}

const CKPT: &str = "ckpt-";

/// The drafter in the folder `init` (the reference layout), as the f32 weights training
/// updates; its config must be `config` (the check at plan time says which param differs),
/// or `config` without DFlash 2: a DFlash drafter starting a DFlash 2 one, whose convolutions
/// and selector then start as a fresh DFlash 2 drafter's (`seed`), the identity. A DFlash
/// drafter may have been trained with another block: its weights do not depend on it. With the
/// block it was trained with.
fn start_from(
    init: &std::path::Path,
    config: &DrafterConfig,
    seed: u64,
    device: &candle_core::Device,
) -> Result<(Drafter, usize), StageError> {
    let mut theirs = crate::read_init(init).map_err(StageError::new)?;
    let trained = theirs.block_size;
    if theirs.dflash2.is_none() {
        theirs.block_size = config.block_size;
    }
    let upgrade = theirs.dflash2.is_none()
        && config.dflash2.is_some()
        && theirs
            == DrafterConfig {
                dflash2: None,
                ..config.clone()
            };
    if &theirs != config && !upgrade {
        return Err(StageError::new(format!(
            "`init`'s drafter is not the one these params give: it has {} layers, taps {:?}, blocks of {}, hidden size {}",
            theirs.layers, theirs.target_layers, theirs.block_size, theirs.hidden
        ))
        .with_help("set `draft_layers`, `target_layers`, `block_size`, `mask_token_id` and `head` as the drafter was trained"));
    }
    let folder = crate::init_folder(init);
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(&folder)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(StageError::new(format!(
            "`init`: no .safetensors file in {}",
            folder.display()
        )));
    }
    for f in files {
        for (name, t) in candle_core::safetensors::load(&f, device).map_err(nn("reading `init`"))? {
            tensors.insert(name, t.to_dtype(DType::F32).map_err(nn("reading `init`"))?);
        }
    }
    if upgrade {
        let fresh = Drafter::init(config.clone(), seed, DType::F32, device)
            .map_err(nn("initialising DFlash 2's tensors"))?;
        for (name, var) in &fresh.vars {
            tensors
                .entry(name.clone())
                .or_insert_with(|| var.as_tensor().clone());
        }
    }
    let drafter = Drafter::from_tensors(config.clone(), &tensors).map_err(nn("`init`"))?;
    Ok((drafter, trained))
}

/// Train; see the module docs.
pub fn run(ctx: &StageContext<'_>, p: &Params) -> Result<StageOutput, StageError> {
    let raw = ctx.params;
    let device = dflash_model::nn::device::select(raw["device"].as_str().unwrap_or("auto"))?;
    dflash_model::nn::fused::prepare_device(&device).map_err(nn("preparing the GPU"))?;
    let path = ctx.cwd.join(&p.target);
    if !path.exists() {
        return Err(StageError::new(format!("the target `{}` does not exist", p.target))
            .with_help("point `target:` at a .gguf file or a Hugging Face model folder (config.json + safetensors)"));
    }
    let mut target = Target::load(&path, &device).map_err(nn("loading the target"))?;
    // A copy: `target` is trimmed below, after the taps are known.
    let tc = target.config.clone();
    let taps: Vec<usize> = if p.target_layers.is_empty() {
        dflash_model::drafter::spread_target_layers(tc.layers as u64, p.taps)
            .into_iter()
            .map(|l| l as usize)
            .collect()
    } else {
        p.target_layers.iter().map(|&l| l as usize).collect()
    };
    if let Some(bad) = taps.iter().find(|&&l| l >= tc.layers) {
        return Err(StageError::new(format!(
            "target layer {bad} does not exist: the target has {} layers",
            tc.layers
        ))
        .with_help(format!("`target_layers` are 0-based, below {}", tc.layers)));
    }
    // Training only taps the target: the layers past the last tap never run.
    target.keep_layers_for(&taps);
    let mask_token =
        match raw["mask_token_id"].as_u64() {
            Some(m) if (m as usize) < tc.vocab => m as u32,
            Some(m) => {
                return Err(StageError::new(format!(
                    "mask_token_id {m} is past the embedding table ({} rows)",
                    tc.vocab
                )));
            }
            None => return Err(StageError::new(
                "`mask_token_id` is needed: this target has no unused embedding row to default to",
            )
            .with_help("set `mask_token_id:` to a token the data never uses (Qwen3: 151669)")),
        };
    let block = p.block_size as usize;
    if block < 2 {
        return Err(StageError::new("`block_size` must be at least 2"));
    }
    let gamma = raw["gamma"]
        .as_f64()
        .unwrap_or_else(|| objective::default_gamma(block));
    let data = sequences(ctx, "train", p.max_length as usize)?;
    // Held-out sequences (the mix's `eval` split, never trained on), at most `eval_sequences`:
    // the drafter's loss and acceptance on them, next to training's, show when it starts to
    // learn its data by heart (more epochs of the same rows) rather than the target.
    // Taken from the inputs in turn: an expansion's own held-out rows count beside the first
    // batch's.
    let held = in_turn(
        by_input(ctx, "eval", p.max_length as usize)?,
        raw["eval_sequences"].as_u64().unwrap_or(64) as usize,
    );
    let eval_every = raw["eval_every"].as_u64().unwrap_or(200).max(1);
    if data.is_empty() {
        return Err(StageError::new(
            "no training sequences in the inputs' `train` split",
        ));
    }
    let seed = raw["seed"].as_u64().unwrap_or(0);
    let per_step = p.sequences_per_step() as usize;
    let mut total = (data.len() as u64 * p.epochs).div_ceil(per_step as u64);
    if let Some(m) = raw["max_steps"].as_u64() {
        total = total.min(m);
    }
    let schedule = Schedule {
        peak: raw["lr"].as_f64().unwrap_or(6e-4),
        warmup: (raw["warmup"].as_f64().unwrap_or(0.04) * total as f64).ceil() as u64,
        total,
        cosine: raw["schedule"] != "constant",
    };
    let clip = raw["grad_clip"].as_f64().unwrap_or(1.0);
    let mut config = DrafterConfig::for_target(
        &tc,
        p.draft_layers as usize,
        taps.clone(),
        block,
        mask_token,
    );
    config.dflash2 = crate::dflash2_settings(raw, tc.hidden as u64, tc.vocab as u64)
        .map_err(|issue| StageError::new(issue.message.clone()))?;

    // Resume from the latest checkpoint an earlier attempt committed.
    let mut done: Vec<String> = ctx
        .shards
        .done()
        .into_iter()
        .filter(|n| n.starts_with(CKPT))
        .collect();
    done.sort();
    let mut metrics_lines: Vec<String> = Vec::new();
    for name in &done {
        let text = String::from_utf8(ctx.shards.read(name, &format!("{name}/metrics.jsonl"))?)
            .unwrap_or_default();
        metrics_lines.extend(text.lines().map(str::to_owned));
    }
    let weight_decay = raw["weight_decay"].as_f64().unwrap_or(0.0);
    // AdamW's moments: f32, or bf16 (half their memory, stochastic rounding) on request.
    let moments = if p.bf16_moments() {
        DType::BF16
    } else {
        DType::F32
    };
    let (drafter, mut adam, start) = match done.last() {
        Some(name) => {
            let bytes = ctx
                .shards
                .read(name, &format!("{name}/state.safetensors"))?;
            let tensors: HashMap<String, Tensor> =
                candle_core::safetensors::load_buffer(&bytes, &device)
                    .map_err(nn("reading the checkpoint"))?;
            let step: u64 = name[CKPT.len()..]
                .parse()
                .map_err(|_| StageError::new(format!("bad checkpoint name `{name}`")))?;
            let weights: HashMap<String, Tensor> = tensors
                .iter()
                .filter_map(|(k, t)| k.strip_prefix("param.").map(|n| (n.to_owned(), t.clone())))
                .collect();
            let d =
                Drafter::from_tensors(config.clone(), &weights).map_err(nn("the checkpoint"))?;
            let mut a =
                AdamW::with_moments(&d.vars, weight_decay, moments).map_err(nn("optimizer"))?;
            a.restore(&tensors, step).map_err(nn("the checkpoint"))?;
            if let Ok(mut log) = dflash_stage_api::StageLog::open(ctx.log_path) {
                log.line(&format!("resuming from {name}"));
            }
            (d, a, step)
        }
        None => {
            let d = match raw["init"].as_str() {
                Some(init) => {
                    let (d, trained) = start_from(&ctx.cwd.join(init), &config, seed, &device)?;
                    if let Ok(mut log) = dflash_stage_api::StageLog::open(ctx.log_path) {
                        let block = if trained == config.block_size {
                            String::new()
                        } else {
                            format!(
                                " (trained with blocks of {trained}; it goes on with blocks of {})",
                                config.block_size
                            )
                        };
                        log.line(&format!("starting from the drafter in {init}{block}"));
                    }
                    d
                }
                None => Drafter::init(config.clone(), seed, DType::F32, &device)
                    .map_err(nn("initialising the drafter"))?,
            };
            let a = AdamW::with_moments(&d.vars, weight_decay, moments).map_err(nn("optimizer"))?;
            (d, a, 0)
        }
    };

    let n = data.len();
    let mut epoch_order: Option<(u64, Vec<usize>)> = None;
    let mut since_ckpt: Vec<String> = Vec::new();
    let mut last = StepMetrics::default();
    let embed = |t: &Tensor| target.embed(t);
    let compute = if device.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    };
    // On a GPU a micro-batch (`batch_size` sequences) is one pass: the target's and the
    // drafter's rows stacked, so every matmul, norm and MLP launches once for all of them (a
    // small target's and a drafter's step are bound by kernel launches); attention stays per
    // sequence. On CPU each sequence is its own pass, as before: stacking saves little there,
    // and a matmul over more rows may round differently, which would change CPU training's
    // bytes.
    let stack = if device.is_cuda() {
        p.batch_size.max(1) as usize
    } else {
        1
    };
    // One micro-batch's loss (normalised by `weight`, the step's total) and counts. The step
    // computes in `compute`: bf16 on a GPU (tensor cores, flash attention), f32 on CPU; the
    // drafter's weights stay f32 either way (the master copy AdamW updates).
    let context_of = |micro: &[(&TokenRow, Batch)]| {
        let ids: Vec<&[u32]> = micro.iter().map(|(s, _)| s.ids.as_slice()).collect();
        target
            .tapped_stacked(&ids, &taps)
            .and_then(|c| c.to_dtype(compute))
            .map_err(nn("target forward"))
    };
    // The held-out loss: forward only, through the drafter's weights detached (`frozen`: the
    // same storage), so no graph is recorded and no activation outlives its use.
    let forward = |frozen: &Drafter, micro: &[(&TokenRow, Batch)], weight: f64| {
        let context = context_of(micro)?;
        let packed: Vec<&Batch> = micro.iter().map(|(_, b)| b).collect();
        objective::loss_packed(
            frozen,
            &embed,
            &target.lm_head,
            &context,
            &packed,
            weight,
            objective::Head::on(context.device()),
        )
        .map_err(nn("drafter forward"))
    };
    // One micro-batch's metrics and the drafter's gradients: on a GPU the backward pass is
    // written out (`nn::written`: no autograd graph, each gradient written once), on CPU it is
    // autograd's, bit for bit as before.
    let backward = objective::Backward::on(&device, &drafter);
    // The written-out step's bf16 weights: cast once here (after `init:` or a resume set the
    // weights), then kept the updated weights' casts by AdamW, so no step casts them again.
    let kept = (backward == objective::Backward::WrittenOut)
        .then(|| objective::ComputeWeights::of(&drafter, compute))
        .transpose()
        .map_err(nn("casting the weights"))?;
    let forward_backward = |micro: &[(&TokenRow, Batch)], weight: f64| {
        let context = context_of(micro)?;
        let packed: Vec<&Batch> = micro.iter().map(|(_, b)| b).collect();
        let (_, m, grads) = objective::loss_and_gradients_packed(
            &drafter,
            kept.as_ref(),
            &embed,
            &target.lm_head,
            &context,
            &packed,
            weight,
            backward,
        )
        .map_err(nn("drafter step"))?;
        Ok::<_, StageError>((m, grads))
    };
    // A sequence's blocks, drawn from the random stream `stream`.
    let sample = |s: &TokenRow, stream: u64| {
        Batch::sample(
            &s.ids,
            &s.mask,
            p.anchors as usize,
            block,
            mask_token,
            gamma,
            stream,
        )
    };
    // The held-out sequences' blocks are drawn once, from their own stream (not the training
    // data's), so every evaluation scores the same blocks and training's draws are unchanged.
    let held_blocks: Vec<(&TokenRow, Batch)> = held
        .iter()
        .enumerate()
        .filter_map(|(i, s)| sample(s, mix(seed, i as u64, 2)).map(|b| (s, b)))
        .collect();
    let evaluate = || -> Result<Option<StepMetrics>, StageError> {
        let weight: f64 = held_blocks.iter().map(|(_, b)| b.weight()).sum();
        if weight <= 0.0 {
            return Ok(None);
        }
        let mut m = StepMetrics::default();
        let frozen = drafter.frozen();
        for micro in held_blocks.chunks(stack) {
            m.add(&forward(&frozen, micro, weight)?.1);
        }
        Ok(Some(m))
    };
    let eval_start = if start == 0 { evaluate()? } else { None };
    let mut last_eval: Option<StepMetrics> = None;
    // Wall time and tokens per step, for the progress line and the log (never the artifact).
    let mut pace = Pace::starting_at(start + 1);
    let log_pace = |pace: &mut Pace| {
        if let (Some(line), Ok(mut log)) = (
            pace.report(total),
            dflash_stage_api::StageLog::open(ctx.log_path),
        ) {
            log.line(&line);
        }
    };
    for step in start..total {
        if ctx.cancel.is_cancelled() {
            return Err(StageError::cancelled());
        }
        let step_started = Instant::now();
        let mut batches = Vec::with_capacity(per_step);
        for j in 0..per_step {
            let g = step as usize * per_step + j;
            let epoch = (g / n) as u64;
            if epoch >= p.epochs {
                break;
            }
            if epoch_order.as_ref().is_none_or(|(e, _)| *e != epoch) {
                epoch_order = Some((epoch, order(seed, n, epoch)));
            }
            let s = &data[epoch_order.as_ref().expect("set").1[g % n]];
            if let Some(b) = sample(s, mix(seed, g as u64, 1)) {
                batches.push((s, b));
            }
        }
        let weight: f64 = batches.iter().map(|(_, b)| b.weight()).sum();
        let mut grads: BTreeMap<String, Tensor> = BTreeMap::new();
        let mut m = StepMetrics::default();
        if weight > 0.0 {
            for micro in batches.chunks(stack) {
                let (sm, g) = forward_backward(micro, weight)?;
                for (name, t) in g {
                    // Summed over micro-batches in f32 (the written-out step's are bf16).
                    let sum = match grads.remove(&name) {
                        Some(prev) => prev
                            .to_dtype(DType::F32)
                            .and_then(|prev| prev + t.to_dtype(DType::F32)?)
                            .map_err(nn("accumulating"))?,
                        None => t,
                    };
                    grads.insert(name, sum);
                }
                m.add(&sm);
            }
        }
        let lr = schedule.lr(step);
        let norm = adam
            .step_keeping(
                &drafter.vars,
                &grads,
                lr,
                clip,
                kept.as_ref().map(objective::ComputeWeights::tensors),
            )
            .map_err(nn("optimizer step"))?;
        pace.step(
            step_started,
            batches.iter().map(|(s, _)| s.ids.len() as u64).sum(),
            batches.iter().map(|(_, b)| b.block_ids.len() as u64).sum(),
        );
        let s1 = step + 1;
        let mut line = json!({"step": s1, "lr": lr, "loss": m.loss, "grad_norm": norm,
            "accuracy": m.accuracy(), "tau": m.tau(), "tau_per_round": m.tau_per_round(),
            "sequences": batches.len()});
        if s1 % eval_every == 0 || s1 == total {
            let evaluating = Instant::now();
            if let Some(e) = evaluate()? {
                line["eval"] = eval_json(&e, held_blocks.len());
                last_eval = Some(e);
            }
            pace.other(evaluating);
        }
        since_ckpt.push(line.to_string());
        ctx.progress.set(
            s1,
            Some(total),
            &format!(
                "loss {:.3} tau {:.2} ({:.2} per decoding round){}",
                m.loss,
                m.tau(),
                m.tau_per_round(),
                pace.progress(total - s1)
            ),
        );
        last = m;
        if s1 % p.checkpoint_every.max(1) == 0 && s1 < total {
            let checkpointing = Instant::now();
            checkpoint(ctx, &drafter, &adam, s1, &since_ckpt)?;
            metrics_lines.append(&mut since_ckpt);
            pace.other(checkpointing);
            log_pace(&mut pace);
        }
    }
    log_pace(&mut pace);
    metrics_lines.append(&mut since_ckpt);

    // The export: the reference implementation's Hugging Face layout, bf16.
    let export = ctx.out_dir.join("drafter");
    std::fs::create_dir_all(&export)?;
    let tensors = drafter.tensors(DType::BF16).map_err(nn("export"))?;
    candle_core::safetensors::save(&tensors, export.join("model.safetensors"))
        .map_err(nn("export"))?;
    let hf = config.hf_config(&tc.family);
    std::fs::write(
        export.join("config.json"),
        serde_json::to_string_pretty(&hf).expect("json"),
    )?;
    let mut text = metrics_lines.join("\n");
    text.push('\n');
    std::fs::write(ctx.out_dir.join("metrics.jsonl"), text)?;
    std::fs::write(
        ctx.out_dir.join(tokens::TRAINING_FILE),
        serde_json::to_vec_pretty(&training_record(ctx, p)?).expect("json"),
    )?;

    let first_loss = metrics_lines
        .first()
        .and_then(|l| serde_json::from_str::<Value>(l).ok())
        .and_then(|v| v["loss"].as_f64());
    let mut stats = serde_json::Map::new();
    stats.insert("steps".into(), json!(total));
    stats.insert("sequences".into(), json!(n));
    stats.insert("trainable_parameters".into(), json!(config.parameters()));
    stats.insert("target_layers".into(), json!(taps));
    stats.insert("first_loss".into(), json!(first_loss));
    stats.insert("final_loss".into(), json!(last.loss));
    stats.insert("final_accuracy".into(), json!(last.accuracy()));
    stats.insert("final_tau".into(), json!(last.tau()));
    stats.insert("final_tau_per_round".into(), json!(last.tau_per_round()));
    // Held out: at the start (a fresh run) and after the last step, on the same blocks.
    if total == 0 {
        last_eval.clone_from(&eval_start);
    }
    if !held_blocks.is_empty() {
        let at = |m: &Option<StepMetrics>| m.as_ref().map(|m| eval_json(m, held_blocks.len()));
        stats.insert(
            "eval".into(),
            json!({"start": at(&eval_start), "end": at(&last_eval)}),
        );
    }
    let mut summary = String::new();
    let _ = write!(
        summary,
        "{total} steps over {n} sequences; loss {} -> {:.3}; tau {:.2} ({:.2} per decoding round)",
        first_loss.map_or_else(|| "?".into(), |l| format!("{l:.3}")),
        last.loss,
        last.tau(),
        last.tau_per_round(),
    );
    if let Some(e) = &last_eval {
        let _ = write!(
            summary,
            "; held out ({} sequences): loss {:.3}, tau {:.2} ({:.2} per decoding round)",
            held_blocks.len(),
            e.loss,
            e.tau(),
            e.tau_per_round()
        );
    }
    let _ = write!(
        summary,
        " (drafter {} parameters, taps {taps:?})",
        config.parameters()
    );
    Ok(StageOutput {
        stats,
        summary: Some(summary),
    })
}

/// What the drafter was trained against: the target, and how each input's rows were rendered
/// (read from the tokenize artifacts; null for token files from elsewhere).
fn training_record(ctx: &StageContext<'_>, p: &Params) -> Result<Value, StageError> {
    let mut data = Vec::new();
    for input in ctx.inputs {
        let path = input.dir.join(tokens::RENDERING_FILE);
        let rendering: Value = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            Err(_) => Value::Null,
        };
        data.push(
            json!({"input": input.name, "digest": input.digest.to_string(),
            "template_kwargs": rendering.get("template_kwargs").cloned().unwrap_or(Value::Null)}),
        );
    }
    // The target by content too (its pins, as they entered the key): `bench` compares these,
    // so a renamed copy of the same model is not reported as another target.
    let target_pins: serde_json::Map<String, Value> = ctx
        .pins
        .iter()
        .filter(|pin| pin.stands_for("target"))
        .map(|pin| (pin.name.clone(), Value::String(pin.identity.clone())))
        .collect();
    Ok(
        json!({"target": p.target, "target_content": target_pins, "block_size": p.block_size, "data": data}),
    )
}

/// Commit weights, moments and the metrics since the last checkpoint as shard `ckpt-<step>`.
fn checkpoint(
    ctx: &StageContext<'_>,
    drafter: &Drafter,
    adam: &AdamW,
    step: u64,
    metrics: &[String],
) -> Result<(), StageError> {
    // Each checkpoint's files live under its own folder in the artifact.
    let name = format!("{CKPT}{step:08}");
    let root = ctx.scratch_dir.join(format!("shard-{name}"));
    let dir = root.join(&name);
    std::fs::create_dir_all(&dir)?;
    let mut tensors: HashMap<String, Tensor> = drafter
        .tensors(DType::F32)
        .map_err(nn("checkpoint"))?
        .into_iter()
        .map(|(k, t)| (format!("param.{k}"), t))
        .collect();
    tensors.extend(adam.tensors().map_err(nn("checkpoint"))?);
    candle_core::safetensors::save(&tensors, dir.join("state.safetensors"))
        .map_err(nn("checkpoint"))?;
    let mut text = metrics.join("\n");
    text.push('\n');
    std::fs::write(dir.join("metrics.jsonl"), text)?;
    ctx.shards.commit(&name, &root)?;
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::in_turn;

    /// Held-out rows from two inputs, the second shorter: taken in turn, cut at `n`.
    #[test]
    fn held_out_rows_come_from_every_input_in_turn() {
        let lists = || vec![vec![1, 2, 3, 4], vec![10, 20]];
        assert_eq!(in_turn(lists(), 5), [1, 10, 2, 20, 3]);
        assert_eq!(in_turn(lists(), 64), [1, 10, 2, 20, 3, 4]);
        assert_eq!(in_turn(lists(), 0), Vec::<i32>::new());
        assert_eq!(in_turn(vec![vec![], vec![7]], 3), [7]);
    }
}
