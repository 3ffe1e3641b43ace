//! Params checked before anything runs: for each stage kind, a pipeline holding at least three
//! bad values is refused by `dflash plan` and by `dflash run` with every problem at once (file,
//! line, column, the value, a hint; exit 2), and the run stores nothing. Then the checks that
//! need upstream data: `train` refuses data tokenized with a larger vocabulary than its target's
//! as soon as that data exists, naming the stage whose output made it invalid. And a model
//! renamed with the same bytes keeps its stages cached.

use serde_json::Value;

mod support;
use support::env::Env;

/// `dflash plan` and `dflash run` both refuse `text` with exit 2; the run writes no store.
fn refused(env: &Env, name: &str, text: &str) -> String {
    env.write(name, text);
    let plan = env.dflash(&["plan", name]);
    assert_eq!(
        plan.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&plan.stderr)
    );
    let run = env.dflash(&["run", name]);
    assert_eq!(run.status.code(), Some(2));
    assert_eq!(
        plan.stderr, run.stderr,
        "plan and run report the same problems"
    );
    assert!(
        !env.path().join("cache").exists(),
        "a refused run touches no store"
    );
    String::from_utf8(plan.stderr).unwrap()
}

/// A model folder with the story's 27B target's `config.json` (64 layers, 151,936 tokens): its
/// header is all the checks read.
fn target(env: &Env) {
    let config = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/estimate/target-27b/config.json"
    ))
    .unwrap();
    env.write("models/target/config.json", &config);
}

#[test]
fn command_params_are_checked() {
    let env = Env::new();
    let text = r#"stages:
  a:
    kind: command
    params:
      run: "  "
      files: [scripts/missing.py]
      env: {"A=B": x}
      pass_env: [""]
  b:
    kind: command
    params: {run: "echo hi", shards: 0}
"#;
    insta::assert_snapshot!(refused(&env, "command.yaml", text));
}

#[test]
fn download_params_are_checked() {
    let env = Env::new();
    let text = r"stages:
  one:
    kind: download
    params: {hf: gsm8k, path: data/missing.jsonl}
  two:
    kind: download
    params: {url: 'ftp://example.com/x.jsonl'}
  three:
    kind: download
    params: {object: 'http://bucket/x.parquet'}
  four:
    kind: download
    params: {hf: openai/gsm8k, limit: 0}
";
    insta::assert_snapshot!(refused(&env, "download.yaml", text));
}

#[test]
fn mix_params_are_checked() {
    let env = Env::new();
    let text = r"stages:
  chat:
    kind: download
    params: {hf: example/chat}
  mixed:
    kind: mix
    inputs: [chat]
    params:
      weights: {chat: 1}
      quotas: {code: 10}
      min_chars: 100
      max_chars: 10
      exclude: [gsm8k]
  zero:
    kind: mix
    inputs: [chat]
    params: {weights: {chat: 0}, total: 10}
  ranges:
    kind: mix
    inputs: [chat]
    params: {weights: {chat: -1}, total: 0, eval_fraction: 1}
";
    insta::assert_snapshot!(refused(&env, "mix.yaml", text));
}

/// Holding out every input leaves nothing to mix: said at plan time, at `exclude`.
#[test]
fn a_mix_that_holds_out_everything_is_refused() {
    let env = Env::new();
    let text = r"stages:
  gsm8k:
    kind: download
    params: {hf: openai/gsm8k}
  mixed:
    kind: mix
    inputs: [gsm8k]
    params: {exclude: [gsm8k]}
";
    let err = refused(&env, "held.yaml", text);
    assert!(
        err.contains("param `exclude` of `mixed`: every input is held out"),
        "{err}"
    );
}

