//! `dflash estimate` end to end: the story's numbers from a pipeline file, the table as users see
//! it, measured sizes taking over from declared ones once stages are done, and bad options.

use serde_json::Value;

mod support;
use support::env::Env;

/// The story's pipeline and its 27B-class target shape, copied into a fresh folder.
fn story() -> Env {
    let env = Env::new();
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/estimate");
    env.write(
        "story.yaml",
        &std::fs::read_to_string(format!("{data}/story.yaml")).unwrap(),
    );
    env.write(
        "target-27b/config.json",
        &std::fs::read_to_string(format!("{data}/target-27b/config.json")).unwrap(),
    );
    env
}

/// `cpu_cores` defaults to this machine's; pin it so the output is the same everywhere.
const PINNED: [&str; 2] = ["--assume", "cpu_cores=2"];

fn estimate(env: &Env, args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["estimate"];
    all.extend_from_slice(args);
    let out = env.dflash(&all);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

fn json(env: &Env, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let (code, stdout, stderr) = estimate(env, &all);
    assert_eq!(code, 0, "{stderr}");
    serde_json::from_str(&stdout).unwrap()
}

fn stage<'a>(e: &'a Value, id: &str) -> &'a Value {
    e["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == id)
        .unwrap()
}

#[test]
fn the_storys_offline_hidden_states_come_to_about_90_tb() {
    let env = story();
    let e = json(
        &env,
        &["story.yaml", "--gpus", "8xH200", PINNED[0], PINNED[1]],
    );
    // 902K rows x (180 + 1,818) tokens x 5 taps x 5120 x 2 bytes.
    let tokens = stage(&e, "tokens");
    assert_eq!(tokens["rows"]["value"], 902_000.0);
    assert_eq!(tokens["rows"]["basis"], "upstream");
    let offline = e["alternatives"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|a| a["choices"].as_array().unwrap())
        .find(|c| c["label"].as_str().unwrap().starts_with("offline"))
        .expect("an offline choice");
    let tb = offline["storage_bytes"].as_f64().unwrap() / 1e12;
    let expected = 902_000.0 * 1998.0 * 5.0 * 5120.0 * 2.0 / 1e12;
    assert!((tb - expected).abs() < 0.01, "{tb} TB, expected {expected}");
    assert!((85.0..95.0).contains(&tb));
    assert_eq!(offline["chosen"], false);
    assert!(
        offline["note"]
            .as_str()
            .unwrap()
            .contains("over the --max-storage")
    );
    // Online training on all 8 GPUs; the 1.64B generated tokens are the story's.
    let generate = stage(&e, "completions");
    let out_tokens = generate["tokens"]["value"].as_f64().unwrap();
    assert!((out_tokens - 1.64e9).abs() < 0.01e9, "{out_tokens}");
    assert_eq!(generate["gpus"], 8);
    let train = stage(&e, "drafter");
    assert_eq!(train["gpus"], 8);
    assert!(train["flops"].as_f64().unwrap() > 0.0);
    // Offline is the cheaper compute but over the storage limit; online is what was written.
    let online = e["alternatives"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|a| a["choices"].as_array().unwrap())
        .find(|c| c["label"].as_str().unwrap().starts_with("online"))
        .unwrap();
    assert_eq!(online["chosen"], true);
    assert_eq!(online["storage_bytes"], 0.0);
}

#[test]
fn the_storys_table_reads_well() {
    let env = story();
    let (code, stdout, stderr) = estimate(
        &env,
        &["story.yaml", "--gpus", "8xH200", PINNED[0], PINNED[1]],
    );
    assert_eq!(code, 0, "{stderr}");
    insta::assert_snapshot!(stdout);
}

