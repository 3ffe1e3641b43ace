//! One online training step of the DFlash drafter, measured — the numbers behind issue 7.
//!
//! `train_probe speed [--preset qwen3-8b|smollm2|small] [--seq 3072] [--anchors 512] [--block 16]
//! [--layers 5] [--steps 4] [--dtype bf16|f32] [--master f32|bf16] [--moments f32|bf16]
//! [--head dflash|dflash2] [--profile-step K [--profile-phase target|drafter|optim]]
//! [--backward autograd|written]`: a
//! target with random weights at the preset's
//! shape, a drafter, one random sequence; prints one JSON line per step with the target
//! forward, the drafter's forward + backward and the AdamW update timed apart (the device is
//! synchronised between them; each phase's host time to queue it and its most memory in use
//! beside), then a summary line with the same steps timed again with no wait between phases.
//!
//! `train_probe parts [--anchors 128]`: where the drafter's step goes at the Qwen3-8B shape:
//! its forward alone (no graph), forward + backward (as `train` runs them on the device), and
//! each building block's forward + backward at the step's sizes, one JSON line each
//! (milliseconds, device synchronised around each).
//!
//! `train_probe fused`: the fused ops of `nn::fused` on the device in f32 and bf16 against their
//! CPU implementation in f64 (forward and gradient), one JSON line per check with the largest
//! absolute difference.
//!
//! `train_probe flash`: flash attention through the model's entry points (block attention's
//! value and the gradients of its five inputs, the target's causal attention after a cache) in
//! bf16 on the device against the composed path in f64 on CPU, one JSON line per tensor.
//!
//! `train_probe target FOLDER [--tokens 512] [--repeats 3] [--dump OUT.safetensors] [--phases]`: a Hugging
//! Face target folder's forward over one sequence of `--tokens` random ids (every layer, no KV
//! cache: what `train` runs per sequence; f32 on CPU, bf16 on a GPU), timed `--repeats` times
//! after a warm-up; one JSON line with the median seconds (`bench/hybrid_forward.py` runs
//! transformers beside it); `--dump` writes every layer's output (`layers`, f32) to compare;
//! `--phases` then times each Gated DeltaNet layer by phase (mixing, the chunks' operands, the
//! pass over them, the output), one JSON line per layer.
//!
//! `train_probe decode MODEL [--batch 512] [--prompt 300] [--steps 32]`: generate's batched
//! greedy decoding (`nn::batch::BatchDecoder`, as the candle backend runs it) of a GGUF file or
//! a Hugging Face folder: `--batch` prompts of `--prompt` random ids prefilled, then `--steps`
//! steps, each the forward and the argmax with the ids brought to the host; one JSON line with
//! the prefill's seconds, the median step and tokens per second (`bench/decode_reference.py`
//! runs transformers' batched `generate` on the same shapes beside it).
//!
//! `train_probe verify MODEL [--context 300] [--repeats 20]`: what a speculative round's
//! verification pass costs against a one-token step, the ratio that decides whether a drafter
//! pays off on a small target: the target's pass (`Target::extend`, as `bench` runs it, the
//! argmax brought to the host) over n = 1, 2, ..., 128 tokens after a `--context`-token
//! cache, without taps and with five (a drafter's), and as a tree (`extend_tree`, a chain of n
//! nodes); then one projection's matmul at the target's widths (hidden -> MLP width) for the
//! same n, in f32 and bf16, to show how the pass's matmuls scale with n. Medians of
//! `--repeats`, one JSON line each.
//!
//! `train_probe round MODEL DRAFTER [--context 300] [--new 128] [--width 8] [--budget 64,128]`:
//! where a speculative round's time goes, as `bench` decodes: the target (a GGUF file or a
//! Hugging Face folder) and an exported drafter folder (config.json + model.safetensors)
//! decode `--new` tokens after a `--context`-token prompt autoregressively, with prompt lookup,
//! with the drafter as a chain and as a tree of each `--budget` nodes of the `--width` likeliest
//! (alone, and with prompt lookup's path grafted on);
//! per method one JSON line: milliseconds per round as `bench` times it, then per phase
//! (`Settings::profile`: the device synchronised at each phase's end, so the phases add up to
//! more than the unprofiled round: the difference is what the queue hid).
//!
//! `train_probe parity OUT.safetensors`: a small target and drafter (f32, weights drawn on CPU),
//! one sequence, one loss; writes every weight, the batch, the loss, the taps and every
//! gradient, for `bench/train_reference.py` to recompute in PyTorch and compare.

use std::collections::HashMap;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use dflash_model::nn::objective::{
    Backward, Batch, ComputeWeights, loss, loss_and_gradients_packed,
};
use dflash_model::nn::{AdamW, Drafter, DrafterConfig, Target, TargetConfig};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn preset(name: &str) -> TargetConfig {
    match name {
        // The story's target, SmolLM2-135M-Instruct.
        "smollm2" => TargetConfig {
            family: "llama".into(),
            hidden: 576,
            layers: 30,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            ffn: 1536,
            vocab: 49_152,
            eps: 1e-5,
            rope_theta: 100_000.0,
            qk_norm: false,
            context: 8192,
            hybrid: None,
        },
        "qwen3-8b" => TargetConfig {
            family: "qwen3".into(),
            hidden: 4096,
            layers: 36,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            ffn: 12288,
            vocab: 151_936,
            eps: 1e-6,
            rope_theta: 1_000_000.0,
            qk_norm: true,
            context: 4096,
            hybrid: None,
        },
        _ => TargetConfig {
            family: "qwen3".into(),
            hidden: 256,
            layers: 4,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            ffn: 512,
            vocab: 1000,
            eps: 1e-6,
            rope_theta: 1_000_000.0,
            qk_norm: true,
            context: 4096,
            hybrid: None,
        },
    }
}

fn device() -> Result<Device> {
    let device = Device::cuda_if_available(0)?;
    if std::env::var_os("DFLASH_PLAIN_DEVICE").is_none() {
        dflash_model::nn::fused::prepare_device(&device)?;
    }
    Ok(device)
}

