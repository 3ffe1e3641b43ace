//! One online training step of the DFlash drafter, measured — the numbers behind issue 7.
//!
//! `train_probe speed [--preset qwen3-8b|small] [--seq 3072] [--anchors 512] [--block 16]
//! [--layers 5] [--steps 4] [--dtype bf16|f32]`: a target with random weights at the preset's
//! shape, a drafter, one random sequence; prints one JSON line per step with the target
//! forward, the drafter's forward + backward and the AdamW update timed apart (the device is
//! synchronised between them), then a summary line.
//!
//! `train_probe parity OUT.safetensors`: a small target and drafter (f32, weights drawn on CPU),
//! one sequence, one loss; writes every weight, the batch, the loss, the taps and every
//! gradient, for `bench/train_reference.py` to recompute in PyTorch and compare.

use std::collections::HashMap;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use dflash_model::nn::objective::{Batch, loss};
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
        },
    }
}

fn device() -> Result<Device> {
    Ok(Device::cuda_if_available(0)?)
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
    let target = Target::random(tc.clone(), 0, dtype, &device)?;
    let taps = dflash_model::drafter::spread_target_layers(tc.layers as u64, 5)
        .into_iter()
        .map(|l| l as usize)
        .collect();
    let config = DrafterConfig::for_target(&tc, layers, taps, block, tc.vocab as u32 - 1);
    let drafter = Drafter::init(config.clone(), 0, dtype, &device)?;
    let mut adam = AdamW::new(&drafter.vars, 0.0)?;
    device.synchronize()?;
    println!(
        "{}",
        serde_json::json!({"phase": "init", "seconds": t0.elapsed().as_secs_f64(),
            "device": format!("{device:?}"), "dtype": format!("{dtype:?}"),
            "drafter_parameters": config.parameters(), "seq": seq, "anchors": anchors,
            "block": block})
    );
    let embed = |t: &Tensor| target.embed(t);
    let mut totals = Vec::new();
    for step in 0..steps {
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
        let context = target.tapped(&ids, &config.target_layers)?;
        device.synchronize()?;
        let target_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let (l, _) = loss(
            &drafter,
            &embed,
            &target.lm_head,
            &context,
            &batch,
            batch.weight(),
        )?;
        let grads = l.backward()?;
        device.synchronize()?;
        let drafter_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let g = drafter.gradients(&grads);
        adam.step(&drafter.vars, &g, 6e-4, 1.0)?;
        device.synchronize()?;
        let optim_ms = t.elapsed().as_secs_f64() * 1e3;
        let total = target_ms + drafter_ms + optim_ms;
        println!(
            "{}",
            serde_json::json!({"phase": "step", "step": step, "target_ms": target_ms,
                "drafter_ms": drafter_ms, "optim_ms": optim_ms, "total_ms": total,
                "loss": l.to_dtype(DType::F32)?.to_scalar::<f32>()?})
        );
        totals.push((target_ms, drafter_ms, optim_ms, total));
    }
    // The first step pays for kernel loading and allocation: the rest are the figure.
    let warm = &totals[1.min(totals.len() - 1)..];
    let mean =
        |f: fn(&(f64, f64, f64, f64)) -> f64| warm.iter().map(f).sum::<f64>() / warm.len() as f64;
    println!(
        "{}",
        serde_json::json!({"phase": "summary", "target_ms": mean(|t| t.0), "drafter_ms": mean(|t| t.1),
            "optim_ms": mean(|t| t.2), "total_ms": mean(|t| t.3), "steps_timed": warm.len()})
    );
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
    let (l, _) = loss(
        &drafter,
        &embed,
        &target.lm_head,
        &context,
        &batch,
        batch.weight(),
    )?;
    let grads = l.backward()?;
    for (n, g) in drafter.gradients(&grads) {
        saved.insert(format!("grad.{n}"), g.to_device(&cpu)?);
    }
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
            "loss": l.to_scalar::<f32>()?, "tensors": saved.len(), "out": out})
    );
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("speed") => speed(&args),
        Some("parity") => parity(&args),
        _ => Err("usage: train_probe speed [...] | parity OUT.safetensors".into()),
    }
}
