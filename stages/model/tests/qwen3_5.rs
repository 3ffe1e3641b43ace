//! A hybrid target (Qwen3.5: Gated DeltaNet and gated full attention) loaded from a Hugging Face
//! folder: a tiny one with random weights, written by `tests/support/qwen3_5_reference.py` (numpy
//! draws, the same bytes on every machine), checked against transformers 5.24's
//! `Qwen3_5ForCausalLM` on the same folder (its outputs in `fixtures/qwen3_5_reference.json`,
//! computed by the script where torch is), and against itself: the chunked form, decoding one
//! token at a time, a speculative round cropped back to its accepted prefix, a tree pass cut
//! down to one of its paths, and a batch decoded together.

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{Device, Tensor};
use dflash_model::nn::Target;
use dflash_model::nn::batch::BatchDecoder;
use dflash_model::nn::target::KvCache;

/// Run `tests/support/qwen3_5_reference.py` with `args`; its error output on failure.
fn reference_script(args: &[&std::ffi::OsStr]) {
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/support/qwen3_5_reference.py");
    let out = Command::new("python3")
        .arg(&script)
        .args(args)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn model_dir() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("qwen3_5");
    reference_script(&["write".as_ref(), folder.as_os_str()]);
    (dir, folder)
}

fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_dtype(candle_core::DType::F32)
        .unwrap()
        .to_vec2()
        .unwrap()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

fn json_rows(v: &serde_json::Value) -> Vec<Vec<f32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect()
}

fn prompt() -> Vec<u32> {
    (0..150u32).map(|i| (i * 37 + 11) % 96).collect()
}

/// A reference file in `fixtures/` (what `tests/support/qwen3_5_reference.py` wrote).
fn reference(file: &str) -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(file);
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(fixture["transformers"], "5.24.0", "the reference's version");
    fixture
}