#[test]
fn tokenize_params_are_checked() {
    let env = Env::new();
    env.write("models/no-tokenizer/config.json", "{}");
    let text = r"stages:
  chat:
    kind: download
    params: {hf: example/chat}
  missing:
    kind: tokenize
    inputs: [chat]
    params: {tokenizer: models/missing, chat_template: templates/missing.jinja}
  folder:
    kind: tokenize
    inputs: [chat]
    params: {tokenizer: models/no-tokenizer}
  short:
    kind: tokenize
    inputs: [chat]
    params: {tokenizer: models/no-tokenizer, max_length: 0}
";
    insta::assert_snapshot!(refused(&env, "tokenize.yaml", text));
}

#[test]
fn generate_params_are_checked() {
    let env = Env::new();
    let text = r#"stages:
  prompts:
    kind: download
    params: {hf: example/prompts}
  served:
    kind: generate
    inputs: [prompts]
    params: {model: qwen, endpoints: ["127.0.0.1:30000/v1"], launch: {cmd: "sglang"}}
  none:
    kind: generate
    inputs: [prompts]
    params: {model: qwen}
  sampling:
    kind: generate
    inputs: [prompts]
    params: {model: qwen, endpoints: ["http://127.0.0.1:30000/v1"], top_p: 0, n: 0, max_tokens: -1}
  local:
    kind: generate
    inputs: [prompts]
    params: {model: models/missing.gguf, backend: candle}
"#;
    insta::assert_snapshot!(refused(&env, "generate.yaml", text));
}

#[test]
fn train_params_are_checked() {
    let env = Env::new();
    target(&env);
    let text = r"stages:
  tokens:
    kind: download
    params: {hf: example/tokens}
  ranges:
    kind: train
    inputs: [tokens]
    params: {target: models/target, mask_token_id: 3, draft_layers: 0, block_size: 1, lr: 0, warmup: 1.5}
  shape:
    kind: train
    inputs: [tokens]
    params:
      target: models/target
      target_layers: [3, 3, 64]
      mask_token_id: 151936
      block_size: 16
      max_length: 16
  taps:
    kind: train
    inputs: [tokens]
    params: {target: models/target, mask_token_id: 151669, taps: 65}
  missing:
    kind: train
    inputs: [tokens]
    params: {target: models/missing.gguf}
";
    insta::assert_snapshot!(refused(&env, "train.yaml", text));
}

#[test]
fn bench_params_are_checked() {
    let env = Env::new();
    target(&env);
    let text = r"stages:
  gsm8k:
    kind: download
    params: {hf: openai/gsm8k}
  drafter:
    kind: train
    inputs: [gsm8k]
    params: {target: models/target, mask_token_id: 151669, block_size: 16, head: dflash2}
  nothing:
    kind: bench
    inputs: [gsm8k]
  both:
    kind: bench
    inputs: [drafter, gsm8k]
    params:
      target: models/target
      endpoints: {plain: '127.0.0.1:30000/v1'}
      block_size: 8
      prompt_format: {gsm8k: 'Answer:', humaneval: humaneval}
  ranges:
    kind: bench
    inputs: [gsm8k]
    params: {target: models/target, prompts: 0, temperature: -0.5, ngram: 0}
";
    insta::assert_snapshot!(refused(&env, "bench.yaml", text));
}

const TINY: &str = r#"
stages:
  tokens:
    kind: command
    params:
      run: "cp train-00000.arrow $DFLASH_OUT/ && echo '{\"vocab_size\": 100000}' > $DFLASH_OUT/tokenize.json"
      files: [train-00000.arrow]
  drafter:
    kind: train
    inputs: [tokens]
    params: {target: tiny.gguf, draft_layers: 1, block_size: 4, anchors: 8, mask_token_id: 63,
             target_layers: [0, 2], epochs: 1}
"#;

