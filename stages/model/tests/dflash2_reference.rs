//! A DFlash 2 drafter exported by dflash, against z-lab's reference implementation
//! (`dflash==0.1.0`, `DFlash2DraftModel`) loading that export unchanged: the drafter's final
//! hidden states and the candidate selector's proposals for one block, on the same context.
//!
//! The test writes the export (`config.json`, `model.safetensors`, bf16, as `train` writes it)
//! and the inputs (the tapped context rows, the block, the embedding and LM head) under
//! `target/tmp/dflash2_reference/`, runs its own drafter on them, and compares with what the
//! reference computed from those files (`tests/fixtures/dflash2_reference.json`). The reference
//! needs torch, which CI does not have; to recompute the fixture where it is:
//! `python3 tests/support/dflash2_reference.py target/tmp/dflash2_reference
//! stages/model/tests/fixtures/dflash2_reference.json` (with `dflash==0.1.0` and torch).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use dflash_model::Dflash2Config;
use dflash_model::nn::drafter::Init;
use dflash_model::nn::ops::BlockMask;
use dflash_model::nn::{Drafter, DrafterConfig, TargetConfig};

const BLOCK: usize = 8;
const CONTEXT: usize = 11;

fn target() -> TargetConfig {
    TargetConfig {
        family: "qwen3".into(),
        hidden: 32,
        layers: 4,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        ffn: 48,
        vocab: 64,
        eps: 1e-6,
        rope_theta: 10_000.0,
        qk_norm: true,
        context: 4096,
        hybrid: None,
    }
}

#[test]
fn dflash2_export_matches_the_reference_implementation() {
    let cpu = Device::Cpu;
    let tc = target();
    let config =
        DrafterConfig::for_target(&tc, 2, vec![0, 1, 2], BLOCK, 63).with_dflash2(Dflash2Config {
            conv_kernel_size: 4,
            conv_group_size: 8,
            selector_rank: 8,
            selector_top_k: 6,
        });
    let fresh = Drafter::init(config.clone(), 5, DType::F32, &cpu).unwrap();
    // Off the identity and with codebooks large enough for the selector to overrule the
    // logits, so every part shows in the outputs.
    let mut init = Init::new(9);
    for (name, var) in &fresh.vars {
        let scale = if name.contains("_conv.") || name.starts_with("candidate_selector") {
            0.5
        } else {
            0.0
        };
        if scale > 0.0 {
            let noise = init
                .normal(var.as_tensor().dims(), scale, DType::F32, &cpu)
                .unwrap();
            var.set(&(var.as_tensor() + noise).unwrap()).unwrap();
        }
    }
    // The export, as `train` writes it (bf16), and the drafter read back from it, so both sides
    // start from the same rounded weights.
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dflash2_reference");
    let export = dir.join("drafter");
    std::fs::create_dir_all(&export).unwrap();
    candle_core::safetensors::save(
        &fresh.tensors(DType::BF16).unwrap(),
        export.join("model.safetensors"),
    )
    .unwrap();
    std::fs::write(
        export.join("config.json"),
        serde_json::to_vec_pretty(&config.hf_config("qwen3")).unwrap(),
    )
    .unwrap();
    let loaded: HashMap<String, Tensor> =
        candle_core::safetensors::load(export.join("model.safetensors"), &cpu)
            .unwrap()
            .into_iter()
            .map(|(k, t)| (k, t.to_dtype(DType::F32).unwrap()))
            .collect();
    let drafter = Drafter::from_tensors(config.clone(), &loaded).unwrap();

    // The inputs: tapped context rows, the block (anchor then masks), embedding and LM head.
    let h = tc.hidden;
    let context = init
        .normal(&[CONTEXT, 3 * h], 1.0, DType::F32, &cpu)
        .unwrap();
    let embed = init.normal(&[tc.vocab, h], 1.0, DType::F32, &cpu).unwrap();
    let lm_head = init.normal(&[tc.vocab, h], 0.5, DType::F32, &cpu).unwrap();
    let anchor = 17u32;
    let ids: Vec<u32> = std::iter::once(anchor)
        .chain(std::iter::repeat_n(63, BLOCK - 1))
        .collect();
    let inputs: HashMap<String, Tensor> = [
        ("context", context.clone()),
        ("embed", embed.clone()),
        ("lm_head", lm_head.clone()),
        (
            "block_ids",
            Tensor::new(ids.as_slice(), &cpu)
                .unwrap()
                .to_dtype(DType::I64)
                .unwrap(),
        ),
    ]
    .into_iter()
    .map(|(k, t)| (k.to_owned(), t))
    .collect();
    candle_core::safetensors::save(&inputs, dir.join("inputs.safetensors")).unwrap();

    // dflash's side, as `bench` proposes.
    let ctx_pos: Vec<u32> = (0..CONTEXT as u32).collect();
    let block_pos: Vec<u32> = (CONTEXT as u32..(CONTEXT + BLOCK) as u32).collect();
    let ctx = drafter.context_kv(&context, &ctx_pos).unwrap();
    let block = embed
        .index_select(&Tensor::new(ids.as_slice(), &cpu).unwrap(), 0)
        .unwrap();
    let mask = BlockMask::new(vec![CONTEXT as u32], CONTEXT, BLOCK);
    let hidden = drafter
        .forward_block(&ctx, &block, &block_pos, &mask)
        .unwrap()
        .narrow(0, 1, BLOCK - 1)
        .unwrap();
    let logits = hidden.matmul(&lm_head.t().unwrap()).unwrap();
    let d2 = config.dflash2.as_ref().unwrap();
    let proposed =
        dflash_model::nn::dflash2::select(&hidden, &logits, anchor, d2, &|n| drafter.w(n).clone())
            .unwrap();
    let argmax: Vec<u32> = logits.argmax(1).unwrap().to_vec1().unwrap();

    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/dflash2_reference.json");
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&fixture).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; compute it with tests/support/dflash2_reference.py (see this file's docs)",
                fixture.display()
            )
        }),
    )
    .unwrap();
    let want_hidden: Vec<Vec<f32>> = serde_json::from_value(reference["hidden"].clone()).unwrap();
    let got_hidden: Vec<Vec<f32>> = hidden.to_vec2().unwrap();
    let diff = want_hidden
        .iter()
        .flatten()
        .zip(got_hidden.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(diff < 1e-4, "hidden states differ by {diff}");
    let want: Vec<u32> = serde_json::from_value(reference["proposed"].clone()).unwrap();
    assert_eq!(proposed, want, "the selector's proposals");
    // The selector changed something, or the comparison would not test it.
    assert_ne!(
        proposed, argmax,
        "the selector agreed with the logits everywhere"
    );
}