/// A prompt's token ids, and the logits and every layer's output over the whole prompt (a
/// hybrid's chunked form) against the reference's.
fn matches_prompt(target: &Target, p: &serde_json::Value, what: &str) -> Vec<u32> {
    let ids: Vec<u32> = p["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let c = &target.config;
    let mut cache = KvCache::default();
    let (logits, _) = target.extend(&ids, &mut cache, &[]).unwrap();
    let d = max_diff(&rows(&logits), &json_rows(&p["logits"]));
    assert!(
        d < 2e-3,
        "{what}, prompt of {}: logits differ by {d}",
        ids.len()
    );
    let all: Vec<usize> = (0..c.layers).collect();
    let tapped = rows(&target.tapped(&ids, &all).unwrap());
    for (i, layer) in p["layers"].as_array().unwrap().iter().enumerate() {
        let got: Vec<Vec<f32>> = tapped
            .iter()
            .map(|r| r[i * c.hidden..(i + 1) * c.hidden].to_vec())
            .collect();
        let d = max_diff(&got, &json_rows(layer));
        assert!(d < 2e-3, "{what}, layer {i}: {d}");
    }
    ids
}

#[test]
fn the_hybrid_matches_transformers_logits_and_every_layer() {
    let (_dir, folder) = model_dir();
    let target = Target::load(&folder, &Device::Cpu).unwrap();
    let h = target.config.hybrid.as_ref().expect("a hybrid");
    assert_eq!(h.linear, vec![true, true, false, true]);
    assert_eq!(h.rotary_dim, 4);
    for p in reference("qwen3_5_reference.json")["prompts"]
        .as_array()
        .unwrap()
    {
        let ids = matches_prompt(&target, p, "qwen3_5");
        // Decoding: the recurrent form with its state, one token at a time after a prefix.
        if let Some(from) = p["decode_from"].as_u64() {
            let from = from as usize;
            let mut cache = KvCache::default();
            target.extend(&ids[..from], &mut cache, &[]).unwrap();
            let mut stepped = Vec::new();
            for &t in &ids[from..] {
                let (l, _) = target.extend(&[t], &mut cache, &[]).unwrap();
                stepped.extend(rows(&l));
            }
            let d = max_diff(&stepped, &json_rows(&p["decode_logits"]));
            assert!(d < 2e-3, "decoding: {d}");
        }
    }
}

/// The logits and taps of one pass over all of `ids`, and a cache holding their first `prefix`.
fn whole_and_prefix(
    target: &Target,
    ids: &[u32],
    taps: &[usize],
    prefix: usize,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>, KvCache) {
    let mut cache = KvCache::default();
    let (l, t) = target.extend(ids, &mut cache, taps).unwrap();
    let mut prefixed = KvCache::default();
    target.extend(&ids[..prefix], &mut prefixed, taps).unwrap();
    (rows(&l), rows(&t.unwrap()), prefixed)
}

/// A speculative round: a pass over an anchor and proposals keeps every position's state, is
/// cropped to the accepted prefix, and decoding goes on from there exactly as if only the
/// accepted tokens had been fed; taps equal the whole-sequence pass's.
#[test]
fn a_verification_pass_is_cropped_to_its_accepted_prefix() {
    let (_dir, folder) = model_dir();
    let target = Target::load(&folder, &Device::Cpu).unwrap();
    let (ids, taps) = (prompt(), [1usize, 2]);
    let (whole, whole_taps, mut cache) = whole_and_prefix(&target, &ids, &taps, 100);
    // 12 tokens verified: 8 of them right, then 4 wrong ones.
    let mut proposal: Vec<u32> = ids[100..108].to_vec();
    proposal.extend([1, 2, 3, 4]);
    target.extend(&proposal, &mut cache, &taps).unwrap();
    cache.truncate(108).unwrap();
    assert_eq!(cache.len(), 108);
    let (rest, rest_taps) = target.extend(&ids[108..], &mut cache, &taps).unwrap();
    let d = max_diff(&rows(&rest), &whole[108..].to_vec());
    assert!(d < 1e-3, "logits after the crop: {d}");
    let d = max_diff(&rows(&rest_taps.unwrap()), &whole_taps[108..].to_vec());
    assert!(d < 1e-3, "taps after the crop: {d}");
    // A prefill keeps only its end: cropping into it is refused, not wrong.
    let mut cache = KvCache::default();
    target.extend(&ids[..100], &mut cache, &[]).unwrap();
    let e = cache.truncate(50).unwrap_err().to_string();
    assert!(e.contains("position 50"), "{e}");
}

/// Tree verification: one pass over a tree of tokens whose branches share a prefix; each node's
/// logits are what the whole sequence gives at the end of its path, and once one path is kept,
/// decoding goes on as if only that path had been fed (the Gated DeltaNet layers' state and the
/// attention layers' keys and values both).
#[test]
fn a_tree_pass_gives_each_path_its_own_state() {
    let (_dir, folder) = model_dir();
    let target = Target::load(&folder, &Device::Cpu).unwrap();
    let (ids, taps) = (prompt(), [1usize, 2]);
    let (whole, whole_taps, mut cache) = whole_and_prefix(&target, &ids, &taps, 100);
    // Node 0 is ids[100]; the true path is 0 -> 2 -> 3 -> 6 -> 7 (ids[101..105]); wrong
    // siblings hang off it at every depth, one of them with a child of its own.
    let (a, b) = (ids[101], ids[102]);
    let (c, d) = (ids[103], ids[104]);
    let tokens = [ids[100], 5, a, b, 7, 9, c, d, 11];
    let parents = [0usize, 0, 0, 2, 1, 3, 3, 6, 6];
    let path = [0usize, 2, 3, 6, 7];
    let (logits, tapped) = target
        .extend_tree(&tokens, &parents, &mut cache, &taps)
        .unwrap();
    let (logits, tapped) = (rows(&logits), rows(&tapped.unwrap()));
    for (j, &node) in path.iter().enumerate() {
        let d = max_diff(&logits[node..=node], &whole[100 + j..=100 + j]);
        assert!(d < 1e-3, "node {node} (position {}): logits {d}", 100 + j);
        let d = max_diff(&tapped[node..=node], &whole_taps[100 + j..=100 + j]);
        assert!(d < 1e-3, "node {node}: taps {d}");
    }
    // Without a path chosen, the pass cannot be extended or cropped.
    let mut unchosen = cache.clone();
    let e = target.extend(&[1], &mut unchosen, &[]).unwrap_err();
    assert!(e.to_string().contains("keep one path"), "{e}");
    cache.keep_path(100, &path).unwrap();
    assert_eq!(cache.len(), 105);
    let (rest, rest_taps) = target.extend(&ids[105..], &mut cache, &taps).unwrap();
    let d = max_diff(&rows(&rest), &whole[105..].to_vec());
    assert!(d < 1e-3, "logits after the kept path: {d}");
    let d = max_diff(&rows(&rest_taps.unwrap()), &whole_taps[105..].to_vec());
    assert!(d < 1e-3, "taps after the kept path: {d}");
}

/// Batched generation on a hybrid: prompts of different lengths prefilled in one pass and
/// stepped together give each sequence the logits it gets decoded alone.
#[test]
fn a_hybrid_batch_decodes_each_sequence_as_it_decodes_alone() {
    let (_dir, folder) = model_dir();
    let target = Target::load(&folder, &Device::Cpu).unwrap();
    let ids = prompt();
    // One prompt long enough for the chunked form (over 64 tokens), two short ones.
    let prompts: [&[u32]; 3] = [&ids[..90], &ids[90..93], &ids[20..21]];
    let (mut batch, mut logits) = BatchDecoder::prefill(&target, &prompts, 6).unwrap();
    let mut alone: Vec<(KvCache, Vec<Vec<f32>>)> = prompts
        .iter()
        .map(|p| {
            let mut cache = KvCache::default();
            let (l, _) = target.extend(p, &mut cache, &[]).unwrap();
            (cache, rows(&l)[p.len() - 1..].to_vec())
        })
        .collect();
    for step in 0..6u32 {
        let got = rows(&logits);
        for (row, (_, want)) in alone.iter().enumerate() {
            let d = max_diff(&got[row..=row], want);
            assert!(d < 1e-4, "step {step}, sequence {row}: {d}");
        }
        let next: Vec<u32> = (0..3).map(|r| (step * 7 + r * 11) % 96).collect();
        logits = batch.step(&next).unwrap();
        for ((cache, want), &t) in alone.iter_mut().zip(&next) {
            *want = rows(&target.extend(&[t], cache, &[]).unwrap().0);
        }
    }
}

/// A tiny model of `kind` (`tests/support/qwen3_5_reference.py write-kind`: numpy draws in the
/// published per-expert layout) against transformers' outputs for it in
/// `fixtures/{name}_reference.json`: logits and every layer's output.
fn matches_saved_reference(kind: &str, name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join(name);
    reference_script(&["write-kind".as_ref(), kind.as_ref(), folder.as_os_str()]);
    let target = Target::load(&folder, &Device::Cpu).unwrap();
    for p in reference(&format!("{name}_reference.json"))["prompts"]
        .as_array()
        .unwrap()
    {
        matches_prompt(&target, p, name);
    }
}

/// Qwen3.5-MoE: routed experts and the gated shared expert on the hybrid layers.
#[test]
fn a_qwen3_5_moe_target_matches_transformers() {
    matches_saved_reference("moe", "qwen3_5_moe");
}

/// Qwen3-Next: fused per-key-head projections, a dense layer among sparse ones, the top-k
/// probabilities not renormalised.
#[test]
fn a_qwen3_next_target_matches_transformers() {
    matches_saved_reference("next", "qwen3_next");
}

/// Qwen3-MoE: dense attention, routed experts without a shared one, a dense layer among them.
#[test]
fn a_qwen3_moe_target_matches_transformers() {
    matches_saved_reference("qwen3_moe", "qwen3_moe");
}

/// The same tiny Qwen3-MoE as a llama.cpp `qwen3moe` GGUF file (`qwen3_5_reference.py
/// write-gguf`: the same draws, each layer's experts stacked in one tensor per projection, the
/// dense layer under the dense names), loaded from GGUF: transformers' logits and every layer
/// as from the Hugging Face folder; stored in f16 or Q8_0, within their rounding of the f32
/// file's.
#[test]
fn a_qwen3_moe_gguf_target_matches_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, extra: &[&str]| -> PathBuf {
        let file = dir.path().join(name);
        let mut args = vec![
            "write-gguf".as_ref(),
            "qwen3_moe".as_ref(),
            file.as_os_str(),
        ];
        args.extend(extra.iter().map(|a| std::ffi::OsStr::new(*a)));
        reference_script(&args);
        file
    };
    let file = write("q.gguf", &[]);
    let target = Target::load(&file, &Device::Cpu).unwrap();
    assert_eq!(target.config.family, "qwen3_moe");
    // `estimate` sizes it as the folder: one expert's width, 6 experts, 2 a token.
    let shape = dflash_model::shape::ModelShape::from_gguf(&file).unwrap();
    assert_eq!((shape.family.as_str(), shape.ffn), ("qwen3_moe", 24));
    let experts = shape.experts.expect("experts");
    assert_eq!((experts.count, experts.per_token), (6, 2));
    let prompts = reference("qwen3_moe_reference.json")["prompts"].clone();
    for p in prompts.as_array().unwrap() {
        matches_prompt(&target, p, "qwen3moe GGUF");
    }
    let ids: Vec<u32> = (0..40u32).map(|i| (i * 37 + 11) % 96).collect();
    let logits = |t: &Target| rows(&t.extend(&ids, &mut KvCache::default(), &[]).unwrap().0);
    let full = logits(&target);
    // Stored in f16, and in Q8_0 (the stacked experts cut at whole blocks): near, not equal
    // (2.1e-4 and 3.7e-3 when written; an expert cut at the wrong bytes is off by whole units).
    for (name, flag, within) in [("q16.gguf", "--f16", 2e-3), ("q8.gguf", "--q8_0", 2e-2)] {
        let other = Target::load(&write(name, &[flag]), &Device::Cpu).unwrap();
        let d = max_diff(&logits(&other), &full);
        assert!(d > 0.0 && d < within, "{flag} file against f32: {d}");
    }
}

/// Interop with llama.cpp itself: a Qwen3-MoE GGUF that llama.cpp loads (a router in every
/// layer, as it requires, and a vocabulary it can read) gives llama.cpp's logits (llama-cpp-python
/// runs its own loader and forward on the same file) when dflash loads it: within 3.0e-5 when
/// written, where the top k left unrenormalised is off by 6.3e-3.
#[test]
fn a_qwen3_moe_gguf_target_computes_what_llama_cpp_computes() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sparse.gguf");
    let logits = dir.path().join("llama_cpp.json");
    reference_script(&[
        "write-gguf".as_ref(),
        "qwen3_moe".as_ref(),
        file.as_os_str(),
        "--all-sparse".as_ref(),
    ]);
    reference_script(&[
        "llama-cpp-logits".as_ref(),
        file.as_os_str(),
        logits.as_os_str(),
    ]);
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&logits).unwrap()).unwrap();
    let ids: Vec<u32> = want["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let target = Target::load(&file, &Device::Cpu).unwrap();
    let got = rows(&target.extend(&ids, &mut KvCache::default(), &[]).unwrap().0);
    let d = max_diff(&got, &json_rows(&want["logits"]));
    assert!(d < 2e-4, "logits differ from llama.cpp's by {d}");
}
