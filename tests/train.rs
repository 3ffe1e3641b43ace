//! End-to-end tests of `train` against a tiny random Llama GGUF written by the `gguf` package
//! (`tests/support/tiny_model.py`): it learns, exports the reference layout, and a run killed
//! with `kill -9` after a checkpoint resumes from it and ends with the same bytes as a run that
//! was never stopped.

use std::process::Command;

use serde_json::Value;

mod support;
use support::env::Env;

const PIPELINE: &str = r#"
name: tiny
stages:
  tokens:
    kind: command
    params: {run: "cp train-00000.arrow $DFLASH_OUT/", files: [train-00000.arrow]}
  drafter:
    kind: train
    inputs: [tokens]
    params: {target: tiny.gguf, draft_layers: 1, block_size: 4, anchors: 8, mask_token_id: 63,
             target_layers: [0, 2], epochs: 6, lr: 0.003, checkpoint_every: 50}
"#;

fn tiny(env: &Env) {
    support::tiny_model(env.path(), &["tiny.gguf", "train-00000.arrow", "100", "48"]);
    env.write("p.yaml", PIPELINE);
}

fn exported(env: &Env, name: &str) -> std::path::PathBuf {
    exported_from(env, "p.yaml", "drafter", name)
}

/// Write `yaml` as the pipeline `name`, and the stderr of `dflash plan` on it, which must
/// refuse it (exit 2) before anything runs.
fn plan_refuses(env: &Env, name: &str, yaml: &str) -> String {
    env.write(name, yaml);
    let o = env.dflash(&["plan", name]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The mean of `field` over the first 5 steps in an exported drafter's `metrics.jsonl`.
fn start_of(dir: &std::path::Path, field: &str) -> f64 {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .take(5)
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()[field]
                .as_f64()
                .unwrap()
        })
        .sum::<f64>()
        / 5.0
}