/// A random sequence (a prompt of 64 untrained tokens, the rest trained).
fn sequence(n: usize, vocab: usize, seed: u64) -> (Vec<u32>, Vec<i8>) {
    let mut x = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    let ids = (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect();
    let mask = (0..n).map(|i| i8::from(i >= 64.min(n / 4))).collect();
    (ids, mask)
}

/// The H200's dense bf16 peak (NVIDIA's figure), the denominator of MFU.
const H200_BF16_FLOPS: f64 = 989.4e12;

/// The useful FLOPs of one step, counted the same for both implementations: the target's
/// forward over `seq` tokens up to its last tapped layer (causal attention: half the scores);
/// the drafter's forward and backward (x3) over the block rows and the context projections;
/// block attention over what each block sees (about half the context on average, plus itself);
/// the frozen LM head's forward and input gradient (x2) over the predicted rows.
fn step_flops(
    tc: &TargetConfig,
    dc: &DrafterConfig,
    seq: usize,
    anchors: usize,
    block: usize,
) -> f64 {
    let (h, hd) = (tc.hidden as f64, tc.head_dim as f64);
    let attn = |heads: usize, kv: usize| h * hd * (2.0 * heads as f64 + 2.0 * kv as f64);
    let layer = |heads: usize, kv: usize, ffn: usize| attn(heads, kv) + 3.0 * h * ffn as f64;
    let depth = dc.target_layers.iter().max().map_or(0, |&l| l + 1) as f64;
    let (s, m) = (seq as f64, (anchors * block) as f64);
    let target = depth
        * (2.0 * layer(tc.heads, tc.kv_heads, tc.ffn) * s
            + 2.0 * 2.0 * tc.heads as f64 * hd * s * s / 2.0);
    let per_layer = layer(dc.heads, dc.kv_heads, dc.ffn);
    let kv = h * hd * 2.0 * dc.kv_heads as f64;
    let drafter = 3.0
        * (2.0 * dc.layers as f64 * (per_layer * m + kv * s)
            + 2.0 * dc.target_layers.len() as f64 * h * h * s
            + dc.layers as f64 * 2.0 * 2.0 * dc.heads as f64 * hd * m * (s / 2.0 + block as f64));
    let head = 2.0 * 2.0 * h * tc.vocab as f64 * (anchors * (block - 1)) as f64;
    target + drafter + head
}

fn speed(args: &[String]) -> Result<()> {
    let device = device()?;
    let dtype = if arg(args, "--dtype", "bf16".to_owned()) == "f32" {
        DType::F32
    } else {
        DType::BF16
    };
    let tc = preset(&arg(args, "--preset", "qwen3-8b".to_owned()));
    let (seq, anchors, block, layers, steps) = (
        arg(args, "--seq", 3072usize),
        arg(args, "--anchors", 512usize),
        arg(args, "--block", 16usize),
        arg(args, "--layers", 5usize),
        arg(args, "--steps", 4usize),
    );
    let t0 = Instant::now();
    let mut target = Target::random(tc.clone(), 0, dtype, &device)?;
    let taps: Vec<usize> = dflash_model::drafter::spread_target_layers(tc.layers as u64, 5)
        .into_iter()
        .map(|l| l as usize)
        .collect();
    // As `train` does: the layers past the last tap are dropped (never run, never held).
    target.keep_layers_for(&taps);
    let mut config = DrafterConfig::for_target(&tc, layers, taps, block, tc.vocab as u32 - 1);
    // `--head dflash2`: DFlash 2's convolutions and selector at their defaults.
    if arg(args, "--head", "dflash".to_owned()) == "dflash2" {
        config.dflash2 = Some(dflash_model::Dflash2Config::for_hidden(tc.hidden));
    }
    // The drafter's trainable weights: f32 by default, as the train stage keeps them (the step
    // computes in `dtype`, the casts are part of the graph); `--master bf16` trains bf16 weights
    // directly, as bench/train_reference.py's PyTorch step does.
    let master = if arg(args, "--master", "f32".to_owned()) == "bf16" {
        DType::BF16
    } else {
        DType::F32
    };
    let drafter = Drafter::init(config.clone(), 0, master, &device)?;
    // `--moments bf16`: AdamW's moments in bf16 (stochastic rounding), half their memory.
    let moments = if arg(args, "--moments", "f32".to_owned()) == "bf16" {
        DType::BF16
    } else {
        DType::F32
    };
    let mut adam = AdamW::with_moments(&drafter.vars, 0.0, moments)?;
    device.synchronize()?;
    let init_peak = pool_peak_gib(&device)?;
    println!(
        "{}",
        serde_json::json!({"phase": "init", "seconds": t0.elapsed().as_secs_f64(),
            "pool_peak_gib": init_peak,
            "device": format!("{device:?}"), "dtype": format!("{dtype:?}"),
            "master_weights": format!("{master:?}"), "moments": format!("{moments:?}"),
            "drafter_parameters": config.parameters(), "head": if config.dflash2.is_some() { "dflash2" } else { "dflash" },
            "seq": seq, "anchors": anchors,
            "block": block})
    );
    let embed = |t: &Tensor| target.embed(t);
    let mut totals = Vec::new();
    // `--profile-step K`: only step K's kernels are profiled (`ncu --profile-from-start off`
    // records between cuProfilerStart and cuProfilerStop; `bench/kernel_profile.py` sums them).
    let profile_step = arg(args, "--profile-step", usize::MAX);
    // `--profile-phase P`: only that phase of step K (its kernels against its synced time say
    // which phase the step's time with no kernel running is in).
    let profile_phase = arg(args, "--profile-phase", String::new());
    if !["", "target", "drafter", "optim"].contains(&profile_phase.as_str()) {
        return Err(
            format!("--profile-phase {profile_phase:?}: one of target, drafter, optim").into(),
        );
    }
    // Recording on around `phase` of the profiled step (the whole step where no phase is named).
    let recording = |step: usize, phase: &str, on: bool| {
        if step == profile_step && (profile_phase.is_empty() || profile_phase == phase) {
            profiler(on);
        }
    };
    // `--backward autograd|written`: as `train` runs it on this device unless asked.
    let backward = match arg(args, "--backward", String::new()).as_str() {
        "autograd" => Backward::Autograd,
        "written" => Backward::WrittenOut,
        _ => Backward::on(&device, &drafter),
    };
    // As `train` does: the written-out step's weights in `dtype`, cast once, kept by AdamW.
    let kept = match backward {
        Backward::WrittenOut => Some(ComputeWeights::of(&drafter, dtype)?),
        Backward::Autograd => None,
    };
    // Steps 0..steps with the device synchronised between phases, each timed apart; then
    // `unsynced` more as `train` runs them, with no wait between phases (the loss's read is the
    // step's only one), timed together: what the phases' syncs cost, if anything.
    let unsynced = steps.saturating_sub(1).max(1);
    let mut unsynced_from = Instant::now();
    for step in 0..steps + unsynced {
        let synced = step < steps;
        if step == steps {
            device.synchronize()?;
            unsynced_from = Instant::now();
        }
        if step == profile_step {
            device.synchronize()?;
        }
        // The end of a phase begun at `t`: the host's time to queue it (the device runs behind
        // it: where it comes near the phase's time, the host is what the device waits on), then
        // where synced the phase's time and its most memory in use (the pool's high-water
        // mark, reset at each read).
        let end = |t: Instant| -> Result<(f64, f64, Option<f64>)> {
            let host_ms = t.elapsed().as_secs_f64() * 1e3;
            if !synced {
                return Ok((host_ms, 0.0, None));
            }
            device.synchronize()?;
            Ok((
                host_ms,
                t.elapsed().as_secs_f64() * 1e3,
                pool_peak_gib(&device)?,
            ))
        };
        let (ids, mask) = sequence(seq, tc.vocab, step as u64);
        let batch = Batch::sample(
            &ids,
            &mask,
            anchors,
            block,
            tc.vocab as u32 - 1,
            7.0,
            step as u64,
        )
        .ok_or("no anchors")?;
        let t = Instant::now();
        recording(step, "target", true);
        let context = target.tapped(&ids, &config.target_layers)?;
        let (target_host_ms, target_ms, target_peak) = end(t)?;
        recording(step, "target", false);
        let t = Instant::now();
        recording(step, "drafter", true);
        let (l, _, g) = loss_and_gradients_packed(
            &drafter,
            kept.as_ref(),
            &embed,
            &target.lm_head,
            &context,
            &[&batch],
            batch.weight(),
            backward,
        )?;
        let (drafter_host_ms, drafter_ms, drafter_peak) = end(t)?;
        recording(step, "drafter", false);
        let t = Instant::now();
        recording(step, "optim", true);
        adam.step_keeping(
            &drafter.vars,
            &g,
            6e-4,
            1.0,
            kept.as_ref().map(ComputeWeights::tensors),
        )?;
        let (optim_host_ms, optim_ms, optim_peak) = end(t)?;
        recording(step, "optim", false);
        if !synced {
            continue;
        }
        let total = target_ms + drafter_ms + optim_ms;
        println!(
            "{}",
            serde_json::json!({"phase": "step", "step": step, "target_ms": target_ms,
                "drafter_ms": drafter_ms, "optim_ms": optim_ms, "total_ms": total,
                "target_host_ms": target_host_ms, "drafter_host_ms": drafter_host_ms,
                "optim_host_ms": optim_host_ms, "target_pool_peak_gib": target_peak,
                "drafter_pool_peak_gib": drafter_peak, "optim_pool_peak_gib": optim_peak,
                "loss": l})
        );
        totals.push((target_ms, drafter_ms, optim_ms, total));
    }
    device.synchronize()?;
    let unsynced_ms = unsynced_from.elapsed().as_secs_f64() * 1e3 / unsynced as f64;
    // The first step pays for kernel loading and allocation: the rest are the figure.
    let warm = &totals[1.min(totals.len() - 1)..];
    let mean =
        |f: fn(&(f64, f64, f64, f64)) -> f64| warm.iter().map(f).sum::<f64>() / warm.len() as f64;
    let flops = step_flops(&tc, &config, seq, anchors, block);
    let seconds = mean(|t| t.3) / 1e3;
    println!(
        "{}",
        serde_json::json!({"phase": "summary", "backward": format!("{backward:?}"),
            "target_ms": mean(|t| t.0), "drafter_ms": mean(|t| t.1),
            "optim_ms": mean(|t| t.2), "total_ms": mean(|t| t.3), "steps_timed": warm.len(),
            "unsynced_step_ms": unsynced_ms, "unsynced_steps": unsynced,
            "flops": flops, "mfu": flops / seconds / H200_BF16_FLOPS,
            "sequence_tokens_per_second": seq as f64 / seconds,
            "block_tokens_per_second": (anchors * block) as f64 / seconds,
            "peak_note": "peak memory: nvidia-smi while it runs; each step line has its phases' most in use from the device pool (tensors only)"})
    );
    Ok(())
}

/// The device pool's most memory in use since the last read, GiB (`None` off a GPU).
fn pool_peak_gib(device: &Device) -> Result<Option<f64>> {
    Ok(dflash_model::nn::fused::pool_peak_bytes(device)?.map(|b| b as f64 / (1u64 << 30) as f64))
}

/// Start or stop the CUDA profiler's recording (what `ncu --profile-from-start off` sees);
/// nothing without a GPU build.
#[allow(unsafe_code)]
fn profiler(on: bool) {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::sys;
        // SAFETY: both calls take no arguments and only toggle the profiler's recording; a
        // failure (no profiler attached) is harmless and ignored.
        unsafe {
            if on {
                sys::cuProfilerStart();
            } else {
                sys::cuProfilerStop();
            }
        }
    }
    let _ = on;
}

/// The largest absolute difference of two tensors (compared on CPU in f64).
fn worst(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?)
}