#[test]
fn infeasible_plans_are_warned_about() {
    let env = story();
    // One 24 GB card: the 27B target's weights fit nowhere, and one training replica is over.
    let (code, stdout, stderr) = estimate(
        &env,
        &[
            "story.yaml",
            "--gpus",
            "RTX4090",
            "--budget",
            "2days",
            "--max-storage",
            "1TB",
            PINNED[0],
            PINNED[1],
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    let warnings = stdout
        .split("\nwarnings:\n")
        .nth(1)
        .expect("warnings")
        .to_owned();
    insta::assert_snapshot!(warnings.split("\n\nassumptions").next().unwrap());
}

#[test]
fn done_stages_are_sized_from_their_manifests() {
    let env = Env::new();
    env.write(
        "a.jsonl",
        &(0..30)
            .map(|i| format!("{{\"instruction\": \"question number {i} about sorting\", \"output\": \"ok\"}}\n"))
            .collect::<String>(),
    );
    let yaml = "name: measured\nstages:\n  src:\n    kind: download\n    params: {path: a.jsonl, format: alpaca}\n    expect: {rows: 1000}\n  mixed:\n    kind: mix\n    inputs: [src]\n    params: {by: source, total: 20, seed: 0}\n";
    env.write("p.yaml", yaml);
    let before = json(&env, &["p.yaml"]);
    assert_eq!(stage(&before, "src")["rows"]["basis"], "declared");
    assert_eq!(stage(&before, "src")["rows"]["value"], 1000.0);
    assert_eq!(stage(&before, "mixed")["rows"]["basis"], "param");
    env.run("p.yaml", 0);
    let after = json(&env, &["p.yaml"]);
    let src = stage(&after, "src");
    assert_eq!(src["state"], "done");
    assert_eq!(src["rows"]["basis"], "measured");
    assert_eq!(src["rows"]["value"], 30.0);
    assert_eq!(src["storage_bytes"]["basis"], "measured");
    let mixed = stage(&after, "mixed");
    assert_eq!(mixed["rows"]["basis"], "measured");
    assert_eq!(mixed["rows"]["value"], 20.0);
    assert_eq!(after["totals"]["storage_bytes"], 0.0);
    assert!(after["totals"]["stored_bytes"].as_f64().unwrap() > 0.0);
}

#[test]
fn bad_options_say_what_is_wrong() {
    let env = story();
    for (args, needle) in [
        (
            vec!["story.yaml", "--gpus", "8xV9000"],
            "unknown GPU `V9000`; dflash knows H200",
        ),
        (
            vec!["story.yaml", "--assume", "trian_mfu=0.5"],
            "no assumption `trian_mfu`",
        ),
        (
            vec!["story.yaml", "--assume", "train_mfu=fast"],
            "is not a number",
        ),
        (
            vec!["story.yaml", "--max-storage", "10XB"],
            "unknown unit `XB`",
        ),
        (vec!["story.yaml", "--budget", "soon"], "not a duration"),
    ] {
        let (code, stdout, stderr) = estimate(&env, &args);
        assert_eq!(code, 2, "{args:?}: {stdout}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
    // A target that can't be found is a warning with the reason, not a crash.
    env.write(
        "story.yaml",
        &std::fs::read_to_string(env.path().join("story.yaml"))
            .unwrap()
            .replace("target: target-27b", "target: no-such-model"),
    );
    let e = json(&env, &["story.yaml"]);
    let warnings = e["warnings"].as_array().unwrap();
    assert!(
        warnings.iter().any(|w| w
            .as_str()
            .unwrap()
            .contains("`drafter`: cannot size the model")),
        "{warnings:?}"
    );
}

/// Local benchmark files are counted as `download` will map them, rows and user turns (once
/// done, as the download recorded them), and
/// a bench asks every turn of the first `prompts` rows; a `command` stage that copies an
/// exported drafter in is a drafter, not a prompt set: 4 single-turn rows (of 5) + 3 two-turn
/// rows = 10 turns x 100 tokens x 0.77 x 64 layers' steps x (1 + 1.1 / 2.1 + 1.4 / 2.2).
#[test]
fn local_benchmark_files_are_counted_turn_by_turn() {
    let env = story();
    env.write(
        "single.jsonl",
        &(0..5)
            .map(|i| format!("{{\"task_id\": \"t{i}\", \"prompt\": \"def f{i}():\"}}\n"))
            .collect::<String>(),
    );
    env.write(
        "multi.jsonl",
        &(0..3)
            .map(|i| format!("{{\"question_id\": {i}, \"turns\": [\"ask {i}\", \"and then?\"]}}\n"))
            .collect::<String>(),
    );
    let e = story_with(
        &env,
        "  single:\n    kind: download\n    params: {path: single.jsonl}\n  multi:\n    kind: download\n    params: {path: multi.jsonl}\n  copied:\n    kind: command\n    params: {run: 'true'}\n  bench:\n    kind: bench\n    inputs: [copied, single, multi]\n    params: {target: target-27b, prompts: 4, max_new_tokens: 100}\n",
    );
    assert_eq!(stage(&e, "single")["rows"]["value"], 5.0, "{e}");
    assert_eq!(stage(&e, "multi")["rows"]["value"], 3.0, "{e}");
    let b = stage(&e, "bench");
    assert_wall(
        b,
        // Autoregressive decoding, prompt lookup's rounds at its tau, the chain's at its tau.
        10.0 * 100.0 * 0.77 * 64.0 * 0.000_18 * (1.0 + 1.1 / 2.1 + 1.4 / 2.2) / 3600.0,
    );
    assert!(b.to_string().contains("user turns counted"), "{b}");

    // Once the downloads are done (their rows and user turns recorded in the store), the
    // turns are still counted: a done multi-turn set used to be taken at one turn a row.
    let out = env.dflash(&["run", "bench.yaml", "--only", "single", "--only", "multi"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(env.show("multi", "bench.yaml")["stats"]["user_turns"], 6);
    assert_eq!(env.show("single", "bench.yaml")["stats"]["user_turns"], 5);
    let e = json(
        &env,
        &["bench.yaml", "--gpus", "8xH200", PINNED[0], PINNED[1]],
    );
    assert_eq!(stage(&e, "multi")["state"], "done", "{e}");
    let b = stage(&e, "bench");
    assert_wall(
        b,
        10.0 * 100.0 * 0.77 * 64.0 * 0.000_18 * (1.0 + 1.1 / 2.1 + 1.4 / 2.2) / 3600.0,
    );
    assert!(b.to_string().contains("user turns counted"), "{b}");
}

/// The story's pipeline with `stages` (YAML, indented under `stages:`) added, estimated on
/// 8xH200 with the pinned assumptions.
fn story_with(env: &Env, stages: &str) -> Value {
    env.write(
        "bench.yaml",
        &(std::fs::read_to_string(env.path().join("story.yaml")).unwrap() + stages),
    );
    json(
        env,
        &["bench.yaml", "--gpus", "8xH200", PINNED[0], PINNED[1]],
    )
}

/// A stage's wall-clock hours are `expected`.
fn assert_wall(stage: &Value, expected: f64) {
    let got = stage["wall_hours"].as_f64().unwrap();
    assert!(
        (got / expected - 1.0).abs() < 1e-9,
        "{got} vs {expected}: {stage}"
    );
}

/// A bench is sized from its prompts, its methods and the target's step: 10 prompts (the set's
/// `limit`, below `prompts`) x 100 tokens x 0.77 (answers stop sooner) x 64 layers' steps x
/// (autoregressive 1 + prompt lookup's rounds of 1.1 steps at tau 2.1 + one drafter's of 1.4 at
/// tau 2.2); at tau 1 and full-length answers, the bound.
#[test]
fn a_bench_is_sized_from_its_prompts_methods_and_target() {
    let env = story();
    let e = story_with(
        &env,
        "  gsm8k:\n    kind: download\n    params: {hf: openai/gsm8k, limit: 10}\n  bench:\n    kind: bench\n    inputs: [drafter, gsm8k]\n    params: {target: target-27b, prompts: 80, max_new_tokens: 100}\n",
    );
    let b = stage(&e, "bench");
    assert_wall(
        b,
        // Autoregressive decoding, prompt lookup's rounds at its tau, the chain's at its tau.
        10.0 * 100.0 * 0.77 * 64.0 * 0.000_18 * (1.0 + 1.1 / 2.1 + 1.4 / 2.2) / 3600.0,
    );
    assert_eq!(b["gpus"], 1);
    // At tau 1 (a drafter not yet trained), an upper bound: every method a round a token.
    let bound = json(
        &env,
        &[
            "bench.yaml",
            "--gpus",
            "8xH200",
            PINNED[0],
            PINNED[1],
            "--assume",
            "bench_tau_ngram=1",
            "--assume",
            "bench_tau_chain=1",
            "--assume",
            "bench_answer_fraction=1",
        ],
    );
    assert_wall(
        stage(&bound, "bench"),
        10.0 * 100.0 * 64.0 * 0.000_18 * (1.0 + 1.1 + 1.4) / 3600.0,
    );
    // Verified as a tree with prompt lookup's paths: a tree's round (1.8 steps) at that
    // graft's tau (4.3).
    env.write(
        "grafted.yaml",
        &std::fs::read_to_string(env.path().join("bench.yaml"))
            .unwrap()
            .replace(
                "max_new_tokens: 100}",
                "max_new_tokens: 100, verify: tree+lookup}",
            ),
    );
    let e = json(
        &env,
        &["grafted.yaml", "--gpus", "8xH200", PINNED[0], PINNED[1]],
    );
    assert_wall(
        stage(&e, "bench"),
        10.0 * 100.0 * 0.77 * 64.0 * 0.000_18 * (1.0 + 1.1 / 2.1 + 1.8 / 4.3) / 3600.0,
    );
    // Endpoint mode is the servers' business.
    env.write(
        "served.yaml",
        &std::fs::read_to_string(env.path().join("bench.yaml"))
            .unwrap()
            .replace(
                "params: {target: target-27b, prompts: 80, max_new_tokens: 100}",
                "params: {endpoints: {plain: 'http://127.0.0.1:30000/v1'}}",
            )
            .replace("inputs: [drafter, gsm8k]", "inputs: [gsm8k]"),
    );
    let e = json(&env, &["served.yaml", PINNED[0], PINNED[1]]);
    assert!(stage(&e, "bench")["wall_hours"].is_null());
}

/// A hybrid target (Qwen3.5-27B's published config): its parameters, and the memory a decoding
/// sequence keeps, most of it the Gated DeltaNet layers' fixed state rather than keys and values.
#[test]
fn a_hybrid_target_is_sized_with_its_fixed_state() {
    let env = Env::new();
    env.write(
        "q27/config.json",
        r#"{"model_type": "qwen3_5", "tie_word_embeddings": false, "text_config": {
            "model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64,
            "intermediate_size": 17408, "num_attention_heads": 24, "num_key_value_heads": 4,
            "head_dim": 256, "vocab_size": 248320, "full_attention_interval": 4,
            "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}}"#,
    );
    env.write(
        "p.yaml",
        "stages:\n  chats: {kind: download, params: {hf: HuggingFaceH4/ultrachat_200k, limit: 1000}}\n  \
         gen:\n    kind: generate\n    inputs: [chats]\n    params: {endpoints: ['http://127.0.0.1:1/v1'], model: q27}\n",
    );
    let e = json(&env, &["p.yaml", "--gpus", "1xH200"]);
    let notes: Vec<&str> = stage(&e, "gen")["notes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    assert!(
        notes.iter().any(|n| n.contains("26.9 B parameters")),
        "{notes:?}"
    );
    // 16 attention layers x 4 KV heads x 256 x 2 (K, V) x 2 bytes per token, plus 48 states.
    let kept = notes.iter().find(|n| n.contains("keeps")).unwrap();
    assert!(
        kept.contains("154 MB of it the Gated DeltaNet layers' state"),
        "{kept}"
    );
}

/// Two trainings of one tokenized set: the runtime runs GPU stages one at a time, so the
/// estimate's wall-clock holds both, one after the other, and its critical path goes through
/// both; their GPU-hours are each their own.
#[test]
fn stages_on_the_gpu_follow_each_other_in_the_wall_clock() {
    let env = story();
    let one = json(
        &env,
        &["story.yaml", "--gpus", "8xH200", PINNED[0], PINNED[1]],
    );
    env.write(
        "two.yaml",
        &(std::fs::read_to_string(env.path().join("story.yaml")).unwrap()
            + "  other:\n    kind: train\n    inputs: [tokens]\n    params: {target: target-27b, draft_layers: 5, taps: 5, epochs: 6, mask_token_id: 151669, seed: 1}\n"),
    );
    let two = json(
        &env,
        &["two.yaml", "--gpus", "8xH200", PINNED[0], PINNED[1]],
    );
    let train = stage(&two, "other")["wall_hours"].as_f64().unwrap();
    assert!(
        (stage(&two, "drafter")["wall_hours"].as_f64().unwrap() / train - 1.0).abs() < 1e-9,
        "the same training sized differently"
    );
    let (w1, w2) = (
        one["totals"]["wall_hours"].as_f64().unwrap(),
        two["totals"]["wall_hours"].as_f64().unwrap(),
    );
    assert!(
        (w2 - (w1 + train)).abs() < 1e-9 * w2,
        "one training's wall-clock {w1} h, two {w2} h, a training {train} h"
    );
    let path: Vec<&str> = two["critical_path"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    let mut last = path[path.len() - 2..].to_vec();
    last.sort_unstable();
    assert_eq!(last, ["drafter", "other"], "{path:?}");
}

/// The expansion's case: a second `generate` asked the same way as one already done (same
/// model, `max_tokens`, turns) is sized by that one's replies, not by half of `max_tokens`; one
/// asked otherwise is not.
#[test]
fn a_generate_is_sized_by_an_earlier_one_asked_the_same_way() {
    let env = Env::new();
    std::os::unix::fs::symlink(
        support::hub::assets().join("SmolLM2-135M-Instruct.Q4_1.gguf"),
        env.path().join("smollm2.gguf"),
    )
    .unwrap();
    env.write(
        "a.jsonl",
        "{\"id\": \"fr\", \"prompt\": \"What is the capital of France?\"}\n{\"id\": \"de\", \"prompt\": \"Name a colour.\"}\n",
    );
    env.write(
        "b.jsonl",
        "{\"id\": \"it\", \"prompt\": \"What is the capital of Italy?\"}\n{\"id\": \"es\", \"prompt\": \"Name a fruit.\"}\n{\"id\": \"pt\", \"prompt\": \"Name a tree.\"}\n",
    );
    let asked = "{backend: candle, model: smollm2.gguf, max_tokens: 6, device: cpu, batch_size: 2}";
    env.write(
        "p.yaml",
        &format!(
            "name: more\nstages:\n  first:\n    kind: download\n    params: {{path: a.jsonl}}\n  second:\n    kind: download\n    params: {{path: b.jsonl}}\n  answers:\n    kind: generate\n    inputs: [first]\n    params: {asked}\n  more:\n    kind: generate\n    inputs: [second]\n    params: {asked}\n  longer:\n    kind: generate\n    inputs: [second]\n    params: {}\n",
            asked.replace("max_tokens: 6", "max_tokens: 60")
        ),
    );
    let o = env.dflash(&["run", "p.yaml", "--only", "answers", "--only", "second"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let e = json(&env, &["p.yaml", "--gpus", "1xH100"]);
    let answers = stage(&e, "answers");
    assert_eq!(answers["state"], "done");
    let per_row = answers["tokens"]["value"].as_f64().unwrap() / 2.0;
    assert!(per_row > 0.0 && per_row <= 6.0, "{answers}");
    let more = stage(&e, "more");
    let tokens = more["tokens"]["value"].as_f64().unwrap();
    assert!((tokens - 3.0 * per_row).abs() < 1e-9, "{more}");
    let notes = more["notes"].to_string();
    assert!(notes.contains("asked the same way"), "{notes}");
    // Another `max_tokens` is another question: the assumption, and the hint to declare it.
    let longer = stage(&e, "longer");
    let tokens = longer["tokens"]["value"].as_f64().unwrap();
    assert!((tokens - 3.0 * 30.0).abs() < 1e-9, "{longer}");
    assert!(longer["notes"].to_string().contains("half of max_tokens"));
}

/// A sweep (`matrix:`) whose one variant has the drafter's params: one key, so one training in
/// GPU-hours, cost and storage; the variant says whose work it is.
#[test]
fn a_sweep_variant_equal_to_a_stage_is_counted_once() {
    let env = story();
    let sweep = "  sweep:\n    kind: train\n    inputs: [tokens]\n    params: {target: target-27b, taps: 5, epochs: 6, mask_token_id: 151669}\n    matrix: {draft_layers: [5, 3]}\n";
    let story = std::fs::read_to_string(env.path().join("story.yaml")).unwrap();
    env.write("sweep.yaml", &format!("{story}{sweep}"));
    let args = ["--gpus", "8xH200", PINNED[0], PINNED[1]];
    let alone = json(&env, &[&["story.yaml"][..], &args].concat());
    let e = json(&env, &[&["sweep.yaml"][..], &args].concat());
    // Whichever of the two is sized second is counted as done by the other.
    let (a, b) = (stage(&e, "drafter"), stage(&e, "sweep@draft_layers=5"));
    let (twin, first) = if a["gpu_hours"] == 0.0 {
        (a, "sweep@draft_layers=5")
    } else {
        (b, "drafter")
    };
    assert_eq!(twin["gpu_hours"], 0.0, "{a} {b}");
    let note = format!("the same work as `{first}`");
    assert!(twin["notes"].to_string().contains(&note), "{twin}");
    let other = stage(&e, "sweep@draft_layers=3");
    let extra = other["gpu_hours"].as_f64().unwrap();
    assert!(extra > 0.0, "{other}");
    let total = |v: &Value| v["totals"]["gpu_hours"].as_f64().unwrap();
    assert!(
        (total(&e) - total(&alone) - extra).abs() < 1e-9,
        "{} vs {} + {extra}",
        total(&e),
        total(&alone)
    );
}

/// A small target's training step is sized by its launches and small ops, per layer pass and
/// per block row: blocks of 8 cost less than 16, and each drafter layer adds to both.
#[test]
fn a_small_targets_step_counts_its_block_rows() {
    let env = story();
    std::os::unix::fs::symlink(
        support::hub::assets().join("SmolLM2-135M-Instruct.Q4_1.gguf"),
        env.path().join("smollm2.gguf"),
    )
    .unwrap();
    let sweep = "  sweep:\n    kind: train\n    inputs: [tokens]\n    params: {target: smollm2.gguf, anchors: 256, max_steps: 200, mask_token_id: 3}\n    matrix: {block_size: [8, 16], draft_layers: [1, 3]}\n";
    let story = std::fs::read_to_string(env.path().join("story.yaml")).unwrap();
    env.write("sweep.yaml", &format!("{story}{sweep}"));
    let e = json(
        &env,
        &["sweep.yaml", "--gpus", "1xH100", PINNED[0], PINNED[1]],
    );
    let hours = |id: &str| stage(&e, id)["gpu_hours"].as_f64().unwrap();
    let (b8, b16) = (
        hours("sweep@block_size=8,draft_layers=3"),
        hours("sweep@block_size=16,draft_layers=3"),
    );
    assert!(b8 > 0.0 && b8 < b16, "blocks of 8 {b8} h, 16 {b16} h");
    let (l1, l3) = (
        hours("sweep@block_size=16,draft_layers=1"),
        hours("sweep@block_size=16,draft_layers=3"),
    );
    assert!(l1 < l3, "1 layer {l1} h, 3 layers {l3} h");
    // 256 anchors x 8: the rows the note counts.
    let notes = stage(&e, "sweep@block_size=8,draft_layers=3")["notes"].to_string();
    assert!(notes.contains("over its 2.05 K block rows"), "{notes}");
}

/// `optimizer_moments: bf16` halves the moments in the estimate as in training: each checkpoint
/// 8 bytes a trainable parameter where f32 moments take 12, and the peak memory per GPU 4 bytes
/// a parameter less.
#[test]
fn bf16_moments_shrink_the_checkpoints_and_the_peak() {
    let env = story();
    // Five epochs: not the story's own `drafter` (which a twin would be counted as).
    let sweep = "  sweep:\n    kind: train\n    inputs: [tokens]\n    params: {target: target-27b, draft_layers: 5, taps: 5, epochs: 5, mask_token_id: 151669}\n    matrix: {optimizer_moments: [f32, bf16]}\n";
    let e = story_with(&env, sweep);
    let (f32s, bf16s) = (
        stage(&e, "sweep@optimizer_moments=f32"),
        stage(&e, "sweep@optimizer_moments=bf16"),
    );
    let storage = |s: &Value| s["storage_bytes"]["value"].as_f64().unwrap();
    let ratio = storage(bf16s) / storage(f32s);
    // (8 C + 2) / (12 C + 2) for C checkpoints: between 2/3 and 1.
    assert!(ratio > 2.0 / 3.0 && ratio < 0.7, "{ratio}");
    let peak = |s: &Value| {
        let notes = s["notes"].to_string();
        let at = notes.find("peak memory per GPU ~").expect("a peak note");
        notes[at..]
            .split('~')
            .nth(1)
            .unwrap()
            .split(' ')
            .take(2)
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_ne!(peak(f32s), peak(bf16s), "the same peak for both moments");
}
