//! End-to-end tests of `bench` against the tiny random Llama GGUF of the train tests
//! (`tests/support/tiny_model.py`): every method's greedy output is the autoregressive one,
//! the results land in the artifact and the manifest, a thinking-mode mismatch between training
//! and benchmark data is called out, and `dflash diff` shows the tau change per set.

use serde_json::Value;

mod support;
use support::env::Env;

const PIPELINE: &str = r#"
name: bench
stages:
  tokens:
    kind: command
    params: {run: "cp train-00000.arrow $DFLASH_OUT/ && cp trained/tokenize.json $DFLASH_OUT/",
             files: [train-00000.arrow, trained/tokenize.json]}
  prompts:
    kind: command
    params: {run: "cp train-00000.arrow $DFLASH_OUT/ && cp served/tokenize.json $DFLASH_OUT/",
             files: [train-00000.arrow, served/tokenize.json]}
  trained:
    kind: train
    inputs: [tokens]
    params: {target: tiny.gguf, draft_layers: 1, block_size: 4, anchors: 8, mask_token_id: 63,
             target_layers: [0, 2], epochs: 10, max_steps: 20, lr: 0.003}
  untrained:
    kind: train
    inputs: [tokens]
    params: {target: tiny.gguf, draft_layers: 1, block_size: 4, anchors: 8, mask_token_id: 63,
             target_layers: [0, 2], max_steps: 0}
  bench:
    kind: bench
    inputs: [trained, untrained, prompts]
    params: {target: tiny.gguf, prompts: 4, max_new_tokens: 24}
"#;

fn setup(env: &Env) {
    support::tiny_model(env.path(), &["tiny.gguf", "train-00000.arrow", "12", "32"]);
    env.write(
        "trained/tokenize.json",
        r#"{"template_kwargs": {"enable_thinking": false}}"#,
    );
    env.write(
        "served/tokenize.json",
        r#"{"template_kwargs": {"enable_thinking": true}}"#,
    );
    env.write("p.yaml", PIPELINE);
}