#[test]
fn train_refuses_data_from_another_tokenizer_as_soon_as_it_exists() {
    let env = Env::new();
    support::tiny_model(env.path(), &["tiny.gguf", "train-00000.arrow", "8", "16"]);
    env.write("p.yaml", TINY);
    // The plan can't know the data's vocabulary yet: it passes.
    assert!(env.dflash(&["plan", "p.yaml"]).status.success());
    let out = env.dflash(&["run", "p.yaml", "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !err.contains("started  drafter"),
        "train never starts:\n{err}"
    );
    assert!(
        err.contains("refused  drafter")
            && err.contains("p.yaml:11:22: param `target` of `drafter`, against the output of `tokens`: the data was tokenized with a vocabulary of 100000 tokens, but the target `tiny.gguf` has 64 embedding rows"),
        "{err}"
    );
    let run: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(run["stages"][0]["status"], "ran");
    assert_eq!(run["stages"][1]["status"], "failed");
    assert!(
        err.contains("hint: tokenize `tokens` with the target's own tokenizer"),
        "{err}"
    );
}

/// A refused stage keeps its reason in the run's record even when another of its inputs fails
/// too (it would otherwise read "an upstream stage failed").
#[test]
fn the_refusal_stays_the_record_when_another_input_fails() {
    let env = Env::new();
    support::tiny_model(env.path(), &["tiny.gguf", "train-00000.arrow", "8", "16"]);
    let text = TINY
        .replace(
            "  drafter:\n    kind: train\n    inputs: [tokens]",
            "  broken:\n    kind: command\n    params: {run: \"exit 3\"}\n  drafter:\n    kind: train\n    inputs: [tokens, broken]",
        );
    assert_ne!(text, TINY);
    env.write("p.yaml", &text);
    let out = env.dflash(&["run", "p.yaml", "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let run: Value = serde_json::from_slice(&out.stdout).unwrap();
    let drafter = run["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == "drafter")
        .unwrap();
    assert_eq!(drafter["status"], "failed", "{drafter}");
    assert!(
        drafter["error"]
            .as_str()
            .unwrap()
            .contains("against the output of `tokens`"),
        "{drafter}"
    );
}

/// `run --only` checks the stages it runs and what they need: the night's generation can start
/// before the model a later stage trains against is on this machine; `plan` still says it is
/// missing.
#[test]
fn run_only_checks_the_stages_it_runs() {
    let env = Env::new();
    support::tiny_model(env.path(), &["tiny.gguf", "train-00000.arrow", "8", "16"]);
    let text = TINY.replace("target: tiny.gguf", "target: models/later.gguf");
    env.write("p.yaml", &text);
    assert_eq!(env.dflash(&["run", "p.yaml"]).status.code(), Some(2));
    let out = env.dflash(&["run", "p.yaml", "--only", "tokens"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = env.dflash(&["plan", "p.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("`models/later.gguf` does not exist"));
}

#[test]
fn a_renamed_model_with_the_same_bytes_stays_cached() {
    let env = Env::new();
    support::tiny_model(env.path(), &["tiny.gguf", "train-00000.arrow", "8", "16"]);
    let text = TINY.replace(
        r#" && echo '{\"vocab_size\": 100000}' > $DFLASH_OUT/tokenize.json"#,
        "",
    );
    assert_ne!(text, TINY);
    env.write("p.yaml", &text);
    let (st, _) = env.run("p.yaml", 0);
    assert_eq!(st["drafter"], "ran");
    std::fs::create_dir(env.path().join("alt")).unwrap();
    std::fs::rename(
        env.path().join("tiny.gguf"),
        env.path().join("alt/renamed.gguf"),
    )
    .unwrap();
    env.write(
        "p.yaml",
        &text.replace("target: tiny.gguf", "target: alt/renamed.gguf"),
    );
    let (st, _) = env.run("p.yaml", 0);
    assert_eq!(st["drafter"], "cached", "same bytes under another name");
    // Other bytes under that name: the drafter trains again.
    support::tiny_model(
        env.path(),
        &[
            "alt/renamed.gguf",
            "unused.arrow",
            "8",
            "16",
            "--vocab",
            "65",
        ],
    );
    let plan = String::from_utf8(env.dflash(&["plan", "p.yaml"]).stdout).unwrap();
    assert!(plan.contains("pending"), "{plan}");
}