fn fused(_args: &[String]) -> Result<()> {
    use candle_core::Var;
    use dflash_model::nn::drafter::Init;
    use dflash_model::nn::fused;
    let device = device()?;
    let cpu = Device::Cpu;
    let mut init = Init::new(1);
    // Attention-shaped scores [kv, group, nq, nk] under a block mask with one closed row.
    let (nq, nk) = (48, 1100);
    let scores = (init.normal(&[2, 3, nq, nk], 1.0, DType::F64, &cpu)? * 8.0)?;
    let upstream = init.normal(&[2, 3, nq, nk], 1.0, DType::F64, &cpu)?;
    let mask: Vec<f64> = (0..nq * nk)
        .map(|i| {
            let (r, c) = (i / nk, i % nk);
            if r != 5 && c <= 20 * r + 3 {
                0.0
            } else {
                f64::NEG_INFINITY
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (nq, nk), &cpu)?;
    let logits = (init.normal(&[37, 50_000], 1.0, DType::F64, &cpu)? * 3.0)?;
    let labels: Vec<u32> = (0..37u32).map(|i| i * 1_337 % 50_000).collect();
    let weights = init.normal(&[37], 1.0, DType::F64, &cpu)?;
    let normed = init.normal(&[6, 700], 1.0, DType::F64, &cpu)?;
    let normed_up = init.normal(&[6, 700], 1.0, DType::F64, &cpu)?;
    let norm_weight = init.normal(&[700], 1.0, DType::F64, &cpu)?;
    let rotated = init.normal(&[4, 33, 64], 1.0, DType::F64, &cpu)?;
    let rotated_up = init.normal(&[4, 33, 64], 1.0, DType::F64, &cpu)?;
    let positions: Vec<u32> = (0..33).map(|i| i * 7 + 3).collect();
    let (cos, sin) = dflash_model::nn::ops::rope_tables(&positions, 64, 1e6, DType::F64, &cpu)?;
    // Softmax and cross-entropy: value and gradient of a weighted sum, on `dev` in `dtype`.
    let run = |dev: &Device, dtype: DType| -> Result<Vec<Tensor>> {
        let x = Var::from_tensor(&scores.to_dtype(dtype)?.to_device(dev)?)?;
        let p =
            fused::masked_softmax(x.as_tensor(), &mask.to_dtype(dtype)?.to_device(dev)?, 0.088)?;
        let up = upstream.to_dtype(dtype)?.to_device(dev)?;
        let g = (&p * &up)?.sum_all()?.backward()?;
        let z = Var::from_tensor(&logits.to_dtype(dtype)?.to_device(dev)?)?;
        let nll = fused::cross_entropy(z.as_tensor(), &labels)?;
        let w = weights.to_dtype(nll.dtype())?.to_device(dev)?;
        let gz = (&nll * &w)?.sum_all()?.backward()?;
        // RMSNorm (value, input and weight gradients), rope (value, gradient), sum of squares.
        let xn = Var::from_tensor(&normed.to_dtype(dtype)?.to_device(dev)?)?;
        let wn = Var::from_tensor(&norm_weight.to_dtype(dtype)?.to_device(dev)?)?;
        let y = fused::rms_norm(xn.as_tensor(), wn.as_tensor(), 1e-6)?;
        let gn = (&y * &normed_up.to_dtype(dtype)?.to_device(dev)?)?
            .sum_all()?
            .backward()?;
        let xr = Var::from_tensor(&rotated.to_dtype(dtype)?.to_device(dev)?)?;
        let (cos, sin) = (
            cos.to_dtype(dtype)?.to_device(dev)?,
            sin.to_dtype(dtype)?.to_device(dev)?,
        );
        let r = fused::rope(xr.as_tensor(), &cos, &sin)?;
        let gr = (&r * &rotated_up.to_dtype(dtype)?.to_device(dev)?)?
            .sum_all()?
            .backward()?;
        let ss = fused::sum_squares(&normed.to_dtype(dtype)?.to_device(dev)?)?;
        // SwiGLU's gate (value, both gradients).
        let xg = Var::from_tensor(&(&normed * 3.0)?.to_dtype(dtype)?.to_device(dev)?)?;
        let xu = Var::from_tensor(&normed_up.to_dtype(dtype)?.to_device(dev)?)?;
        let h = fused::swiglu(xg.as_tensor(), xu.as_tensor())?;
        let gs = (&h * &normed.to_dtype(dtype)?.to_device(dev)?)?
            .sum_all()?
            .backward()?;
        Ok(vec![
            p,
            g.get(x.as_tensor()).ok_or("no softmax gradient")?.clone(),
            nll,
            gz.get(z.as_tensor())
                .ok_or("no cross-entropy gradient")?
                .clone(),
            y,
            gn.get(xn.as_tensor()).ok_or("no norm gradient")?.clone(),
            gn.get(wn.as_tensor())
                .ok_or("no norm weight gradient")?
                .clone(),
            r,
            gr.get(xr.as_tensor()).ok_or("no rope gradient")?.clone(),
            (ss / 1e4)?,
            h,
            gs.get(xg.as_tensor())
                .ok_or("no swiglu gate gradient")?
                .clone(),
            gs.get(xu.as_tensor())
                .ok_or("no swiglu up gradient")?
                .clone(),
        ])
    };
    let want = run(&cpu, DType::F64)?;
    // Step t's constants of the AdamW checks below.
    let adam_step = |t: i32| fused::AdamStep {
        lr: 1e-2,
        weight_decay: 0.1,
        betas: (0.9, 0.999),
        corrections: (1.0 - 0.9f64.powi(t), 1.0 - 0.999f64.powi(t)),
        eps: 1e-8,
        clip_scale: 0.7,
        rounding_seed: t as u32,
    };
    // AdamW: three steps of a `dtype` parameter from gradients in `grad`, the same on CPU as
    // the reference; given `keep`, with the bf16 copy kept (`adamw_update_master`, what `train`
    // runs on a GPU: f32 master weights, bf16 gradients).
    // `moments`: their dtype (bf16: stochastic rounding, the GPU's kernel against the host's).
    let adam_moments =
        |dev: &Device, dtype: DType, grad: DType, keep: bool, width: usize, moments: DType| {
            let mut init = Init::new(7);
            let p = init
                .normal(&[3, width], 1.0, DType::F32, &cpu)?
                .to_dtype(dtype)?
                .to_device(dev)?;
            let low = keep.then(|| p.to_dtype(DType::BF16)?.copy()).transpose()?;
            let (m, v) = (
                Tensor::zeros((3, width), moments, dev)?,
                Tensor::zeros((3, width), moments, dev)?,
            );
            for t in 1..=3 {
                let g = init
                    .normal(&[3, width], 0.1, DType::F32, &cpu)?
                    .to_dtype(grad)?
                    .to_device(dev)?;
                match &low {
                    Some(low) => fused::adamw_update_master(&p, &g, &m, &v, low, &adam_step(t))?,
                    None => fused::adamw_update(&p, &g, &m, &v, &adam_step(t))?,
                }
            }
            Result::Ok((p, low, m, v))
        };
    let adam = |dev: &Device, dtype: DType, grad: DType, keep: bool, width: usize| {
        adam_moments(dev, dtype, grad, keep, width, DType::F32).map(|(p, low, _, _)| (p, low))
    };
    for dtype in [DType::F32, DType::BF16] {
        let got = run(&device, dtype)?;
        for (name, (g, w)) in [
            "softmax",
            "softmax_grad",
            "cross_entropy",
            "cross_entropy_grad",
            "rms_norm",
            "rms_norm_grad_x",
            "rms_norm_grad_w",
            "rope",
            "rope_grad",
            "sum_squares_over_1e4",
            "swiglu",
            "swiglu_grad_gate",
            "swiglu_grad_up",
        ]
        .iter()
        .zip(got.iter().zip(&want))
        {
            println!(
                "{}",
                serde_json::json!({"phase": "fused", "check": name, "dtype": format!("{dtype:?}"),
                    "device": format!("{device:?}"), "max_abs_diff": worst(g, w)?,
                    "max_abs": worst(w, &w.zeros_like()?)?})
            );
        }
        let (p, _) = adam(&device, dtype, dtype, false, 4099)?;
        let (reference, _) = adam(&cpu, dtype, dtype, false, 4099)?;
        println!(
            "{}",
            serde_json::json!({"phase": "fused", "check": "adamw_3_steps", "dtype": format!("{dtype:?}"),
                "device": format!("{device:?}"), "max_abs_diff": worst(&p, &reference)?})
        );
    }
    // The master update's copy must be the updated weights' cast exactly: rows of 4,099 (an
    // element a thread) and of 4,096 (eight a thread).
    for width in [4099, 4096] {
        let (p, low) = adam(&device, DType::F32, DType::BF16, true, width)?;
        let (rp, rlow) = adam(&cpu, DType::F32, DType::BF16, true, width)?;
        let (low, rlow) = (low.ok_or("no copy")?, rlow.ok_or("no copy")?);
        println!(
            "{}",
            serde_json::json!({"phase": "fused", "check": format!("adamw_master_3_steps_{width}"),
                "device": format!("{device:?}"), "max_abs_diff": worst(&p, &rp)?,
                "copy_max_abs_diff": worst(&low, &rlow)?,
                "copy_is_the_cast": worst(&low, &p.to_dtype(DType::BF16)?)? == 0.0})
        );
    }
    // bf16 moments (`adamw_master_sr_bf16`, and `adamw_sr_f32` where no copy is kept, as
    // autograd's f32 gradients run) against the host's stochastic rounding: the same coins, so
    // the moments agree to the bf16 step wherever the f32 values before rounding agree (fused
    // multiply-adds may move one by an ulp, and that one's rounding with it).
    for (keep, grad, width) in [
        (true, DType::BF16, 4099),
        (true, DType::BF16, 4096),
        (false, DType::F32, 4099),
    ] {
        let (p, low, m, v) = adam_moments(&device, DType::F32, grad, keep, width, DType::BF16)?;
        let (rp, _, rm, rv) = adam_moments(&cpu, DType::F32, grad, keep, width, DType::BF16)?;
        let low = match low {
            Some(low) => low,
            None => p.to_dtype(DType::BF16)?,
        };
        let differ = |a: &Tensor, b: &Tensor| -> Result<usize> {
            let (a, b) = (
                a.to_device(&cpu)?.flatten_all()?.to_vec1::<half::bf16>()?,
                b.flatten_all()?.to_vec1::<half::bf16>()?,
            );
            Ok(a.iter().zip(&b).filter(|(x, y)| x != y).count())
        };
        println!(
            "{}",
            serde_json::json!({"phase": "fused",
                "check": format!("adamw_bf16_moments_3_steps_{width}{}", if keep { "" } else { "_no_copy" }),
                "device": format!("{device:?}"), "max_abs_diff": worst(&p, &rp)?,
                "m_elements_differing": differ(&m, &rm)?, "v_elements_differing": differ(&v, &rv)?,
                "elements": 3 * width,
                "copy_is_the_cast": worst(&low, &p.to_dtype(DType::BF16)?)? == 0.0})
        );
    }
    // The sum of two tensors (the written-out step's residuals) against candle's add on the
    // device (exact): 64 x 4,096 (16 bytes a thread) and 7 x 4,099.
    for dtype in [DType::F32, DType::BF16] {
        for (rows, n) in [(64, 4096), (7, 4099)] {
            let mut on = || {
                init.normal(&[rows, n], 1.0, DType::F32, &cpu)?
                    .to_dtype(dtype)?
                    .to_device(&device)
            };
            let (a, b) = (on()?, on()?);
            compare(
                &device,
                &format!("add_{rows}x{n}"),
                dtype,
                &|| Ok(fused::add(&a, &b)?),
                &|| Ok((&a + &b)?),
            )?;
        }
    }
    // The head's rows in one kernel (`train`'s on a GPU: `head_rows`) against the three it
    // replaces on the same device: loss, argmax and the gradient written over the logits.
    #[cfg(feature = "cuda")]
    for (rows, vocab) in [(300usize, 49_152usize), (64, 151_936)] {
        let logits = (init.normal(&[rows, vocab], 1.0, DType::F32, &cpu)? * 3.0)?;
        let labels: Vec<u32> = (0..rows as u32)
            .map(|r| (r * 7919) % vocab as u32)
            .collect();
        for dtype in [DType::F32, DType::BF16] {
            let z = logits.to_dtype(dtype)?.to_device(&device)?;
            let want_nll = fused::cross_entropy(&z, &labels)?;
            let want_top = fused::top_k(&z, 1)?;
            // softmax - onehot per row: the loss's gradient when each row's weighs 1.
            let zv = candle_core::Var::from_tensor(&z)?;
            let grads = fused::cross_entropy(zv.as_tensor(), &labels)?
                .sum_all()?
                .backward()?;
            let want_grad = grads.get(zv.as_tensor()).ok_or("no gradient")?.clone();
            let io = z.copy()?;
            let t = Instant::now();
            let (nll, top) = fused::head_rows_in_place(&io, &labels)?;
            device.synchronize()?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let tops_differ = (top.to_device(&cpu)?.flatten_all()?.to_vec1::<u32>()?)
                .iter()
                .zip(want_top.to_device(&cpu)?.flatten_all()?.to_vec1::<u32>()?)
                .filter(|(a, b)| *a != b)
                .count();
            println!(
                "{}",
                serde_json::json!({"phase": "fused", "check": "head_rows", "rows": rows,
                    "vocab": vocab, "dtype": format!("{dtype:?}"),
                    "device": format!("{device:?}"), "nll_max_abs_diff": worst(&nll, &want_nll)?,
                    "rows_whose_argmax_differs": tops_differ,
                    "grad_max_abs_diff": worst(&io, &want_grad)?, "ms_first_call": ms})
            );
        }
    }
    // Top-k (DFlash 2's candidates over a SmolLM2-sized vocabulary): the device's picks against
    // the CPU's on the same values, rows whose k indices differ in any place.
    let logits = (init.normal(&[300, 49_152], 1.0, DType::F32, &cpu)? * 3.0)?;
    for dtype in [DType::F32, DType::BF16] {
        let x = logits.to_dtype(dtype)?;
        let want: Vec<Vec<u32>> = fused::top_k(&x, 8)?.to_vec2()?;
        let got: Vec<Vec<u32>> = fused::top_k(&x.to_device(&device)?, 8)?
            .to_device(&cpu)?
            .to_vec2()?;
        let differ = want.iter().zip(&got).filter(|(a, b)| a != b).count();
        println!(
            "{}",
            serde_json::json!({"phase": "fused", "check": "top_k_8", "dtype": format!("{dtype:?}"),
                "device": format!("{device:?}"), "rows": want.len(), "rows_differing": differ})
        );
    }
    // The strided copy a decoding pass makes of its heads (SmolLM2's 9 heads of 64 over 32
    // rows, transposed; a cache of 3 heads cut to 300 of 332 positions): the kernel against
    // candle's copy of the same view on the device (exact), and both times (ten in a row).
    let rows32 = init.normal(&[32, 9 * 64], 1.0, DType::F32, &cpu)?;
    let cache = init.normal(&[3, 332, 64], 1.0, DType::F32, &cpu)?;
    for dtype in [DType::F32, DType::BF16] {
        let heads = rows32
            .to_dtype(dtype)?
            .to_device(&device)?
            .reshape((32, 9, 64))?
            .transpose(0, 1)?;
        let cut = cache
            .to_dtype(dtype)?
            .to_device(&device)?
            .narrow(1, 0, 300)?;
        for (name, view) in [("heads", &heads), ("cache_cut", &cut)] {
            let ten = |f: &dyn Fn() -> Result<Tensor>| ten_in_a_row(&device, f);
            let (got, ms) = ten(&|| Ok(fused::strided_copy3(view)?))?;
            let (want, ms_candle) = ten(&|| Ok(view.contiguous()?))?;
            println!(
                "{}",
                serde_json::json!({"phase": "fused", "check": format!("strided_copy3_{name}"), "dtype": format!("{dtype:?}"),
                    "device": format!("{device:?}"), "max_abs_diff": worst(&got.to_device(&cpu)?, &want.to_device(&cpu)?)?,
                    "ms": ms, "ms_candle": ms_candle})
            );
        }
    }
    // The chunked Gated DeltaNet's WY inverse at a 2,048-token prefill of Qwen3.5-27B's widths
    // (48 heads x 32 chunks of 64): the forward-substitution kernel against the squarings on
    // the device (f32), and both times.
    {
        let n = 64;
        let a = (init
            .normal(&[48, 32, n, n], 0.05, DType::F32, &cpu)?
            .to_device(&device)?
            .broadcast_mul(&fused::lower_triangle(n, true, DType::F32, &device)?))?;
        compare(
            &device,
            "unit_lower_inverse",
            DType::F32,
            &|| Ok(fused::unit_lower_inverse_kernel(&a)?),
            &|| Ok(fused::unit_lower_inverse_squarings(&a)?),
        )?;
        // The same chunks' decay matrices from cumulative log-decays: the kernel against the
        // composed ops on the device.
        let cum = init
            .normal(&[48, 32, n], 0.05, DType::F32, &cpu)?
            .abs()?
            .neg()?
            .cumsum(candle_core::D::Minus1)?
            .to_device(&device)?;
        compare(
            &device,
            "chunk_decay",
            DType::F32,
            &|| Ok(fused::chunk_decay_kernel(&cum)?),
            &|| Ok(fused::chunk_decay_composed(&cum)?),
        )?;
    }
    // A decoding cache cut to a tree's path and the next pass's keys appended, in one copy (3
    // heads of 64 over 332 positions, 300 plus a path of 5 kept, 9 appended): against
    // index_select and cat on the device (exact).
    for dtype in [DType::F32, DType::BF16] {
        let past = init
            .normal(&[3, 332, 64], 1.0, DType::F32, &cpu)?
            .to_dtype(dtype)?
            .to_device(&device)?;
        let added = init
            .normal(&[3, 9, 64], 1.0, DType::F32, &cpu)?
            .to_dtype(dtype)?
            .to_device(&device)?;
        let kept: Vec<u32> = (0..300).chain([300, 302, 307, 315, 331]).collect();
        let keep = Tensor::new(kept.as_slice(), &device)?;
        compare(
            &device,
            "keep_append",
            dtype,
            &|| Ok(fused::keep_append(&past, &keep, &added)?),
            &|| Ok(Tensor::cat(&[&past.index_select(&keep, 1)?, &added], 1)?),
        )?;
    }
    // A residual's add and the next RMSNorm in one kernel (SmolLM2's 576 wide, 1 and 64 rows):
    // against the add and candle's RMSNorm on the device (the sum exact, the norm to rounding).
    for dtype in [DType::F32, DType::BF16] {
        for rows in [1, 64] {
            let mut on = |shape: &[usize], s: f64| -> Result<Tensor> {
                Ok(init
                    .normal(shape, s, DType::F32, &cpu)?
                    .to_dtype(dtype)?
                    .to_device(&device)?)
            };
            let (x, r, w) = (
                on(&[rows, 576], 1.0)?,
                on(&[rows, 576], 1.0)?,
                on(&[576], 1.0)?,
            );
            let ten = |f: &dyn Fn() -> Result<Tensor>| ten_in_a_row(&device, f);
            let (got, ms) = ten(&|| {
                let (s, y) = fused::add_rms_norm(&x, &r, &w, 1e-5)?;
                Ok(Tensor::cat(&[&s, &y], 0)?)
            })?;
            let (want, ms_apart) = ten(&|| {
                let s = (&x + &r)?;
                let y = candle_nn::ops::rms_norm(&s, &w, 1e-5)?;
                Ok(Tensor::cat(&[&s, &y], 0)?)
            })?;
            let (got, want) = (got.to_device(&cpu)?, want.to_device(&cpu)?);
            println!(
                "{}",
                serde_json::json!({"phase": "fused", "check": format!("add_rms_norm_{rows}"), "dtype": format!("{dtype:?}"),
                    "device": format!("{device:?}"),
                    "sum_max_abs_diff": worst(&got.narrow(0, 0, rows)?, &want.narrow(0, 0, rows)?)?,
                    "norm_max_abs_diff": worst(&got.narrow(0, rows, rows)?, &want.narrow(0, rows, rows)?)?,
                    "ms": ms, "ms_apart": ms_apart})
            );
        }
    }
    // SwiGLU over a stacked gate-and-up projection (SmolLM2's MLP, 1,536 wide, over 1 and 64
    // rows): the packed kernel against the two-input one on the halves copied apart (exact).
    for dtype in [DType::F32, DType::BF16] {
        for rows in [1, 64] {
            let gu = init
                .normal(&[rows, 2 * 1536], 2.0, DType::F32, &cpu)?
                .to_dtype(dtype)?
                .to_device(&device)?;
            compare(
                &device,
                &format!("swiglu_packed_{rows}"),
                dtype,
                &|| Ok(fused::swiglu_packed(&gu)?),
                &|| {
                    Ok(fused::swiglu(
                        &gu.narrow(1, 0, 1536)?.contiguous()?,
                        &gu.narrow(1, 1536, 1536)?.contiguous()?,
                    )?)
                },
            )?;
        }
    }
    // RMSNorm and its input gradient on the device against their CPU forms: rows of 4,096 (a
    // block of 512 threads a row), of 128 (16 threads a row, 16 rows a block, 301 rows so the
    // last block has rows past the end) and of 130 (element by element).
    for dtype in [DType::F32, DType::BF16] {
        for (rows, n) in [(64, 4096), (301, 128), (7, 130)] {
            let mut on =
                |shape: &[usize], s: f64| init.normal(shape, s, DType::F32, &cpu)?.to_dtype(dtype);
            let (x, dy, w) = (on(&[rows, n], 1.0)?, on(&[rows, n], 1.0)?, on(&[n], 1.0)?);
            let all = |dev: &Device| -> Result<Vec<Tensor>> {
                let (x, dy, w) = (x.to_device(dev)?, dy.to_device(dev)?, w.to_device(dev)?);
                let (dx, dw) = fused::rms_norm_backward(&x, &w, &dy, 1e-6)?;
                Ok(vec![fused::rms_norm(&x, &w, 1e-6)?, dx, dw])
            };
            let shape = format!("{rows}x{n}");
            let names = ["rms_norm", "rms_norm_dx", "rms_norm_dw"];
            print_vs_cpu(&names, &shape, dtype, &all(&device)?, &all(&cpu)?)?;
        }
    }
    // SwiGLU, its packed form and both input gradients on the device against their CPU forms:
    // 64 rows of 1,536 (the 16-byte vector path) and 7 of 1,531 (element by element).
    for dtype in [DType::F32, DType::BF16] {
        for (rows, f) in [(64, 1536), (7, 1531)] {
            let mut on = |s: f64| {
                init.normal(&[rows, f], s, DType::F32, &cpu)?
                    .to_dtype(dtype)
            };
            let (g, u, dh) = (on(2.0)?, on(1.0)?, on(1.0)?);
            let gu = Tensor::cat(&[&g, &u], 1)?;
            let all = |dev: &Device| -> Result<Vec<Tensor>> {
                let (g, u, dh, gu) = (
                    g.to_device(dev)?,
                    u.to_device(dev)?,
                    dh.to_device(dev)?,
                    gu.to_device(dev)?,
                );
                let (dg, du) = fused::swiglu_backward(&g, &u, &dh)?;
                Ok(vec![
                    fused::swiglu(&g, &u)?,
                    fused::swiglu_packed(&gu)?,
                    dg,
                    du,
                ])
            };
            let shape = format!("{rows}x{f}");
            let names = ["swiglu", "swiglu_packed", "swiglu_dg", "swiglu_du"];
            print_vs_cpu(&names, &shape, dtype, &all(&device)?, &all(&cpu)?)?;
        }
    }
    // The Gated DeltaNet state times each head's chunk decay (48 heads of 128 x 128): the kernel
    // against the broadcast product on the device (exact), and both times, ten in a row.
    let st = init
        .normal(&[48, 128, 128], 1.0, DType::F32, &cpu)?
        .to_device(&device)?;
    let decay = init
        .normal(&[48], 0.1, DType::F32, &cpu)?
        .exp()?
        .to_device(&device)?;
    let ten = |f: &dyn Fn() -> Result<Tensor>| ten_in_a_row(&device, f);
    let (got, ms) = ten(&|| Ok(fused::scale_by_head_kernel(&st, &decay)?))?;
    let (want, ms_candle) = ten(&|| Ok(st.broadcast_mul(&decay.reshape((48, 1, 1))?)?))?;
    println!(
        "{}",
        serde_json::json!({"phase": "fused", "check": "scale_by_head", "dtype": "F32",
            "device": format!("{device:?}"), "max_abs_diff": worst(&got.to_device(&cpu)?, &want.to_device(&cpu)?)?,
            "ms": ms, "ms_candle": ms_candle})
    );
    // A Gated DeltaNet layer's causal convolution with its SiLU at Qwen3.5-27B's channels over
    // 2,048 tokens: the device's against the CPU's, and its time against the composed taps it
    // replaced (a cast to f32, a multiply and an add per tap, the SiLU).
    let x = init.normal(&[2_051, 16_384], 1.0, DType::F32, &cpu)?;
    let w = init.normal(&[16_384, 4], 0.5, DType::F32, &cpu)?;
    for dtype in [DType::F32, DType::BF16] {
        let xc = x.to_dtype(dtype)?;
        let want = fused::causal_conv_silu(&xc, &w)?;
        let (xd, wd) = (xc.to_device(&device)?, w.to_device(&device)?);
        let (got, ms) = once_timed(&device, || Ok(fused::causal_conv_silu(&xd, &wd)?))?;
        let (_, ms_composed) = once_timed(&device, || {
            let (xf, wf) = (xd.to_dtype(DType::F32)?, wd.to_dtype(DType::F32)?);
            let n = xf.dim(0)? - 3;
            let mut acc = xf
                .narrow(0, 0, n)?
                .broadcast_mul(&wf.narrow(1, 0, 1)?.t()?)?;
            for j in 1..4 {
                acc = (acc
                    + xf.narrow(0, j, n)?
                        .broadcast_mul(&wf.narrow(1, j, 1)?.t()?)?)?;
            }
            Ok(candle_nn::ops::silu(&acc)?)
        })?;
        println!(
            "{}",
            serde_json::json!({"phase": "fused", "check": "causal_conv_silu", "dtype": format!("{dtype:?}"),
                "device": format!("{device:?}"), "max_abs_diff": worst(&got.to_device(&cpu)?, &want)?,
                "ms": ms, "ms_composed": ms_composed})
        );
    }
    // The chunked Gated DeltaNet's pass over its chunks at Qwen3.5-27B's widths over 2,048
    // tokens (48 value heads of 128, 32 chunks of 64): the device's kernel against the CPU's
    // form on the same packed operands, and its time against the matmuls per chunk it replaced.
    let (chunks, heads, l, dk, dv) = (32usize, 48usize, 64usize, 128usize, 128usize);
    let rows = init.normal(&[chunks, heads, l, dv + 2 * dk + l], 0.1, DType::F32, &cpu)?;
    let tails = init.normal(&[chunks, heads, dk, l + 1], 0.1, DType::F32, &cpu)?;
    let s0 = init.normal(&[heads, dk, dv], 0.1, DType::F32, &cpu)?;
    let (want_o, want_s) = fused::delta_scan(&rows, &tails, &s0)?;
    let (rd, td, sd) = (
        rows.to_device(&device)?,
        tails.to_device(&device)?,
        s0.to_device(&device)?,
    );
    let ((got_o, got_s), ms) = once_timed(&device, || Ok(fused::delta_scan(&rd, &td, &sd)?))?;
    let ((composed, _), ms_per_chunk) =
        once_timed(&device, || Ok(fused::delta_scan_matmuls(&rd, &td, &sd)?))?;
    println!(
        "{}",
        serde_json::json!({"phase": "fused", "check": "delta_scan", "dtype": "F32",
            "device": format!("{device:?}"), "max_abs_diff": worst(&got_o.to_device(&cpu)?, &want_o)?,
            "state_max_abs_diff": worst(&got_s.to_device(&cpu)?, &want_s)?,
            "max_abs": worst(&want_o, &want_o.zeros_like()?)?,
            "per_chunk_max_abs_diff": worst(&composed.to_device(&cpu)?, &want_o)?,
            "ms": ms, "ms_matmuls_per_chunk": ms_per_chunk})
    );
    // Rows of a table by index (DFlash 2's codebooks: 200K lookups into 49,152 x 64): value and
    // gradient on the device against the CPU's, and the time of the lookup with its backward
    // against candle's `index_select` (whose backward is candle's `index_add`).
    let table = init.normal(&[49_152, 64], 1.0, DType::F32, &cpu)?;
    let ids: Vec<u32> = (0..200_000u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 49_152)
        .collect();
    let up = init.normal(&[200_000, 64], 1.0, DType::F32, &cpu)?;
    let gathered = |dev: &Device, fused_op: bool| -> Result<(Tensor, Tensor, f64)> {
        let t = Var::from_tensor(&table.to_device(dev)?)?;
        let (i, u) = (Tensor::new(ids.as_slice(), dev)?, up.to_device(dev)?);
        dev.synchronize()?;
        let t0 = Instant::now();
        let y = if fused_op {
            fused::gather_rows(t.as_tensor(), &i)?
        } else {
            t.as_tensor().index_select(&i, 0)?
        };
        let g = (&y * &u)?.sum_all()?.backward()?;
        let dt = g.get(t.as_tensor()).ok_or("no gather gradient")?.clone();
        dev.synchronize()?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        Ok((y.to_device(&cpu)?, dt.to_device(&cpu)?, ms))
    };
    let (y_cpu, g_cpu, _) = gathered(&cpu, true)?;
    let _ = gathered(&device, true)?; // warm-up (kernel loading)
    let (y_dev, g_dev, ms) = gathered(&device, true)?;
    let (_, g_candle, ms_candle) = gathered(&device, false)?;
    println!(
        "{}",
        serde_json::json!({"phase": "fused", "check": "gather_rows", "dtype": "F32",
            "device": format!("{device:?}"), "max_abs_diff": worst(&y_dev, &y_cpu)?,
            "grad_max_abs_diff": worst(&g_dev, &g_cpu)?,
            "candle_grad_max_abs_diff": worst(&g_candle, &g_cpu)?,
            "ms_with_backward": ms, "ms_index_select_with_backward": ms_candle})
    );
    Ok(())
}

/// Flash attention through the model's own entry points (block attention's value and five
/// gradients, the target's causal attention) on the device in bf16, against the composed path on
/// CPU in f64: the largest difference relative to the reference's largest magnitude.
fn flash(_args: &[String]) -> Result<()> {
    use candle_core::Var;
    use dflash_model::nn::drafter::Init;
    use dflash_model::nn::ops::{self, BlockMask};
    let device = device()?;
    let cpu = Device::Cpu;
    let mut init = Init::new(5);
    let (heads, kv, d, s, blocks, block) = (8, 2, 128, 300, 7, 16);
    let m = blocks * block;
    let shapes = [
        [heads, m, d],
        [kv, s, d],
        [kv, s, d],
        [kv, m, d],
        [kv, m, d],
    ];
    let inputs: Vec<Tensor> = shapes
        .iter()
        .map(|sh| init.normal(sh, 1.0, DType::F64, &cpu))
        .collect::<candle_core::Result<_>>()?;
    let up = init.normal(&[heads, m, d], 1.0, DType::F64, &cpu)?;
    let mask = BlockMask::new(vec![0, 1, 17, 64, 65, 200, 300], s, block);
    let run = |dev: &Device, dtype: DType| -> Result<Vec<Tensor>> {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|t| Var::from_tensor(&t.to_dtype(dtype)?.to_device(dev)?))
            .collect::<candle_core::Result<_>>()?;
        let t: Vec<&Tensor> = vars.iter().map(Var::as_tensor).collect();
        let out = ops::block_attention(t[0], (t[1], t[2]), (t[3], t[4]), block, &mask)?;
        let grads = (&out * &up.to_dtype(dtype)?.to_device(dev)?)?
            .sum_all()?
            .backward()?;
        let mut all = vec![out];
        for x in &t {
            all.push(grads.get(x).ok_or("a missing gradient")?.clone());
        }
        // The target's attention: 37 new rows after 20 cached ones.
        let (n, past) = (37, 20);
        let q = inputs[0].narrow(1, 0, n)?.to_dtype(dtype)?.to_device(dev)?;
        let k = inputs[1]
            .narrow(1, 0, past + n)?
            .to_dtype(dtype)?
            .to_device(dev)?;
        let v = inputs[2]
            .narrow(1, 0, past + n)?
            .to_dtype(dtype)?
            .to_device(dev)?;
        let rows = Tensor::arange(past as u32, (past + n) as u32, dev)?.reshape((n, 1))?;
        let cols = Tensor::arange(0u32, (past + n) as u32, dev)?.reshape((1, past + n))?;
        let causal = cols.broadcast_le(&rows)?.where_cond(
            &Tensor::zeros((n, past + n), dtype, dev)?,
            &Tensor::full(f32::NEG_INFINITY, (n, past + n), dev)?.to_dtype(dtype)?,
        )?;
        let flash_ok = dflash_model::nn::fused::flash::supports(dev, dtype, d, heads, kv);
        all.push(ops::causal_attention(
            &q,
            &k,
            &v,
            past,
            (!flash_ok).then_some(&causal),
        )?);
        Ok(all)
    };
    let want = run(&cpu, DType::F64)?;
    let got = run(&device, DType::BF16)?;
    for (name, (g, w)) in ["out", "dq", "d_ck", "d_cv", "d_bk", "d_bv", "causal_out"]
        .iter()
        .zip(got.iter().zip(&want))
    {
        let scale = worst(w, &w.zeros_like()?)?;
        println!(
            "{}",
            serde_json::json!({"phase": "flash", "check": name, "device": format!("{device:?}"),
                "flash": dflash_model::nn::fused::flash::supports(&device, DType::BF16, d, heads, kv),
                "max_abs_diff": worst(g, w)?, "max_abs": scale, "relative": worst(g, w)? / scale})
        );
    }
    Ok(())
}

/// The median of `repeats` measurements by `f` (each returns the time it measured), after one
/// call to warm up (kernel loading, the memory pool).
fn median_after_warmup(repeats: usize, mut f: impl FnMut() -> Result<f64>) -> Result<f64> {
    f()?;
    let mut times: Vec<f64> = (0..repeats.max(1)).map(|_| f()).collect::<Result<_>>()?;
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// `f`'s result and its milliseconds, run once to warm up (kernel loading, the memory pool) and
/// once timed, the device synchronised around it.
/// The last output and the mean milliseconds of `f` over ten runs in a row after a warm-up,
/// the device synchronised at the ends only: the launches and any uploads as a decoding pass
/// meets them.
/// A kernel against its reference on the device (`train_probe fused`): both timed ten in a
/// row, and one line with the largest difference and both times.
fn compare(
    device: &Device,
    check: &str,
    dtype: DType,
    kernel: &dyn Fn() -> Result<Tensor>,
    reference: &dyn Fn() -> Result<Tensor>,
) -> Result<()> {
    let (got, ms) = ten_in_a_row(device, kernel)?;
    let (want, ms_reference) = ten_in_a_row(device, reference)?;
    println!(
        "{}",
        serde_json::json!({"phase": "fused", "check": check, "dtype": format!("{dtype:?}"),
            "device": format!("{device:?}"), "max_abs_diff": worst(&got, &want)?,
            "ms": ms, "ms_reference": ms_reference})
    );
    Ok(())
}

/// One line per tensor: the device's `got` against the CPU's `want`, the check named
/// `{name}_{shape}_vs_cpu`, with the largest difference and the reference's largest magnitude.
fn print_vs_cpu(
    names: &[&str],
    shape: &str,
    dtype: DType,
    got: &[Tensor],
    want: &[Tensor],
) -> Result<()> {
    for (name, (a, b)) in names.iter().zip(got.iter().zip(want)) {
        println!(
            "{}",
            serde_json::json!({"phase": "fused", "check": format!("{name}_{shape}_vs_cpu"),
                "dtype": format!("{dtype:?}"), "max_abs_diff": worst(a, b)?,
                "max_abs": worst(b, &b.zeros_like()?)?})
        );
    }
    Ok(())
}

fn ten_in_a_row(device: &Device, f: &dyn Fn() -> Result<Tensor>) -> Result<(Tensor, f64)> {
    f()?;
    device.synchronize()?;
    let t = Instant::now();
    let mut last = f()?;
    for _ in 1..10 {
        last = f()?;
    }
    device.synchronize()?;
    Ok((last, t.elapsed().as_secs_f64() * 1e3 / 10.0))
}

fn once_timed<T>(device: &Device, f: impl Fn() -> Result<T>) -> Result<(T, f64)> {
    f()?;
    device.synchronize()?;
    let t = Instant::now();
    let out = f()?;
    device.synchronize()?;
    Ok((out, t.elapsed().as_secs_f64() * 1e3))
}

/// Mean milliseconds of `f` over 3 runs after one warm-up, the device synchronised around each.
fn timed(device: &Device, label: &str, f: &dyn Fn() -> Result<()>) -> Result<()> {
    f()?;
    device.synchronize()?;
    let t = Instant::now();
    for _ in 0..3 {
        f()?;
    }
    device.synchronize()?;
    let ms = t.elapsed().as_secs_f64() * 1e3 / 3.0;
    println!(
        "{}",
        serde_json::json!({"phase": "part", "part": label, "ms": ms})
    );
    Ok(())
}

fn parts(args: &[String]) -> Result<()> {
    use candle_core::Var;
    use dflash_model::nn::{fused, ops};
    let device = device()?;
    let dtype = DType::BF16;
    let tc = preset(&arg(args, "--preset", "qwen3-8b".to_owned()));
    let (seq, anchors, block) = (
        arg(args, "--seq", 3072usize),
        arg(args, "--anchors", 128usize),
        arg(args, "--block", 16usize),
    );
    let target = Target::random(tc.clone(), 0, dtype, &device)?;
    let taps: Vec<usize> = dflash_model::drafter::spread_target_layers(tc.layers as u64, 5)
        .into_iter()
        .map(|l| l as usize)
        .collect();
    let config = DrafterConfig::for_target(&tc, 5, taps.clone(), block, tc.vocab as u32 - 1);
    let drafter = Drafter::init(config.clone(), 0, dtype, &device)?;
    let (ids, mask) = sequence(seq, tc.vocab, 0);
    let batch = Batch::sample(&ids, &mask, anchors, block, tc.vocab as u32 - 1, 7.0, 0)
        .ok_or("no anchors")?;
    let context = target.tapped(&ids, &taps)?;
    let embed = |t: &Tensor| target.embed(t);
    // Forward alone through the detached weights; forward and backward as `train` runs them on
    // this device (written out on a GPU).
    let frozen = drafter.frozen();
    let step = |backward: bool| -> Result<()> {
        if backward {
            loss_and_gradients_packed(
                &drafter,
                None,
                &embed,
                &target.lm_head,
                &context,
                &[&batch],
                batch.weight(),
                Backward::on(&device, &drafter),
            )?;
        } else {
            loss(
                &frozen,
                &embed,
                &target.lm_head,
                &context,
                &batch,
                batch.weight(),
            )?;
        }
        Ok(())
    };
    timed(&device, "target_forward", &|| {
        target.tapped(&ids, &taps)?;
        Ok(())
    })?;
    timed(&device, "drafter_forward", &|| step(false))?;
    timed(&device, "drafter_forward_backward", &|| step(true))?;
    let m = anchors * block;
    let (h, f) = (tc.hidden, tc.ffn);
    let randn = |shape: &[usize]| -> Result<Var> {
        Ok(Var::from_tensor(
            &Tensor::randn(0f32, 1.0, shape, &device)?.to_dtype(dtype)?,
        )?)
    };
    // Reduce without candle's one-block sum over everything: rows first.
    let reduce =
        |y: &Tensor| -> Result<Tensor> { Ok(y.flatten_to(y.rank() - 2)?.sum(1)?.sum_all()?) };
    let (x, w) = (randn(&[m, h])?, randn(&[f, h])?);
    timed(&device, "linear_m_x_4096_to_12288", &|| {
        reduce(&ops::Linear::Dense(w.as_tensor().clone()).forward(x.as_tensor())?)?.backward()?;
        Ok(())
    })?;
    let nw = randn(&[h])?;
    timed(&device, "rms_norm_m_x_4096", &|| {
        reduce(&fused::rms_norm(x.as_tensor(), nw.as_tensor(), 1e-6)?)?.backward()?;
        Ok(())
    })?;
    let qx = randn(&[tc.heads, m, tc.head_dim])?;
    let positions: Vec<u32> = (0..m as u32).collect();
    let (cos, sin) = ops::rope_tables(&positions, tc.head_dim, 1e6, dtype, &device)?;
    timed(&device, "rope_q", &|| {
        reduce(&fused::rope(qx.as_tensor(), &cos, &sin)?)?.backward()?;
        Ok(())
    })?;
    let (ck, cv) = (
        randn(&[tc.kv_heads, seq, tc.head_dim])?,
        randn(&[tc.kv_heads, seq, tc.head_dim])?,
    );
    let (bk, bv) = (
        randn(&[tc.kv_heads, m, tc.head_dim])?,
        randn(&[tc.kv_heads, m, tc.head_dim])?,
    );
    let amask = batch.mask();
    timed(&device, "block_attention", &|| {
        let a = ops::block_attention(
            qx.as_tensor(),
            (ck.as_tensor(), cv.as_tensor()),
            (bk.as_tensor(), bv.as_tensor()),
            block,
            &amask,
        )?;
        reduce(&a)?.backward()?;
        Ok(())
    })?;
    let hid = randn(&[anchors * (block - 1), h])?;
    timed(&device, "lm_head_cross_entropy", &|| {
        let logits = hid.as_tensor().matmul(&target.lm_head.t()?)?;
        fused::cross_entropy(&logits, &batch.labels)?
            .sum_all()?
            .backward()?;
        Ok(())
    })?;
    // What `train` runs on a GPU now: chunks of rows, the logits never whole.
    timed(&device, "lm_head_cross_entropy_chunked", &|| {
        fused::head_cross_entropy(hid.as_tensor(), &target.lm_head, &batch.labels, 1)?
            .nll
            .sum_all()?
            .backward()?;
        Ok(())
    })?;
    let (g, u) = (randn(&[m, f])?, randn(&[m, f])?);
    timed(&device, "swiglu_gate_m_x_12288", &|| {
        reduce(&fused::swiglu(g.as_tensor(), u.as_tensor())?)?.backward()?;
        Ok(())
    })?;
    timed(&device, "context_kv", &|| {
        let positions: Vec<u32> = (0..seq as u32).collect();
        drafter.context_kv(&context, &positions)?;
        Ok(())
    })?;
    Ok(())
}

fn parity(args: &[String]) -> Result<()> {
    let out = args.get(2).ok_or("parity OUT.safetensors")?;
    let device = device()?;
    let cpu = Device::Cpu;
    let tc = preset("small");
    // Weights drawn on CPU (the same on every machine), then moved.
    let target_cpu = Target::random(tc.clone(), 3, DType::F32, &cpu)?;
    let mut saved: HashMap<String, Tensor> = HashMap::new();
    for (n, t) in target_cpu.tensors() {
        saved.insert(format!("target.{n}"), t);
    }
    let config = DrafterConfig::for_target(&tc, 2, vec![1, 3], 8, tc.vocab as u32 - 1);
    let drafter_cpu = Drafter::init(config.clone(), 5, DType::F32, &cpu)?;
    for (n, t) in drafter_cpu.tensors(DType::F32)? {
        saved.insert(format!("drafter.{n}"), t);
    }
    // The same weights on the device under test.
    let target = target_cpu.to_device(&device)?;
    let moved: HashMap<String, Tensor> = drafter_cpu
        .tensors(DType::F32)?
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_device(&device)?)))
        .collect::<Result<_>>()?;
    let drafter = Drafter::from_tensors(config, &moved)?;
    let (ids, mask) = sequence(160, tc.vocab, 11);
    let batch =
        Batch::sample(&ids, &mask, 12, 8, tc.vocab as u32 - 1, 4.0, 9).ok_or("no anchors")?;
    let context = target.tapped(&ids, &[1, 3])?;
    let embed = |t: &Tensor| target.embed(t);
    // The gradients as `train` computes them on this device (written out on a GPU).
    let backward = Backward::on(&device, &drafter);
    let (l, _, grads) = loss_and_gradients_packed(
        &drafter,
        None,
        &embed,
        &target.lm_head,
        &context,
        &[&batch],
        batch.weight(),
        backward,
    )?;
    for (n, g) in grads {
        saved.insert(format!("grad.{n}"), g.to_device(&cpu)?);
    }
    let l = Tensor::new(l as f32, &device)?;
    let u32s = |v: &[u32]| Tensor::new(v.iter().map(|&x| i64::from(x)).collect::<Vec<i64>>(), &cpu);
    saved.insert("batch.ids".into(), u32s(&ids)?);
    saved.insert("batch.block_ids".into(), u32s(&batch.block_ids)?);
    saved.insert("batch.block_pos".into(), u32s(&batch.block_pos)?);
    saved.insert("batch.labels".into(), u32s(&batch.labels)?);
    let anchors: Vec<u32> = batch.anchors.iter().map(|&a| a as u32).collect();
    saved.insert("batch.anchors".into(), u32s(&anchors)?);
    saved.insert(
        "batch.weights".into(),
        Tensor::new(batch.weights.as_slice(), &cpu)?,
    );
    saved.insert("out.context".into(), context.to_device(&cpu)?);
    saved.insert("out.loss".into(), l.to_device(&cpu)?.reshape(1)?);
    candle_core::safetensors::save(&saved, out)?;
    println!(
        "{}",
        serde_json::json!({"phase": "parity", "device": format!("{device:?}"),
            "loss": l.to_scalar::<f32>()?, "tensors": saved.len(), "out": out,
            "backward": format!("{backward:?}")})
    );
    Ok(())
}