#[test]
fn every_method_reproduces_autoregressive_output_and_the_results_are_kept() {
    let env = Env::new();
    setup(&env);
    let (st, _) = env.run("p.yaml", 0);
    assert_eq!(st["bench"], "ran");
    let dir = env.path().join("out");
    let o = env.dflash(&["export", "bench", "-p", "p.yaml", dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let results: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    let methods = &results["sets"]["prompts"]["methods"];
    let names: Vec<&str> = methods
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(names, ["autoregressive", "ngram", "trained", "untrained"]);
    let ar = &methods["autoregressive"];
    assert_eq!(ar["prompts"], 4);
    assert_eq!(ar["tau"], 1.0);
    assert_eq!(ar["speedup"], 1.0);
    assert!(ar["identical"].is_null());
    for m in ["ngram", "trained", "untrained"] {
        let r = &methods[m];
        assert_eq!(
            r["identical"], 4,
            "{m}: greedy speculation changed the output: {r}"
        );
        assert_eq!(r["output_tokens"], ar["output_tokens"], "{m}");
        let tau = r["tau"].as_f64().unwrap();
        assert!((1.0..=4.0).contains(&tau), "{m}: tau {tau}");
        assert_eq!(r["acceptance"].as_array().unwrap().len(), 3, "{m}");
    }
    // Per prompt and method, in the artifact.
    let lines = std::fs::read_to_string(dir.join("sets/prompts.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 16);

    // The manifest keeps the figures and the warning; the drafters saw thinking off, the
    // benchmark prompts were rendered with it on.
    let m = env.show("bench", "p.yaml");
    assert_eq!(
        m["stats"]["sets"]["prompts"]["methods"]["trained"]["identical"],
        4
    );
    let warnings: Vec<&str> = m["stats"]["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap())
        .collect();
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(
        warnings[0].contains("thinking mode")
            && warnings[0].contains(r#"{"enable_thinking":true}"#),
        "{warnings:?}"
    );
    // The drafter records what it was trained against.
    let t = env.show("trained", "p.yaml");
    assert!(
        t["files"].to_string().contains("training.json"),
        "{}",
        t["files"]
    );
}

/// The pipeline's bench run with `extra` params (YAML flow entries) added: the folder and the
/// bench's manifest.
fn bench_manifest_with(extra: &str) -> (Env, Value) {
    let env = Env::new();
    setup(&env);
    env.write(
        "p.yaml",
        &PIPELINE.replace(
            "params: {target: tiny.gguf, prompts: 4, max_new_tokens: 24}",
            &format!("params: {{target: tiny.gguf, prompts: 4, max_new_tokens: 24, {extra}}}"),
        ),
    );
    let (st, _) = env.run("p.yaml", 0);
    assert_eq!(st["bench"], "ran");
    let m = env.show("bench", "p.yaml");
    (env, m)
}

/// A DFlash drafter trained with blocks of 4 runs with blocks of 8 (`block_size`): its weights
/// do not depend on the block. Every method drafts up to 7 tokens a round, the output is still
/// the target's own, and the run says the drafter runs past its training.
#[test]
fn a_drafter_runs_at_another_block_than_it_was_trained_with() {
    let (_, m) = bench_manifest_with("block_size: 8, verify: all");
    let methods = &m["stats"]["sets"]["prompts"]["methods"];
    for name in [
        "ngram",
        "trained",
        "trained+tree",
        "trained+tree+lookup",
        "untrained",
    ] {
        let r = &methods[name];
        assert_eq!(r["identical"], 4, "{name}: {r}");
        assert_eq!(r["acceptance"].as_array().unwrap().len(), 7, "{name}: {r}");
    }
    let warnings = m["stats"]["warnings"].to_string();
    assert!(
        warnings
            .contains("drafter `trained` was trained with blocks of 4; it runs with blocks of 8"),
        "{warnings}"
    );
}

#[test]
fn diff_shows_the_tau_change_per_set() {
    let env = Env::new();
    setup(&env);
    let (_, first) = env.run("p.yaml", 0);
    env.write(
        "q.yaml",
        &PIPELINE
            .replace("max_steps: 20", "max_steps: 60")
            .replace("max_new_tokens: 24", "max_new_tokens: 40"),
    );
    let (st, second) = env.run("q.yaml", 0);
    assert_eq!(st["trained"], "ran");
    assert_eq!(st["bench"], "ran");
    assert_eq!(st["untrained"], "cached");
    let out = env.dflash(&[
        "diff",
        first["run_id"].as_str().unwrap(),
        second["run_id"].as_str().unwrap(),
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let bench = v["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"].as_str().unwrap().starts_with("bench"))
        .unwrap()
        .to_string();
    // Longer outputs give prompt lookup more to match, so its tau moves.
    assert!(
        bench.contains("stat `sets.prompts.methods.ngram.tau`"),
        "{bench}"
    );
}

/// The drafter's record names its target by content: benchmarked against a renamed copy of the
/// same file, no warning says it was trained against another model.
#[test]
fn a_renamed_copy_of_the_target_is_the_same_target() {
    let env = Env::new();
    setup(&env);
    std::fs::copy(env.path().join("tiny.gguf"), env.path().join("copy.gguf")).unwrap();
    env.write(
        "p.yaml",
        &PIPELINE.replace(
            "params: {target: tiny.gguf, prompts: 4",
            "params: {target: copy.gguf, prompts: 4",
        ),
    );
    let (st, _) = env.run("p.yaml", 0);
    assert_eq!(st["bench"], "ran");
    let m = env.show("bench", "p.yaml");
    let warnings = m["stats"]["warnings"].to_string();
    assert!(!warnings.contains("trained against"), "{warnings}");
    assert!(
        warnings.contains("thinking mode"),
        "the other warnings stay: {warnings}"
    );
}

#[test]
fn a_drafter_for_another_target_is_refused_with_the_reason() {
    let env = Env::new();
    setup(&env);
    // A drafter whose vocabulary is not the target's.
    env.write(
        "p.yaml",
        &PIPELINE.replace(
            "params: {target: tiny.gguf, prompts: 4",
            "params: {target: other.gguf, prompts: 4",
        ),
    );
    support::tiny_model(
        env.path(),
        &["other.gguf", "unused.arrow", "1", "16", "--vocab", "80"],
    );
    let (st, v) = env.run("p.yaml", 1);
    assert_eq!(st["bench"], "failed");
    let err = v.to_string();
    assert!(
        err.contains("vocabulary") && err.contains("trained"),
        "{err}"
    );
}

/// `verify: all`: each drafter as a chain, as a tree (`<name>+tree`) and as a tree with prompt
/// lookup's path grafted on (`<name>+tree+lookup`) side by side, the trees as lossless as the
/// chain, and at least as many tokens per target pass.
#[test]
fn tree_verification_runs_beside_the_chain_and_is_lossless() {
    let (env, m) = bench_manifest_with("verify: all, tree_width: 3, tree_budget: 12");
    let methods = &m["stats"]["sets"]["prompts"]["methods"];
    let names: Vec<&str> = methods
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        names,
        [
            "autoregressive",
            "ngram",
            "trained",
            "trained+tree",
            "trained+tree+lookup",
            "untrained",
            "untrained+tree",
            "untrained+tree+lookup"
        ]
    );
    for name in [
        "trained+tree",
        "untrained+tree",
        "trained+tree+lookup",
        "untrained+tree+lookup",
    ] {
        assert_eq!(methods[name]["identical"], 4, "{name}: {}", methods[name]);
    }
    let (chain, tree) = (
        methods["trained"]["tau"].as_f64().unwrap(),
        methods["trained+tree"]["tau"].as_f64().unwrap(),
    );
    assert!(tree >= chain, "tau chain {chain}, tree {tree}");
    // Each round's time split into proposing and verifying: autoregressive decoding proposes
    // nothing, a drafter's pass takes time, every method verifies.
    for (name, m) in methods.as_object().unwrap() {
        let (p, v) = (
            m["propose_ms_per_round"].as_f64(),
            m["verify_ms_per_round"].as_f64(),
        );
        assert!(p >= Some(0.0) && v > Some(0.0), "{name}: {m}");
    }
    assert!(
        methods["autoregressive"]["propose_ms_per_round"]
            .as_f64()
            .unwrap()
            < 0.01
    );
    // The tau at which a method's rounds match the target's step: 1 for the target itself by
    // definition, a round's time over a step's for the others (no timing compared here).
    let even = |m: &str| methods[m]["break_even_tau"].as_f64().unwrap();
    assert!(
        (even("autoregressive") - 1.0).abs() < 1e-9,
        "{}",
        even("autoregressive")
    );
    assert!(even("trained+tree") > 0.0, "{}", even("trained+tree"));
    assert!(methods["trained"]["propose_ms_per_round"].as_f64().unwrap() > 0.0);
    // A tree of one node is a plain target step: refused at plan time below 2.
    env.write(
        "p.yaml",
        &PIPELINE.replace(
            "params: {target: tiny.gguf, prompts: 4, max_new_tokens: 24}",
            "params: {target: tiny.gguf, prompts: 4, max_new_tokens: 24, verify: tree, tree_budget: 1}",
        ),
    );
    let o = env.dflash(&["plan", "p.yaml"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("tree_budget"));
}

/// `repeats: 3`: every method decodes every prompt three times, the methods taking turns; the
/// decode kept is the fastest (its seconds the least of the three the line lists), and its
/// tokens are the unrepeated run's, every repeat having output them. In endpoint mode, where a
/// server's prompt cache would answer a repeat, `repeats` is refused at plan time.
#[test]
fn repeated_decodes_keep_each_prompts_fastest_and_its_output() {
    let exported = |env: &Env| {
        let dir = env.path().join("out");
        let o = env.dflash(&["export", "bench", "-p", "p.yaml", dir.to_str().unwrap()]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        std::fs::read_to_string(dir.join("sets/prompts.jsonl")).unwrap()
    };
    let (once, _) = bench_manifest_with("verify: tree+lookup");
    exported(&once);
    let (thrice, m) = bench_manifest_with("verify: tree+lookup, repeats: 3");
    let lines: Vec<Value> = exported(&thrice)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // Four prompts, each by autoregressive decoding, prompt lookup and two drafters' trees.
    assert_eq!(lines.len(), 4 * 4, "{lines:?}");
    for l in &lines {
        let each: Vec<f64> = l["repeats_seconds"]
            .as_array()
            .unwrap_or_else(|| panic!("no repeats in {l}"))
            .iter()
            .map(|s| s.as_f64().unwrap())
            .collect();
        assert_eq!(each.len(), 3, "{l}");
        let fastest = each.iter().copied().fold(f64::INFINITY, f64::min);
        assert!(
            (l["seconds"].as_f64().unwrap() - fastest).abs() < 1e-9,
            "kept {} of {each:?}",
            l["seconds"]
        );
        assert_eq!(l["repeats_differed"], false, "{l}");
    }
    assert_eq!(
        tokens_by_prompt(&once.path().join("out")),
        tokens_by_prompt(&thrice.path().join("out")),
        "repeats changed an output"
    );
    let methods = &m["stats"]["sets"]["prompts"]["methods"];
    for name in ["ngram", "trained+tree+lookup", "untrained+tree+lookup"] {
        assert_eq!(methods[name]["identical"], 4, "{name}: {}", methods[name]);
    }
    let warnings = m["stats"]["warnings"].to_string();
    assert!(!warnings.contains("repeats"), "{warnings}");
    // Endpoint mode: refused before anything runs, with the reason.
    thrice.write(
        "e.yaml",
        "stages:\n  bench:\n    kind: bench\n    params: {endpoints: {plain: 'http://127.0.0.1:9/v1'}, repeats: 2}\n",
    );
    let o = thrice.dflash(&["plan", "e.yaml"]);
    assert_eq!(o.status.code(), Some(2));
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(
        said.contains("repeats") && said.contains("prompt caches"),
        "{said}"
    );
}

/// candle asks for its CPU matmul thread count on every matmul and, unless `RAYON_NUM_THREADS`
/// is set, reads and parses `/proc/cpuinfo` to answer (~60 us each time on this machine):
/// `dflash` settles the count once as it starts (`dflash_model::threads`), so a run that trains
/// and benches on the CPU (thousands of matmuls) opens that file at most once. `strace` counts
/// the opens.
#[test]
fn cpu_matmuls_ask_for_their_thread_count_once_a_process() {
    let env = Env::new();
    setup(&env);
    let trace = env.path().join("strace.txt");
    let opened = |env: &Env| -> usize {
        let o = env.dflash_under(
            &[
                "strace",
                "-f",
                "-e",
                "trace=openat",
                "-o",
                trace.to_str().unwrap(),
            ],
            &["run", "p.yaml"],
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let calls = std::fs::read_to_string(&trace).unwrap();
        assert!(calls.contains("tiny.gguf"), "the run read no target");
        calls.matches("/proc/cpuinfo").count()
    };
    let count = opened(&env);
    assert!(count <= 1, "/proc/cpuinfo opened {count} times");
    // The train and bench stages ran (their matmuls were among those traced).
    let (st, _) = env.run("p.yaml", 0);
    assert_eq!(st["trained"], "cached", "{st:?}");
    assert_eq!(st["bench"], "cached", "{st:?}");
}

/// The pipeline's prompts and a drafter exported to `exported/` (`dflash export`), copied in by a
/// `command` stage (`pipelines/smollm2-bench.yaml`'s way), and benched.
const IMPORTED: &str = r#"
name: imported
stages:
  prompts:
    kind: command
    params: {run: "cp train-00000.arrow $DFLASH_OUT/ && cp served/tokenize.json $DFLASH_OUT/",
             files: [train-00000.arrow, served/tokenize.json]}
  imported:
    kind: command
    params: {run: 'mkdir -p "$DFLASH_OUT/drafter" && cp exported/drafter/config.json exported/drafter/model.safetensors "$DFLASH_OUT/drafter/"',
             files: [exported/drafter/config.json, exported/drafter/model.safetensors]}
  bench:
    kind: bench
    inputs: [imported, prompts]
    params: {target: tiny.gguf, prompts: 4, max_new_tokens: 24}
"#;

/// A drafter trained elsewhere, as `dflash export` writes it (a `drafter/` folder), benches
/// through a `command` stage that copies it into the store (`pipelines/smollm2-bench.yaml`'s
/// way): the figures its `train` artifact gave (on this tiny random target the drafter is
/// rarely accepted, so that is a weak check; the method existing at all is the strong one),
/// and another drafter in the folder is another key.
#[test]
fn an_exported_drafter_benches_from_a_command_stage_as_from_its_train_stage() {
    let env = Env::new();
    setup(&env);
    let (st, _) = env.run("p.yaml", 0);
    assert_eq!(st["bench"], "ran");
    let o = env.dflash(&["export", "trained", "-p", "p.yaml", "exported"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    env.write("q.yaml", IMPORTED);
    let (st, _) = env.run("q.yaml", 0);
    assert_eq!(st["prompts"], "cached");
    assert_eq!(st["bench"], "ran");
    let from_train =
        env.show("bench", "p.yaml")["stats"]["sets"]["prompts"]["methods"]["trained"].clone();
    let imported =
        env.show("bench", "q.yaml")["stats"]["sets"]["prompts"]["methods"]["imported"].clone();
    for figure in ["tau", "acceptance", "identical"] {
        assert!(!imported[figure].is_null(), "{figure}: {imported}");
        assert_eq!(
            imported[figure], from_train[figure],
            "{figure}: {imported} vs {from_train}"
        );
    }
    // The untrained drafter's weights in the same folder: the import and the bench rerun.
    let o = env.dflash(&["export", "untrained", "-p", "p.yaml", "other"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::copy(
        env.path().join("other/drafter/model.safetensors"),
        env.path().join("exported/drafter/model.safetensors"),
    )
    .unwrap();
    let o = env.dflash(&["plan", "q.yaml"]);
    let plan = String::from_utf8_lossy(&o.stdout);
    assert!(
        plan.lines()
            .any(|l| l.contains("imported") && l.starts_with("pending")),
        "{plan}"
    );
}

/// A DFlash 2 drafter's convolutions run over the block it was trained with: copied in by a
/// `command` stage (no `train` upstream for the plan to check), it is refused when the bench
/// loads it at another block, with the reason, and nothing is stored for the bench.
#[test]
fn a_dflash2_drafter_is_refused_at_another_block() {
    let env = Env::new();
    setup(&env);
    env.write(
        "p.yaml",
        &PIPELINE.replace("max_steps: 0}", "max_steps: 0, head: dflash2}"),
    );
    let o = env.dflash(&["run", "p.yaml", "--only", "untrained"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = env.dflash(&["export", "untrained", "-p", "p.yaml", "exported"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    env.write(
        "q.yaml",
        &IMPORTED.replace("max_new_tokens: 24}", "max_new_tokens: 24, block_size: 8}"),
    );
    let o = env.dflash(&["run", "q.yaml"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(
            "drafter `imported` is a DFlash 2 drafter trained with blocks of 4; `block_size` asks 8"
        ),
        "{err}"
    );
    let plan = String::from_utf8_lossy(&env.dflash(&["plan", "q.yaml"]).stdout).into_owned();
    assert!(
        plan.lines()
            .any(|l| l.starts_with("pending") && l.contains("bench")),
        "{plan}"
    );
}

#[test]
fn endpoint_mode_compares_running_servers_with_and_without_speculation() {
    let model = support::hub::assets().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let plain = support::LlamaServer::start(&model, "smollm2", &[]);
    let lookup = support::LlamaServer::start(
        &model,
        "smollm2",
        &[
            "--draft_model",
            "prompt-lookup-decoding",
            "--draft_model_num_pred_tokens",
            "8",
        ],
    );
    let env = Env::new();
    std::fs::copy(
        support::hub::assets().join("mt-bench.jsonl"),
        env.path().join("mt-bench.jsonl"),
    )
    .unwrap();
    env.write(
        "p.yaml",
        &format!(
            "stages:\n  mt_bench: {{kind: download, params: {{path: mt-bench.jsonl}}}}\n  \
             bench:\n    kind: bench\n    inputs: [mt_bench]\n    params: {{prompts: 2, max_new_tokens: 24, \
             endpoints: {{plain: '{}', lookup: '{}'}}}}\n",
            plain.url(),
            lookup.url()
        ),
    );
    let (st, _) = env.run("p.yaml", 0);
    assert_eq!(st["bench"], "ran");
    let m = env.show("bench", "p.yaml");
    let methods = &m["stats"]["sets"]["mt_bench"]["methods"];
    for name in ["plain", "lookup"] {
        let r = &methods[name];
        assert!(
            r["tokens_per_second"].as_f64().unwrap() > 0.0,
            "{name}: {r}"
        );
        let (p50, p90) = (
            r["latency_p50"].as_f64().unwrap(),
            r["latency_p90"].as_f64().unwrap(),
        );
        assert!(p50 > 0.0 && p90 >= p50, "{name}: {r}");
        // llama.cpp reports no accept length: none is made up.
        assert!(r["tau"].is_null(), "{name}: {r}");
    }
    assert_eq!(methods["plain"]["speedup"], 1.0);
    drop((plain, lookup));

    // A server that is not there fails the stage and names it.
    env.write(
        "q.yaml",
        &format!(
            "stages:\n  mt_bench: {{kind: download, params: {{path: mt-bench.jsonl}}}}\n  \
             bench:\n    kind: bench\n    inputs: [mt_bench]\n    params: {{prompts: 1, \
             endpoints: {{gone: 'http://127.0.0.1:{}/v1'}}}}\n",
            support::free_port()
        ),
    );
    let (st, v) = env.run("q.yaml", 1);
    assert_eq!(st["bench"], "failed");
    assert!(v.to_string().contains("endpoint `gone`"), "{v}");
}

/// The reference harness's way of asking, with the real SmolLM2 on CPU: MT-Bench's second turn
/// is asked after each method's own reply to the first (not both turns back to back), HumanEval
/// goes in inside the harness's instruction, and every method's prompt and output tokens are in
/// the artifact per turn.
#[test]
fn multi_turn_sets_are_asked_turn_by_turn_and_formats_wrap_the_prompts() {
    let assets = support::hub::assets();
    let env = Env::new();
    for f in ["mt-bench.jsonl", "HumanEval.jsonl.gz"] {
        std::fs::copy(assets.join(f), env.path().join(f)).unwrap();
    }
    let model = assets.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let bench = |inputs: &str, extra: &str| {
        format!(
            "    kind: bench\n    inputs: [{inputs}]\n    params: {{target: '{}', prompts: 1, \
             max_new_tokens: 6, device: cpu{extra}}}\n",
            model.display()
        )
    };
    env.write(
        "p.yaml",
        &format!(
            "stages:\n  mt_bench: {{kind: download, params: {{path: mt-bench.jsonl}}}}\n  \
             humaneval: {{kind: download, params: {{path: HumanEval.jsonl.gz}}}}\n  \
             bench:\n{}  raw:\n{}",
            bench(
                "mt_bench, humaneval",
                ", prompt_format: {humaneval: humaneval}"
            ),
            bench("humaneval", "")
        ),
    );
    let (st, _) = env.run("p.yaml", 0);
    assert_eq!(st["bench"], "ran");
    let lines = |stage: &str, set: &str| -> Vec<Value> {
        let dir = env.path().join(format!("out-{stage}-{set}"));
        let o = env.dflash(&["export", stage, "-p", "p.yaml", dir.to_str().unwrap()]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        std::fs::read_to_string(dir.join(format!("sets/{set}.jsonl")))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let ids = |v: &Value| -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    let mt = lines("bench", "mt_bench");
    // Two methods (autoregressive, ngram) x two turns, in order.
    let shape: Vec<(&str, u64)> = mt
        .iter()
        .map(|l| (l["method"].as_str().unwrap(), l["turn"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        shape,
        [
            ("autoregressive", 0),
            ("autoregressive", 1),
            ("ngram", 0),
            ("ngram", 1)
        ]
    );
    for l in &mt {
        assert_eq!(ids(&l["tokens"]).len() as u64, l["output_tokens"], "{l}");
    }
    // Turn 2's prompt is turn 1's, then the reply to it, then the second question.
    let (first, second) = (ids(&mt[0]["prompt"]), ids(&mt[1]["prompt"]));
    let reply = ids(&mt[0]["tokens"]);
    assert!(second.starts_with(&first), "{second:?} after {first:?}");
    assert_eq!(
        &second[first.len()..first.len() + reply.len()],
        reply.as_slice()
    );
    assert!(second.len() > first.len() + reply.len() + 5);
    assert_eq!(mt[2]["prompt"], mt[0]["prompt"]);
    assert_eq!(mt[3]["identical"], true);
    let m = env.show("bench", "p.yaml");
    assert_eq!(
        m["stats"]["sets"]["mt_bench"]["methods"]["ngram"]["identical"],
        1
    );
    // The multi-turn set's figures also turn by turn (results.json), each turn's rounds and
    // tokens those of its lines, its tau in the manifest; a single-turn set has none.
    let results: Value = serde_json::from_slice(
        &std::fs::read(env.path().join("out-bench-mt_bench/results.json")).unwrap(),
    )
    .unwrap();
    for (j, method) in ["autoregressive", "ngram"].iter().enumerate() {
        let r = &results["sets"]["mt_bench"]["methods"][method];
        let turns = r["by_turn"].as_array().expect("by_turn");
        assert_eq!(turns.len(), 2, "{r}");
        for (t, turn) in turns.iter().enumerate() {
            let line = &mt[2 * j + t];
            assert_eq!(turn["prompts"], 1, "{turn}");
            assert_eq!(turn["rounds"], line["rounds"], "{turn} vs {line}");
            assert_eq!(turn["committed"], line["committed"], "{turn} vs {line}");
        }
        let taus = &m["stats"]["sets"]["mt_bench"]["methods"][method]["tau_by_turn"];
        assert_eq!(taus.as_array().map(Vec::len), Some(2), "{taus}");
    }
    assert!(results["sets"]["humaneval"]["methods"]["ngram"]["by_turn"].is_null());
    // HumanEval inside the instruction is longer than HumanEval as it is, and starts alike
    // (the template's opening) but differs right after it.
    let wrapped = ids(&lines("bench", "humaneval")[0]["prompt"]);
    let raw = ids(&lines("raw", "humaneval")[0]["prompt"]);
    assert!(
        wrapped.len() > raw.len() + 10,
        "{} vs {}",
        wrapped.len(),
        raw.len()
    );
    assert_ne!(wrapped[..raw.len()], raw[..]);

    // A format for a set that is not an input, or one without {prompt}, is refused before
    // anything runs, naming it.
    for (format, says) in [
        (
            "{gsm8k: gsm8k}",
            "param `prompt_format.gsm8k` of `bench`: `gsm8k` is not a prompt set",
        ),
        ("{humaneval: 'Solve it'}", "neither a preset"),
    ] {
        env.write(
            "q.yaml",
            &format!(
                "stages:\n  humaneval: {{kind: download, params: {{path: HumanEval.jsonl.gz}}}}\n  \
                 bench:\n{}",
                bench("humaneval", &format!(", prompt_format: {format}"))
            ),
        );
        let out = env.dflash(&["run", "q.yaml"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(says), "{stderr}");
        assert!(!stderr.contains("started"), "{stderr}");
    }
}

/// Two runs of `pipeline` (`p.yaml`): one whole (what an unstopped run decodes), one with only
/// the drafters trained, its bench still to run.
fn unstopped_and_ready(pipeline: &str) -> (Env, Env) {
    let straight = Env::new();
    setup(&straight);
    straight.write("p.yaml", pipeline);
    straight.run("p.yaml", 0);
    let env = Env::new();
    setup(&env);
    env.write("p.yaml", pipeline);
    let o = env.dflash(&["run", "p.yaml", "--only", "trained", "--only", "untrained"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    (straight, env)
}

/// The bench stage's log of run `run` (its `dflash run --json` record).
fn bench_log(env: &Env, run: &Value) -> String {
    support::env::walk(&env.path().join(".work/logs"))
        .into_iter()
        .filter(|p| p.ends_with(format!("{}/bench.log", run["run_id"].as_str().unwrap())))
        .map(|p| std::fs::read_to_string(p).unwrap())
        .next()
        .expect("the run's bench log")
}

/// Each method's tokens by (prompt id, method) in an exported bench's `sets/prompts.jsonl`,
/// every pair once.
fn tokens_by_prompt(dir: &std::path::Path) -> std::collections::BTreeMap<(String, String), Value> {
    let mut seen = std::collections::BTreeMap::new();
    for line in std::fs::read_to_string(dir.join("sets/prompts.jsonl"))
        .unwrap()
        .lines()
    {
        let v: Value = serde_json::from_str(line).unwrap();
        let at = (
            v["id"].to_string(),
            v["method"].as_str().unwrap().to_owned(),
        );
        assert!(
            seen.insert(at, v["tokens"].clone()).is_none(),
            "twice: {line}"
        );
    }
    seen
}

/// A bench killed mid-set (kill -9, after some prompts) resumes at its next prompt: the prompts
/// it kept are not decoded again, every prompt is in the artifact once, and each output is what
/// an unstopped run decodes.
#[test]
fn a_bench_killed_mid_set_resumes_at_its_next_prompt() {
    let pipeline = PIPELINE.replace(
        "prompts: 4, max_new_tokens: 24",
        "prompts: 12, max_new_tokens: 64",
    );
    let outputs = |env: &Env| {
        let dir = env.path().join("out");
        let o = env.dflash(&["export", "bench", "-p", "p.yaml", dir.to_str().unwrap()]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        tokens_by_prompt(&dir)
    };
    let (straight, env) = unstopped_and_ready(&pipeline);
    let resume = env.path().join(".work/resume");
    let kept = || {
        support::env::walk(&resume)
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .count()
    };
    let mut child = env.run_until("p.yaml", "no prompt was kept", &|| kept() >= 2);
    child.kill().unwrap();
    child.wait().unwrap();
    let before = kept();
    assert!(before < 12, "the kill came after the set was done");
    let (st, run) = env.run("p.yaml", 0);
    assert_eq!(st["bench"], "ran");
    let log = bench_log(&env, &run);
    let said = format!("prompts: {before} of 12 prompts decoded by an earlier attempt, kept");
    assert!(log.contains(&said), "{log}");
    let (a, b) = (outputs(&straight), outputs(&env));
    assert_eq!(a.len(), 12 * 4);
    assert_eq!(a, b);
}

/// A bench cut mid-set on one machine resumes on another that reads the same store: every
/// four prompts are committed as a shard, so with the first machine's resume folder gone
/// (`dflash copy` to another store, the folder deleted) the rerun decodes only the prompts
/// past the last committed four, and each output is what an unstopped run decodes.
#[test]
fn a_bench_cut_on_one_machine_resumes_from_the_store_on_another() {
    let pipeline = PIPELINE.replace(
        "prompts: 4, max_new_tokens: 24",
        "prompts: 12, max_new_tokens: 64",
    );
    let outputs = |env: &Env, store: &str| {
        let dir = env.path().join(format!("out-{store}"));
        let o = env.dflash(&[
            "export",
            "bench",
            "-p",
            "p.yaml",
            "--store",
            store,
            dir.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let mut groups: Vec<String> = support::env::walk(&dir.join("prompts/prompts"))
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        groups.sort();
        (tokens_by_prompt(&dir), groups)
    };
    let (straight, env) = unstopped_and_ready(&pipeline);
    let groups_in_store = || {
        support::env::walk(&env.path().join("cache/shards"))
            .iter()
            .filter(|p| p.to_string_lossy().contains("set-prompts-prompts-"))
            .count()
    };
    let mut child = env.run_until("p.yaml", "no four prompts were committed", &|| {
        groups_in_store() >= 1
    });
    child.kill().unwrap();
    child.wait().unwrap();
    let committed = groups_in_store();
    assert!(committed < 3, "the kill came after the set was done");

    // Another machine: the store copied, the first machine's resume folder gone.
    let o = env.dflash(&["copy", "--from", "cache", "--to", "other"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::remove_dir_all(env.path().join(".work/resume")).unwrap();
    let (st, run) = env.run_with("p.yaml", &["--store", "other"], 0);
    assert_eq!(st["bench"], "resumed");
    let log = bench_log(&env, &run);
    let said = format!(
        "prompts: {} of 12 prompts decoded by an earlier attempt, kept",
        committed * 4
    );
    assert!(log.contains(&said), "{log}");
    let (a, b) = (outputs(&straight, "cache"), outputs(&env, "other"));
    assert_eq!(a.1, ["000000.json", "000004.json", "000008.json"]);
    assert_eq!(a.0.len(), 12 * 4);
    assert_eq!(a, b);
}