/// `dflash export STAGE -p PIPELINE` into the folder `name`.
fn exported_from(env: &Env, pipeline: &str, stage: &str, name: &str) -> std::path::PathBuf {
    let dir = env.path().join(name);
    let o = env.dflash(&["export", stage, "-p", pipeline, dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    dir
}

/// The pace lines of the `drafter` artifact's log, as `dflash show drafter --log` prints it from
/// the store (`steps A-B of N: ... sequence tokens/s`): (A, B, N, sequence tokens a second)
/// each.
fn pace_lines(env: &Env) -> Vec<(u64, u64, u64, f64)> {
    let o = env.dflash(&["show", "drafter", "-p", "p.yaml", "--log"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let log = String::from_utf8(o.stdout).unwrap();
    log.lines()
        .filter_map(|l| l.strip_prefix("steps "))
        .map(|l| {
            let (range, rest) = l.split_once(" of ").unwrap();
            let (a, b) = range.split_once('-').unwrap();
            let (n, rest) = rest.split_once(": ").unwrap();
            let rate = rest
                .split(", ")
                .find_map(|p| p.strip_suffix(" sequence tokens/s"))
                .unwrap_or_else(|| panic!("no rate in {l}"))
                .replace(',', "");
            (
                a.parse().unwrap(),
                b.parse().unwrap(),
                n.parse().unwrap(),
                rate.parse().unwrap(),
            )
        })
        .collect()
}

#[test]
fn a_drafter_learns_and_is_exported_in_the_reference_layout() {
    let env = Env::new();
    tiny(&env);
    let (st, _) = env.run("p.yaml", 0);
    assert_eq!(st["drafter"], "ran");
    let dir = exported(&env, "out");
    let metrics: Vec<Value> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(metrics.len(), 600);
    // The log says how fast it went, window by window (checkpoints every 50 steps), every step
    // in one window and none twice; the artifact holds no wall time (metrics.jsonl is the same
    // bytes run after run).
    let pace = pace_lines(&env);
    assert_eq!(pace.len(), 12, "{pace:?}");
    for (i, &(a, b, n, rate)) in pace.iter().enumerate() {
        assert_eq!((a, b, n), (50 * i as u64 + 1, 50 * (i as u64 + 1), 600));
        assert!(rate > 0.0, "{pace:?}");
    }
    assert!(metrics.iter().all(|m| m.get("seconds").is_none()));
    let first = metrics[0]["loss"].as_f64().unwrap();
    let last: f64 = metrics[590..]
        .iter()
        .map(|m| m["loss"].as_f64().unwrap())
        .sum::<f64>()
        / 10.0;
    assert!(last < 0.75 * first, "loss {first} -> {last}");
    // Warmup then cosine to ~0.
    assert!(metrics[0]["lr"].as_f64().unwrap() < metrics[30]["lr"].as_f64().unwrap());
    assert!(metrics[599]["lr"].as_f64().unwrap() < 1e-5);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("drafter/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["architectures"][0], "DFlashDraftModel");
    assert_eq!(
        config["dflash_config"]["target_layer_ids"],
        serde_json::json!([0, 2])
    );
    assert_eq!(config["dflash_config"]["mask_token_id"], 63);
    // The tensor names and shapes, read back by the `safetensors` package.
    let py = Command::new("python3")
        .arg("-c")
        .arg("import sys, json\nfrom safetensors import safe_open\nf = safe_open(sys.argv[1], 'np')\nprint(json.dumps({k: list(f.get_slice(k).get_shape()) for k in f.keys()}))")
        .arg(dir.join("drafter/model.safetensors"))
        .output()
        .unwrap();
    assert!(
        py.status.success(),
        "{}",
        String::from_utf8_lossy(&py.stderr)
    );
    let shapes: Value = serde_json::from_slice(&py.stdout).unwrap();
    assert_eq!(shapes["fc.weight"], serde_json::json!([32, 64]));
    assert_eq!(
        shapes["layers.0.self_attn.k_proj.weight"],
        serde_json::json!([16, 32])
    );
    assert_eq!(
        shapes["layers.0.self_attn.q_norm.weight"],
        serde_json::json!([8])
    );
    assert_eq!(shapes.as_object().unwrap().len(), 14);

    // Another run starts from that export (`init`): its first steps are where the first run
    // ended, not where a random drafter starts.
    let p = std::fs::read_to_string(env.path().join("p.yaml")).unwrap();
    let cont = p.replace(
        "checkpoint_every: 50}",
        "checkpoint_every: 50, init: out, max_steps: 10}",
    );
    env.write("cont.yaml", &cont);
    let (st, _) = env.run("cont.yaml", 0);
    assert_eq!(st["drafter"], "ran");
    let again = exported_from(&env, "cont.yaml", "drafter", "again");
    let start = start_of(&again, "loss");
    assert!(
        start < 0.8 * first,
        "continued at {start}, fresh at {first}, ended at {last}"
    );
    // A DFlash drafter starts a DFlash 2 one: the shared tensors carried over, the convolutions
    // and the selector at their identity start, so it too begins where the first run ended.
    env.write(
        "up.yaml",
        &cont.replace("max_steps: 10}", "max_steps: 10, head: dflash2}"),
    );
    let (st, _) = env.run("up.yaml", 0);
    assert_eq!(st["drafter"], "ran");
    let up = exported_from(&env, "up.yaml", "drafter", "up");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(up.join("drafter/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["architectures"][0], "DFlash2DraftModel");
    // Its loss adds the selector's, so compare what decoding sees: the acceptance length.
    let tau_start = |dir: &std::path::Path| start_of(dir, "tau");
    let (fresh, continued, upgraded) = (tau_start(&dir), tau_start(&again), tau_start(&up));
    eprintln!(
        "tau over the first 5 steps: fresh {fresh}, continued {continued}, DFlash 2 from it {upgraded}"
    );
    assert!(
        upgraded > fresh + 0.5 * (continued - fresh),
        "DFlash 2 from the DFlash drafter: tau {upgraded}; fresh {fresh}, continued {continued}"
    );
    // A DFlash drafter goes on with another block (its weights do not depend on it): trained
    // with blocks of 4, it starts blocks of 8 well below where a fresh drafter at 8 does.
    let at8 = |p: &str| p.replace("block_size: 4", "block_size: 8");
    env.write("wide.yaml", &at8(&cont));
    let (st, _) = env.run("wide.yaml", 0);
    assert_eq!(st["drafter"], "ran");
    env.write(
        "fresh8.yaml",
        &at8(&p).replace(
            "checkpoint_every: 50}",
            "checkpoint_every: 50, max_steps: 10}",
        ),
    );
    let (st, _) = env.run("fresh8.yaml", 0);
    assert_eq!(st["drafter"], "ran");
    let wide = exported_from(&env, "wide.yaml", "drafter", "wide");
    let fresh8 = exported_from(&env, "fresh8.yaml", "drafter", "fresh8");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(wide.join("drafter/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["block_size"], 8);
    let (wide_start, fresh8_start) = (start_of(&wide, "loss"), start_of(&fresh8, "loss"));
    eprintln!(
        "loss over the first 5 steps at 8: from the 4's drafter {wide_start}, fresh {fresh8_start}"
    );
    assert!(
        wide_start < 0.8 * fresh8_start,
        "blocks of 8 from the drafter trained with 4: loss {wide_start}; fresh at 8: {fresh8_start}"
    );
    // The stage's log says so.
    let logs: String = support::env::walk(&env.path().join(".work/logs"))
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap_or_default())
        .collect();
    assert!(
        logs.contains("(trained with blocks of 4; it goes on with blocks of 8)"),
        "{logs}"
    );
    // Both at once, as a user may ask: the DFlash drafter trained at 4 starts a DFlash 2 one
    // at 8 (its convolutions start fresh, at the new block).
    env.write(
        "up_wide.yaml",
        &at8(&cont).replace("max_steps: 10}", "max_steps: 10, head: dflash2}"),
    );
    let (st, _) = env.run("up_wide.yaml", 0);
    assert_eq!(st["drafter"], "ran");
    let up_wide = exported_from(&env, "up_wide.yaml", "drafter", "up_wide");
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(up_wide.join("drafter/config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        (
            config["architectures"][0].as_str(),
            config["block_size"].as_u64()
        ),
        (Some("DFlash2DraftModel"), Some(8))
    );
    // A DFlash 2 drafter does not: its convolutions run over the block it was trained with.
    let err = plan_refuses(
        &env,
        "up8.yaml",
        &at8(&cont).replace(
            "init: out, max_steps: 10}",
            "init: up, max_steps: 10, head: dflash2}",
        ),
    );
    assert!(
        err.contains("block_size") && err.contains("`init`'s drafter has blocks of 4"),
        "{err}"
    );
    // A drafter of another shape is refused before anything runs, naming the param.
    let err = plan_refuses(
        &env,
        "other.yaml",
        &cont.replace("draft_layers: 1", "draft_layers: 2"),
    );
    assert!(
        err.contains("draft_layers") && err.contains("`init`'s drafter has 1 layer,"),
        "{err}"
    );
}

/// The `eval` split (held-out sequences) is scored before the first step, every `eval_every`
/// steps and after the last, on the same blocks each time; the scores fall as the drafter learns
/// the rule, and scoring does not touch training: with `eval_sequences: 0` the drafter and the
/// training curve are byte for byte the same.
/// Where stderr is no terminal (a log file, `nohup` on a GPU box) a run is quiet about progress
/// (the CLI contract) unless `DFLASH_PROGRESS_EVERY` asks for a running stage's progress every
/// so many seconds: at 0 every step's line, with its loss, tau, tokens a second and the time
/// left; at a day, none; unset, none.
#[test]
fn a_run_into_a_log_file_says_how_training_goes() {
    let mut env = Env::new();
    tiny(&env);
    // Each case trains a different number of steps, so each runs (the tokens stay cached).
    let run = |env: &Env, steps: u32| {
        let name = format!("p{steps}.yaml");
        env.write(
            &name,
            &PIPELINE.replace("epochs: 6", &format!("epochs: 6, max_steps: {steps}")),
        );
        let o = env.dflash(&["run", &name]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stderr).unwrap()
    };
    // Unset: quiet.
    assert!(!run(&env, 10).contains("progress "));
    // Every day: none in this run (the interval holds).
    env.set("DFLASH_PROGRESS_EVERY", "86400");
    assert!(
        !run(&env, 11).contains("progress "),
        "no progress line before the interval has passed"
    );
    env.set("DFLASH_PROGRESS_EVERY", "0");
    let err = run(&env, 12);
    let progress: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("progress drafter"))
        .collect();
    assert_eq!(progress.len(), 12, "{err}");
    for (i, line) in progress.iter().enumerate() {
        assert!(line.contains(&format!(" {}/12 loss ", i + 1)), "{line}");
        assert!(line.contains(" tok/s"), "{line}");
        // The time left, but for the last step.
        assert_eq!(line.contains(" left"), i < 11, "{line}");
    }
}

#[test]
fn held_out_sequences_are_scored_as_training_goes_and_leave_it_unchanged() {
    let pipeline = |evals: &str| {
        PIPELINE
            .replace(
                "run: \"cp train-00000.arrow $DFLASH_OUT/\", files: [train-00000.arrow]",
                "run: \"cp train-00000.arrow eval-00000.arrow $DFLASH_OUT/\", files: [train-00000.arrow, eval-00000.arrow]",
            )
            .replace(
                "checkpoint_every: 50}",
                &format!("checkpoint_every: 50, eval_every: 200{evals}}}"),
            )
    };
    let mut curves = Vec::new();
    let mut weights = Vec::new();
    for evals in ["", ", eval_sequences: 0"] {
        let env = Env::new();
        support::tiny_model(
            env.path(),
            &["tiny.gguf", "train-00000.arrow", "100", "48", "--held", "6"],
        );
        env.write("p.yaml", &pipeline(evals));
        let (st, _) = env.run("p.yaml", 0);
        assert_eq!(st["drafter"], "ran");
        let dir = exported(&env, "out");
        let lines: Vec<Value> = std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let stats = &env.show("drafter", "p.yaml")["stats"];
        if evals.is_empty() {
            let scored: Vec<u64> = lines
                .iter()
                .filter(|l| l.get("eval").is_some())
                .map(|l| l["step"].as_u64().unwrap())
                .collect();
            assert_eq!(scored, [200, 400, 600]);
            let eval = &stats["eval"];
            assert_eq!(eval["end"], lines[599]["eval"]);
            assert_eq!(eval["start"]["sequences"], 6);
            let (l0, l1) = (
                eval["start"]["loss"].as_f64().unwrap(),
                eval["end"]["loss"].as_f64().unwrap(),
            );
            let (t0, t1) = (
                eval["start"]["tau"].as_f64().unwrap(),
                eval["end"]["tau"].as_f64().unwrap(),
            );
            assert!(
                l1 < 0.75 * l0 && t1 > t0,
                "held out: loss {l0} -> {l1}, tau {t0} -> {t1}"
            );
        } else {
            assert!(lines.iter().all(|l| l.get("eval").is_none()));
            assert!(stats.get("eval").is_none(), "{stats}");
        }
        curves.push(
            lines
                .into_iter()
                .map(|mut l| {
                    l.as_object_mut().unwrap().remove("eval");
                    l
                })
                .collect::<Vec<_>>(),
        );
        weights.push(std::fs::read(dir.join("drafter/model.safetensors")).unwrap());
    }
    assert!(curves[0] == curves[1], "scoring changed the training curve");
    assert!(weights[0] == weights[1], "scoring changed the drafter");
}

/// Two trainings ready at once run one after the other, however many jobs the run allows: they
/// would share one GPU's memory (two trainings of a large target do not fit) and its time.
#[test]
fn stages_on_the_accelerator_take_turns() {
    let env = Env::new();
    tiny(&env);
    let second = "  other:\n    kind: train\n    inputs: [tokens]\n    params: {target: tiny.gguf, draft_layers: 1, block_size: 4, anchors: 8, mask_token_id: 63,\n             target_layers: [0, 2], epochs: 2, seed: 1}\n";
    env.write(
        "two.yaml",
        &format!("{}{second}", PIPELINE.replace("epochs: 6", "epochs: 2")),
    );
    let o = env.dflash(&["run", "two.yaml", "--json", "-j", "4"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let span = |stage: &str| {
        let lineage = &env.show(stage, "two.yaml")["lineage"];
        let started = humantime::parse_rfc3339(lineage["started"].as_str().unwrap()).unwrap();
        let from = started
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        (from, from + lineage["seconds"].as_f64().unwrap())
    };
    let (a, b) = (span("drafter"), span("other"));
    assert!(
        a.1 <= b.0 || b.1 <= a.0,
        "the trainings overlapped: {a:?} and {b:?}"
    );
    // What the run says agrees: the second is "started" after the first is reported done, and
    // the seconds it reports are its own, not its own plus the wait for the first.
    let (first, second) = if a.0 < b.0 {
        ("drafter", "other")
    } else {
        ("other", "drafter")
    };
    let stderr = String::from_utf8_lossy(&o.stderr);
    let at = |line: &str| {
        stderr
            .lines()
            .position(|l| l.starts_with(line))
            .unwrap_or_else(|| panic!("no `{line}` in:\n{stderr}"))
    };
    assert!(
        at(&format!("ran      {first} ")) < at(&format!("started  {second}")),
        "{stderr}"
    );
    let run: Value = serde_json::from_slice(&o.stdout).unwrap();
    let reported = |id: &str| {
        run["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["id"] == id)
            .unwrap()["seconds"]
            .as_f64()
            .unwrap()
    };
    let (own, waited) = if second == "other" { (b, a) } else { (a, b) };
    assert!(
        reported(second) < (own.1 - own.0) + 0.5 * (waited.1 - waited.0),
        "`{second}` reported {} s; it trained {} s after waiting {} s for `{first}`",
        reported(second),
        own.1 - own.0,
        waited.1 - waited.0
    );
}

/// A sweep (`matrix:`) whose one variant is the pipeline's own drafter: the same key, trained
/// once; the stage that waited for the GPU finds it committed and is cached, not trained again.
#[test]
fn a_sweep_variant_equal_to_another_stage_trains_once() {
    let env = Env::new();
    tiny(&env);
    let sweep = "  sweep:\n    kind: train\n    inputs: [tokens]\n    params: {target: tiny.gguf, draft_layers: 1, block_size: 4, anchors: 8, mask_token_id: 63,\n             target_layers: [0, 2], epochs: 2, checkpoint_every: 50}\n    matrix: {lr: [0.003, 1e-2]}\n";
    env.write(
        "sweep.yaml",
        &format!("{}{sweep}", PIPELINE.replace("epochs: 6", "epochs: 2")),
    );
    // Jobs enough for all three trainings to be ready, and to look for their keys, at once.
    let (st, _) = env.run_with("sweep.yaml", &["-j", "4"], 0);
    let same = ["drafter", "sweep@lr=0.003"];
    let mut statuses: Vec<&str> = same.iter().map(|id| st[*id].as_str()).collect();
    statuses.sort_unstable();
    assert_eq!(statuses, ["cached", "ran"], "{st:?}");
    // A number names its stage as written: `1e-2`, not `0.01`.
    assert_eq!(st["sweep@lr=1e-2"], "ran", "{st:?}");
    assert_eq!(
        env.show("drafter", "sweep.yaml")["key"],
        env.show("sweep@lr=0.003", "sweep.yaml")["key"]
    );
}

#[test]
fn kill_9_after_a_checkpoint_then_rerun_ends_exactly_as_an_unstopped_run() {
    let straight = Env::new();
    tiny(&straight);
    straight.run("p.yaml", 0);
    let reference = exported(&straight, "out");

    let env = Env::new();
    tiny(&env);
    let mut child = env.run_until_shards("p.yaml", 1);
    child.kill().unwrap();
    child.wait().unwrap();
    let (st, _) = env.run("p.yaml", 0);
    assert_eq!(
        st["drafter"], "resumed",
        "the kill came after the run had finished"
    );
    let resumed = exported(&env, "out");
    // The resumed run's pace begins after the checkpoint it resumed from and ends at the end.
    let pace = pace_lines(&env);
    let (first, last) = (pace[0], pace[pace.len() - 1]);
    assert!(first.0 > 1 && (first.0 - 1) % 50 == 0, "{pace:?}");
    assert_eq!((last.1, last.2), (600, 600), "{pace:?}");
    for f in [
        "drafter/model.safetensors",
        "metrics.jsonl",
        "ckpt-00000550/state.safetensors",
    ] {
        assert!(
            std::fs::read(reference.join(f)).unwrap() == std::fs::read(resumed.join(f)).unwrap(),
            "{f} differs"
        );
    }
}

/// A Hugging Face folder converted from the tiny GGUF (`tests/support/gguf_to_hf.py`: the query
/// and key rows back in the rotate-half layout) trains the same drafter: the same losses step
/// by step, and the folder's files are pinned.
#[test]
fn a_hugging_face_folder_target_trains_as_its_gguf_does() {
    let env = Env::new();
    tiny(&env);
    support::gguf_to_hf(
        &env.path().join("tiny.gguf"),
        &env.path().join("tiny-hf"),
        &["--no-tokenizer"],
    );
    let short = PIPELINE.replace("epochs: 6", "epochs: 6, max_steps: 12");
    env.write("p.yaml", &short);
    env.write(
        "hf.yaml",
        &short.replace("target: tiny.gguf", "target: tiny-hf"),
    );
    let losses = |pipeline: &str| -> Vec<f64> {
        let (st, _) = env.run(pipeline, 0);
        assert_eq!(st["drafter"], "ran");
        let dir = env.path().join(format!("out-{pipeline}"));
        let o = env.dflash(&["export", "drafter", "-p", pipeline, dir.to_str().unwrap()]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["loss"]
                    .as_f64()
                    .unwrap()
            })
            .collect()
    };
    let (gguf, hf) = (losses("p.yaml"), losses("hf.yaml"));
    assert_eq!(gguf.len(), 12);
    for (a, b) in gguf.iter().zip(&hf) {
        assert!((a - b).abs() < 1e-4 * a.abs(), "{gguf:?} vs {hf:?}");
    }
    let o = env.dflash(&["show", "drafter", "-p", "hf.yaml"]);
    let pins =
        serde_json::from_slice::<Value>(&o.stdout).unwrap()["fingerprint"]["pins"].to_string();
    assert!(
        pins.contains("\"target:model.safetensors\"") && pins.contains("\"target:config.json\""),
        "{pins}"
    );
}

/// The story's own kind of target, a hybrid (Qwen3.5: Gated DeltaNet and gated attention): a
/// tiny random one as a Hugging Face folder (`tests/support/qwen3_5_reference.py`, checked
/// against transformers in `stages/model/tests/qwen3_5.rs`) with SmolLM2's tokenizer and chat
/// template. The whole story runs on it: generate (the candle backend), tokenize, a drafter
/// trained against its taps, and a bench that is lossless, as chains and as trees: every
/// verification pass is cropped to its accepted prefix (or path), the Gated DeltaNet layers'
/// state included.
#[test]
fn a_hybrid_qwen3_5_target_runs_the_story_and_benches_dflash_and_dflash2_losslessly() {
    let env = Env::new();
    support::qwen3_5_model_with_tokenizer(env.path(), "qwen35");
    let rows: Vec<String> = (0..10)
        .map(|i| {
            format!(
                r#"{{"id": "c{i}", "conversations": [{{"from": "human", "value": "Count from {i} to {} and say why numbers matter."}}, {{"from": "gpt", "value": "old"}}]}}"#,
                i + 9
            )
        })
        .collect();
    env.write("chats.jsonl", &(rows.join("\n") + "\n"));
    env.write(
        "p.yaml",
        r#"
stages:
  chats:
    kind: download
    params: {path: chats.jsonl}
  completions:
    kind: generate
    inputs: [chats]
    params: {backend: candle, model: qwen35, max_tokens: 24, device: cpu, batch_size: 4}
  tokens:
    kind: tokenize
    inputs: [completions]
    params: {tokenizer: qwen35, truncated: keep}
  drafter:
    kind: train
    inputs: [tokens]
    params: {target: qwen35, draft_layers: 1, block_size: 4, anchors: 8, mask_token_id: 3,
             target_layers: [0, 2], epochs: 4, max_steps: 12, lr: 0.003}
  bench:
    kind: bench
    inputs: [drafter, chats]
    params: {target: qwen35, prompts: 3, max_new_tokens: 20, verify: both}
  drafter2:
    kind: train
    inputs: [tokens]
    params: {target: qwen35, head: dflash2, dflash2: {conv_group_size: 16, selector_rank: 8},
             draft_layers: 1, block_size: 4, anchors: 8, mask_token_id: 3,
             target_layers: [0, 2], epochs: 4, max_steps: 12, lr: 0.003}
  bench2:
    kind: bench
    inputs: [drafter2, chats]
    params: {target: qwen35, prompts: 3, max_new_tokens: 20, verify: both}
"#,
    );
    let (st, _) = env.run("p.yaml", 0);
    assert_eq!(st["bench"], "ran", "{st:?}");
    let g = env.show("completions", "p.yaml");
    assert_eq!(g["stats"]["rows"], 10, "{g}");
    let t = env.show("drafter", "p.yaml");
    assert_eq!(t["stats"]["steps"], 12, "{t}");
    assert!(
        t["stats"]["final_loss"].as_f64().unwrap().is_finite(),
        "{t}"
    );
    let m = env.show("bench", "p.yaml");
    let set = &m["stats"]["sets"]["chats"];
    assert_eq!(set["prompts"], 3, "{m}");
    // The drafter verified as a tree too: each node's Gated DeltaNet state from its parent's.
    for name in ["ngram", "drafter", "drafter+tree"] {
        let r = &set["methods"][name];
        assert_eq!(
            r["identical"], 3,
            "{name}: greedy speculation changed the output: {r}"
        );
    }
    // DFlash 2: exported as the reference's `DFlash2DraftModel`, and lossless too.
    let dir = exported_from(&env, "p.yaml", "drafter2", "d2");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("drafter/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["architectures"][0], "DFlash2DraftModel", "{config}");
    let d = &config["dflash_config"];
    assert_eq!(
        (
            &d["conv_kernel_size"],
            &d["conv_group_size"],
            &d["selector_rank"],
            &d["selector_top_k"]
        ),
        (&4.into(), &16.into(), &8.into(), &8.into()),
        "{config}"
    );
    let set = &env.show("bench2", "p.yaml")["stats"]["sets"]["chats"];
    for name in ["drafter2", "drafter2+tree"] {
        assert_eq!(set["methods"][name]["identical"], 3, "{name}: {set}");
    }
    // A setting DFlash 2 does not have: refused at plan time, by name.
    let p = std::fs::read_to_string(env.path().join("p.yaml")).unwrap();
    let err = plan_refuses(
        &env,
        "bad.yaml",
        &p.replace("selector_rank: 8}", "selector_rank: 8, kernel: 3}"),
    );
    assert!(err.contains("`kernel` is not a DFlash 2 setting"), "{err}");
}

/// `optimizer_moments: bf16` trains with AdamW's moments in bf16 (stochastic rounding): the
/// checkpoint holds them in bf16, half the bytes, and the drafter learns as the f32 moments'
/// does (the loss over the last steps within a few percent of theirs).
#[test]
fn bf16_moments_train_as_f32_ones_in_half_the_bytes() {
    let last_loss = |dir: &std::path::Path| {
        let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        let losses: Vec<f64> = text
            .lines()
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["loss"]
                    .as_f64()
                    .unwrap()
            })
            .collect();
        losses[losses.len() - 20..].iter().sum::<f64>() / 20.0
    };
    // The dtype of every `m.` and `v.` tensor in a checkpoint (its safetensors header).
    let moment_dtypes = |dir: &std::path::Path| {
        let ckpt = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| {
                p.file_name()
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .starts_with("ckpt-")
            })
            .expect("a checkpoint");
        let bytes = std::fs::read(ckpt.join("state.safetensors")).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let mut dtypes: Vec<String> = header
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| k.starts_with("m.") || k.starts_with("v."))
            .map(|(_, t)| t["dtype"].as_str().unwrap().to_owned())
            .collect();
        dtypes.dedup();
        dtypes
    };
    let mut dirs = Vec::new();
    for moments in ["f32", "bf16"] {
        let env = Env::new();
        tiny(&env);
        env.write(
            "p.yaml",
            &PIPELINE.replace("epochs: 6", "epochs: 2").replace(
                "lr: 0.003,",
                &format!("lr: 0.003, optimizer_moments: {moments},"),
            ),
        );
        let (st, _) = env.run("p.yaml", 0);
        assert_eq!(st["drafter"], "ran");
        dirs.push((env, moments));
    }
    let (f32_dir, bf16_dir) = (exported(&dirs[0].0, "out"), exported(&dirs[1].0, "out"));
    assert_eq!(moment_dtypes(&f32_dir), ["F32"]);
    assert_eq!(moment_dtypes(&bf16_dir), ["BF16"]);
    let (a, b) = (last_loss(&f32_dir), last_loss(&bf16_dir));
    assert!(
        (a - b).abs() < 0.05 * a,
        "last losses: f32 moments {a}, bf16 {b}"
    );
    assert!(
        start_of(&bf16_dir, "loss") > 1.1 * b,
        "bf16 moments did not learn: {} -> {b}",
        start_of(&bf16_dir, "loss")
    );
}