/// `train_probe target`: see the module docs.
fn target_forward(args: &[String]) -> Result<()> {
    let folder = args
        .get(2)
        .ok_or("train_probe target FOLDER [--tokens N] [--repeats N] [--dump OUT.safetensors]")?;
    let tokens: usize = arg(args, "--tokens", 512);
    let repeats: usize = arg(args, "--repeats", 3);
    let dump = args
        .iter()
        .position(|a| a == "--dump")
        .and_then(|i| args.get(i + 1));
    let device = dflash_model::nn::device::select("auto")?;
    let target = Target::load(std::path::Path::new(folder), &device)?;
    let vocab = target.config.vocab as u32;
    let ids: Vec<u32> = (0..tokens as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let all: Vec<usize> = (0..target.config.layers).collect();
    let run = || -> Result<f64> {
        let t = Instant::now();
        let out = target.tapped(&ids, &all)?;
        // Wait for the device: the sum crosses to the host.
        out.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        Ok(t.elapsed().as_secs_f64())
    };
    run()?;
    let mut times: Vec<f64> = (0..repeats.max(1)).map(|_| run()).collect::<Result<_>>()?;
    times.sort_by(f64::total_cmp);
    // Where the forward's time goes by layer: `tapped` runs the layers up to the last tap, so
    // the median time up to layer i, less that up to i - 1, is layer i's (with the embedding
    // in layer 0's). Each layer kind's cost, to set beside the reference's per-layer times.
    let upto: Vec<f64> = (0..all.len())
        .map(|i| {
            median_after_warmup(repeats, || {
                let t = Instant::now();
                let out = target.tapped(&ids, &[i])?;
                out.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?;
                Ok(t.elapsed().as_secs_f64())
            })
        })
        .collect::<Result<_>>()?;
    let layer_s: Vec<f64> = upto
        .iter()
        .enumerate()
        .map(|(i, t)| if i == 0 { *t } else { t - upto[i - 1] })
        .collect();
    if let Some(out) = dump {
        // Every layer's output, f32, for a reference to compare against.
        let tapped = target.tapped(&ids, &all)?.to_dtype(DType::F32)?;
        let saved = HashMap::from([("layers".to_string(), tapped)]);
        candle_core::safetensors::save(&saved, out)?;
    }
    println!(
        "{}",
        serde_json::json!({"tokens": tokens, "layers": target.config.layers,
            "dtype": format!("{:?}", target.lm_head.dtype()),
            "device": if device.is_cuda() { "cuda" } else { "cpu" },
            "seconds": times[times.len() / 2], "all": times, "layer_seconds": layer_s})
    );
    if args.iter().any(|a| a == "--phases") {
        // Each Gated DeltaNet layer's time by phase, over an input of the layer's shape.
        let x = Tensor::randn(0f32, 1.0, (tokens, target.config.hidden), &device)?
            .to_dtype(target.lm_head.dtype())?;
        for (layer, phases) in target.delta_phases(&x, repeats)? {
            let ms: serde_json::Map<String, serde_json::Value> = phases
                .into_iter()
                .map(|(p, s)| (p.to_string(), (s * 1e3).into()))
                .collect();
            println!(
                "{}",
                serde_json::json!({"phase": "delta_phases", "layer": layer, "tokens": tokens, "ms": ms})
            );
        }
    }
    Ok(())
}

fn decode(args: &[String]) -> Result<()> {
    let model = args
        .get(2)
        .ok_or("train_probe decode MODEL [--batch 512] [--prompt 300] [--steps 32]")?;
    let batch: usize = arg(args, "--batch", 512);
    let prompt: usize = arg(args, "--prompt", 300);
    let steps: usize = arg(args, "--steps", 32);
    let device = dflash_model::nn::device::select("auto")?;
    dflash_model::nn::fused::prepare_device(&device)?;
    let target = Target::load(std::path::Path::new(model), &device)?;
    let vocab = target.config.vocab as u32;
    let prompts: Vec<Vec<u32>> = (0..batch as u32)
        .map(|b| {
            (0..prompt as u32)
                .map(|i| (i * 7919 + b * 104_729 + 13) % vocab)
                .collect()
        })
        .collect();
    let slices: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let argmax = |logits: &Tensor| -> Result<Vec<u32>> {
        Ok(logits.argmax(candle_core::D::Minus1)?.to_vec1::<u32>()?)
    };
    // A warm-up batch (kernel loading, the memory pool), then the timed one.
    for timed in [false, true] {
        let t0 = Instant::now();
        let (mut decoder, logits) =
            dflash_model::nn::batch::BatchDecoder::prefill(&target, &slices, steps + 1)?;
        let mut next = argmax(&logits)?;
        let prefill_s = t0.elapsed().as_secs_f64();
        let mut times = Vec::with_capacity(steps);
        for _ in 0..if timed { steps } else { 2 } {
            let t = Instant::now();
            next = argmax(&decoder.step(&next)?)?;
            times.push(t.elapsed().as_secs_f64());
        }
        if timed {
            times.sort_by(f64::total_cmp);
            let step = times[times.len() / 2];
            println!(
                "{}",
                serde_json::json!({"phase": "decode", "device": if device.is_cuda() { "cuda" } else { "cpu" },
                    "dtype": format!("{:?}", target.lm_head.dtype()), "batch": batch, "prompt": prompt,
                    "steps": steps, "prefill_s": prefill_s, "step_s_median": step,
                    "tokens_per_second": batch as f64 / step, "all": times})
            );
        }
    }
    Ok(())
}

fn verify(args: &[String]) -> Result<()> {
    let model = args
        .get(2)
        .ok_or("train_probe verify MODEL [--context 300] [--repeats 20]")?;
    let context: usize = arg(args, "--context", 300);
    let repeats: usize = arg(args, "--repeats", 20).max(1);
    let device = dflash_model::nn::device::select("auto")?;
    dflash_model::nn::fused::prepare_device(&device)?;
    let target = Target::load(std::path::Path::new(model), &device)?;
    let (vocab, layers) = (target.config.vocab as u32, target.config.layers);
    let ids: Vec<u32> = (0..(context + 128) as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let mut base = dflash_model::nn::target::KvCache::default();
    target.extend(&ids[..context], &mut base, &[])?;
    // Five taps spread over the layers, as a drafter's.
    let five: Vec<usize> = (0..5).map(|i| 1 + i * (layers - 4) / 4).collect();
    let on = if device.is_cuda() { "cuda" } else { "cpu" };
    let argmax = |logits: &Tensor| -> Result<Vec<u32>> {
        Ok(logits.argmax(candle_core::D::Minus1)?.to_vec1::<u32>()?)
    };
    // Up to 128: a tree of 64 or 128 nodes (`bench`'s `tree_budget`) is one pass.
    for n in [1usize, 2, 4, 8, 16, 32, 64, 128] {
        let tokens = &ids[context..context + n];
        let chain: Vec<usize> = (0..n).map(|i| i.saturating_sub(1)).collect();
        let mut row = serde_json::Map::new();
        for (name, taps, tree) in [
            ("extend_ms", &[][..], false),
            ("extend_taps_ms", &five[..], false),
            ("tree_taps_ms", &five[..], true),
        ] {
            // Each pass after a copy of the same cache.
            let ms = median_after_warmup(repeats, || {
                let mut cache = base.clone();
                let t = Instant::now();
                let (logits, tapped) = if tree {
                    target.extend_tree(tokens, &chain, &mut cache, taps)?
                } else {
                    target.extend(tokens, &mut cache, taps)?
                };
                argmax(&logits)?;
                if let Some(t) = tapped {
                    t.device().synchronize()?;
                }
                Ok(t.elapsed().as_secs_f64() * 1e3)
            })?;
            row.insert(name.into(), ms.into());
        }
        println!(
            "{}",
            serde_json::json!({"phase": "verify", "device": on, "context": context, "n": n,
                "dtype": format!("{:?}", target.lm_head.dtype()), "ms": row})
        );
    }
    // One projection's matmul, hidden -> MLP width, as the pass runs it (`Linear::forward`).
    let (hidden, width) = (target.config.hidden, target.config.ffn);
    for dtype in [DType::F32, DType::BF16] {
        let w = Tensor::randn(0f32, 0.02, (width, hidden), &device)?.to_dtype(dtype)?;
        let w = dflash_model::nn::ops::Linear::Dense(w);
        for n in [1usize, 2, 4, 8, 16, 32] {
            let x = Tensor::randn(0f32, 1.0, (n, hidden), &device)?.to_dtype(dtype)?;
            let ms = median_after_warmup(repeats, || {
                device.synchronize()?;
                let t = Instant::now();
                // Ten in a row, so the launch and the kernel are timed, not the synchronisation.
                for _ in 0..10 {
                    w.forward(&x)?;
                }
                device.synchronize()?;
                Ok(t.elapsed().as_secs_f64() * 1e3 / 10.0)
            })?;
            println!(
                "{}",
                serde_json::json!({"phase": "verify_matmul", "device": on, "dtype": format!("{dtype:?}"),
                    "n": n, "in": hidden, "out": width, "ms": ms})
            );
        }
    }
    Ok(())
}

fn round(args: &[String]) -> Result<()> {
    use dflash_model::nn::speculative::{self, Proposer, Settings};
    let usage =
        "train_probe round MODEL DRAFTER [--context 300] [--new 128] [--width 8] [--budget 64]";
    let (model, folder) = (args.get(2).ok_or(usage)?, args.get(3).ok_or(usage)?);
    let context: usize = arg(args, "--context", 300);
    let new: usize = arg(args, "--new", 128);
    let width: usize = arg(args, "--width", 8);
    // One tree per budget: `--budget 64,128`.
    let budgets: Vec<usize> = arg(args, "--budget", "64".to_string())
        .split(',')
        .map(str::parse)
        .collect::<std::result::Result<_, _>>()?;
    let device = dflash_model::nn::device::select("auto")?;
    dflash_model::nn::fused::prepare_device(&device)?;
    let target = Target::load(std::path::Path::new(model), &device)?;
    let folder = std::path::Path::new(folder);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(folder.join("config.json"))?)?;
    let config = DrafterConfig::from_hf_config(&config)?;
    // As `bench` loads it: f32 weights, cast with the activations.
    let tensors: HashMap<String, Tensor> =
        candle_core::safetensors::load(folder.join("model.safetensors"), &device)?
            .into_iter()
            .map(|(k, t)| Ok((k, t.to_dtype(DType::F32)?)))
            .collect::<std::result::Result<_, candle_core::Error>>()?;
    let drafter = Drafter::from_tensors(config, &tensors)?;
    let vocab = target.config.vocab as u32;
    let prompt: Vec<u32> = (0..context as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let block = drafter.config.block_size;
    let mut methods: Vec<(String, Proposer)> = vec![
        ("autoregressive".into(), Proposer::Autoregressive),
        ("ngram".into(), Proposer::Ngram { n: 3 }),
        ("drafter".into(), Proposer::Drafter(&drafter)),
    ];
    for &budget in &budgets {
        for lookup in [0, 3] {
            methods.push((
                format!(
                    "drafter+tree{budget}{}",
                    if lookup > 0 { "+lookup" } else { "" }
                ),
                Proposer::DrafterTree {
                    drafter: &drafter,
                    width,
                    budget,
                    lookup,
                },
            ));
        }
    }
    for (name, proposer) in &methods {
        let settings = |profile: bool| Settings {
            block_size: if matches!(proposer, Proposer::Autoregressive) {
                1
            } else {
                block
            },
            max_new_tokens: new,
            temperature: 0.0,
            seed: 0,
            stop: Vec::new(),
            profile,
        };
        // A warm-up (kernel loading, the memory pool), then the round as timed, then profiled.
        speculative::decode(&target, proposer, &prompt, &settings(false))?;
        let plain = speculative::decode(&target, proposer, &prompt, &settings(false))?;
        let profiled = speculative::decode(&target, proposer, &prompt, &settings(true))?;
        let per_round = |s: f64, d: &speculative::Decoded| s * 1e3 / d.rounds.max(1) as f64;
        let phases: serde_json::Map<String, serde_json::Value> = profiled
            .phase_seconds
            .iter()
            .map(|(p, s)| ((*p).to_string(), per_round(*s, &profiled).into()))
            .collect();
        println!(
            "{}",
            serde_json::json!({"phase": "round", "device": if device.is_cuda() { "cuda" } else { "cpu" },
                "method": name, "context": context, "rounds": plain.rounds, "tau": plain.tau(),
                "identical_profiled": plain.tokens == profiled.tokens,
                "ms_per_round": per_round(plain.decode_seconds, &plain),
                "propose_ms_per_round": per_round(plain.propose_seconds, &plain),
                "profiled_ms_per_round": per_round(profiled.decode_seconds, &profiled),
                "phases_ms_per_round": phases})
        );
    }
    Ok(())
}

#[allow(unsafe_code)]
fn main() -> Result<()> {
    // SAFETY: first thing in main, before any thread exists.
    unsafe { dflash_model::threads::settle_cpu_threads() };
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("speed") => speed(&args),
        Some("parity") => parity(&args),
        Some("fused") => fused(&args),
        Some("parts") => parts(&args),
        Some("flash") => flash(&args),
        Some("target") => target_forward(&args),
        Some("decode") => decode(&args),
        Some("verify") => verify(&args),
        Some("round") => round(&args),
        _ => Err(
            "usage: train_probe speed [...] | parts [...] | fused | flash | target FOLDER [...] | decode MODEL [...] | verify MODEL [...] | round MODEL DRAFTER [...] | parity OUT.safetensors"
                .into(),
        ),
    }
}
