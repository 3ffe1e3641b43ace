//! End-to-end tests of the data stages (`download`, `mix`) on real datasets: a local server
//! implementing the Hub API subset serves the files of ../shared/ASSETS.md, Parquet written by
//! pyarrow, and pyarrow reads back what dflash wrote.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

mod support;
use support::env::Env;
use support::hub::{Hub, assets};

fn python(script: &str, args: &[&Path]) -> String {
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python3 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// jsonl (optionally gzipped) -> parquet with pyarrow, as the Hub's parquet conversion serves it.
fn to_parquet(src: &Path, dest: &Path) {
    std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
    python(
        "import sys, gzip, json, pyarrow as pa, pyarrow.parquet as pq\n\
         src, dest = sys.argv[1:]\n\
         op = gzip.open if src.endswith('.gz') else open\n\
         rows = [json.loads(l) for l in op(src, 'rt') if l.strip()]\n\
         pq.write_table(pa.Table.from_pylist(rows), dest)",
        &[src, dest],
    );
}

/// Rows per file of an exported dataset, as pyarrow (`pa.ipc.open_stream`) reads them.
fn pyarrow_rows(dir: &Path) -> Value {
    let out = python(
        "import sys, os, json, pyarrow as pa\n\
         d = sys.argv[1]\n\
         out = {}\n\
         for f in sorted(os.listdir(d)):\n\
         \x20   if f.endswith('.arrow'):\n\
         \x20       t = pa.ipc.open_stream(open(os.path.join(d, f), 'rb')).read_all()\n\
         \x20       out[f] = {'rows': t.num_rows, 'first': t.slice(0, 1).to_pylist()[0]}\n\
         print(json.dumps(out))",
        &[dir],
    );
    serde_json::from_str(&out).unwrap()
}

/// `dflash export` a stage's artifact and read it back with pyarrow.
fn exported_rows(env: &Env, stage: &str, pipeline: &str) -> Value {
    let out = env.path().join(format!("export-{stage}"));
    let status = env
        .dflash(&["export", stage, "-p", pipeline, out.to_str().unwrap()])
        .status;
    assert!(status.success());
    pyarrow_rows(&out)
}

/// A Hub-like folder with four real datasets in the layouts the Hub uses.
fn hub_root(root: &Path) {
    let a = assets();
    to_parquet(
        &a.join("HumanEval.jsonl.gz"),
        &root.join("openai/openai_humaneval/openai_humaneval/test-00000-of-00001.parquet"),
    );
    to_parquet(
        &a.join("gsm8k.jsonl"),
        &root.join("openai/gsm8k/main/test-00000-of-00001.parquet"),
    );
    std::fs::write(root.join("openai/gsm8k/README.md"), "# gsm8k").unwrap();
    let mt = root.join("HuggingFaceH4/mt_bench_prompts/raw");
    std::fs::create_dir_all(&mt).unwrap();
    std::fs::copy(a.join("mt-bench.jsonl"), mt.join("question.jsonl")).unwrap();
    let sg = root.join("anon8231489123/ShareGPT_Vicuna_unfiltered");
    std::fs::create_dir_all(&sg).unwrap();
    std::fs::copy(
        a.join("sharegpt.json"),
        sg.join("ShareGPT_V3_unfiltered_cleaned_split.json"),
    )
    .unwrap();
}

const HUB_PIPELINE: &str = r"
name: hub
stages:
  humaneval:
    kind: download
    params: {hf: openai/openai_humaneval, subset: openai_humaneval, split: test, category: code}
  gsm8k:
    kind: download
    params: {hf: openai/gsm8k, subset: main, split: test, category: math, keep: [expected]}
  mtbench:
    kind: download
    params: {hf: HuggingFaceH4/mt_bench_prompts}
  sharegpt:
    kind: download
    params: {hf: anon8231489123/ShareGPT_Vicuna_unfiltered, limit: 3000, category: chat}
";

fn show(env: &Env, stage: &str) -> Value {
    env.show(stage, "hub.yaml")
}

#[test]
fn download_maps_real_datasets_from_a_hub_and_pins_the_revision() {
    let root = tempfile::tempdir().unwrap();
    hub_root(root.path());
    // Every file's first GET breaks off after 64 KiB: downloads must resume with `Range`.
    let hub = Hub::start(root.path(), Some(65_536), None);
    let mut env = Env::new();
    env.set("HF_ENDPOINT", &hub.endpoint());
    env.write("hub.yaml", HUB_PIPELINE);
    let (st, _) = env.run("hub.yaml", 0);
    assert!(st.values().all(|s| s == "ran"), "{st:?}");

    let he = show(&env, "humaneval");
    assert_eq!(he["stats"]["rows"], 164);
    assert_eq!(he["stats"]["shapes"]["prompt"], 164);
    assert_eq!(he["stats"]["categories"]["code"], 164);
    let pin = he["fingerprint"]["pins"][0].clone();
    assert_eq!(pin["name"], "hf:openai/openai_humaneval@main");
    assert_eq!(
        pin["identity"].as_str().unwrap().len(),
        40,
        "a commit sha: {pin}"
    );
    assert_eq!(show(&env, "gsm8k")["stats"]["rows"], 100);
    let mt = show(&env, "mtbench");
    assert_eq!(mt["stats"]["rows"], 80);
    assert_eq!(mt["stats"]["shapes"]["turns"], 80);
    assert_eq!(
        mt["stats"]["categories"]["writing"], 10,
        "categories come from the data"
    );
    let sg = show(&env, "sharegpt");
    let stats = &sg["stats"];
    assert_eq!(stats["rows"], 3000, "the limit");

    // Resumed, not restarted: the first GET of each file broke off, the next asked for the rest.
    let requests = hub.requests();
    assert!(
        requests.iter().any(|r| r.contains("range=bytes=65536-")),
        "{requests:#?}"
    );

    // What pyarrow reads is what the stats say.
    let files = exported_rows(&env, "mtbench", "hub.yaml");
    let first = &files["train-00000.arrow"];
    assert_eq!(first["rows"], 80);
    assert_eq!(first["first"]["id"], "81");
    assert_eq!(first["first"]["source"], "mtbench");
    assert_eq!(first["first"]["messages"][1]["role"], "user");
    assert!(
        first["first"]["messages"][0]["content"]
            .as_str()
            .unwrap()
            .starts_with("Compose an engaging travel blog post")
    );

    // Same pipeline again: nothing is fetched.
    let before = hub
        .requests()
        .iter()
        .filter(|r| r.contains("/resolve/"))
        .count();
    let (st, _) = env.run("hub.yaml", 0);
    assert!(st.values().all(|s| s == "cached"), "{st:?}");
    let after = hub
        .requests()
        .iter()
        .filter(|r| r.contains("/resolve/"))
        .count();
    assert_eq!(before, after, "a cached download fetches no file");
}

#[test]
fn the_shared_gpt_dump_is_truncated_and_says_so() {
    let root = tempfile::tempdir().unwrap();
    let sg = root.path().join("anon/sharegpt");
    std::fs::create_dir_all(&sg).unwrap();
    std::fs::copy(assets().join("sharegpt.json"), sg.join("sharegpt.json")).unwrap();
    let hub = Hub::start(root.path(), None, None);
    let mut env = Env::new();
    env.set("HF_ENDPOINT", &hub.endpoint());
    env.write(
        "hub.yaml",
        "stages:\n  sharegpt: {kind: download, params: {hf: anon/sharegpt}}\n",
    );
    env.run("hub.yaml", 0);
    let m = show(&env, "sharegpt");
    let stats = &m["stats"];
    let rows = stats["rows"].as_u64().unwrap();
    // ASSETS.md: a streaming decoder recovers ~17.7K complete conversations.
    assert!(
        (17_000..18_500).contains(&(rows + stats["unmapped"].as_u64().unwrap())),
        "{stats}"
    );
    assert!(
        stats["files"][0]["truncated_at"].as_u64().unwrap() > 100_000_000,
        "{stats}"
    );
    // Rows that can't be mapped are counted by reason, with examples: the dump has 274
    // conversations with no user turn (empty ones among them).
    assert_eq!(stats["unmapped_reasons"]["no user turn"], 274, "{stats}");
    assert!(
        stats["unmapped_examples"][0]
            .as_str()
            .unwrap()
            .ends_with("no user turn"),
        "{stats}"
    );
}

/// `category: auto` judges each row from its prompt and reply (code, math, chat), pins the
/// rules' version, and `mix` rebalances by what it decided.
#[test]
fn category_auto_judges_rows_and_mix_rebalances_by_it() {
    let env = Env::new();
    let rows = [
        (
            "c1",
            "Write a Python function that reverses a string.",
            "def rev(s): return s[::-1]",
        ),
        (
            "c2",
            "Why does this fail?",
            "```\nfor i in range(3): print(i)\n```",
        ),
        (
            "c3",
            "Fix my SQL query: SELECT * FROM users WHERE id == 3",
            "Use a single `=`.",
        ),
        ("m1", "Solve the equation 3x + 5 = 20.", "x = 5"),
        (
            "m2",
            "Calculate the average of 4, 8 and 12.",
            "4 + 8 + 12 = 24, 24 / 3 = 8.",
        ),
        ("t1", "Write a poem about the sea.", "The sea..."),
        (
            "t2",
            "What should I see in Paris in two days?",
            "The Louvre.",
        ),
        (
            "t3",
            "Summarise the news of 2023-01-05, pages 10-20.",
            "Nothing happened.",
        ),
    ];
    let lines: Vec<String> = rows
        .iter()
        .map(|(id, q, a)| {
            serde_json::json!({"id": id, "conversations": [
                {"from": "human", "value": q}, {"from": "gpt", "value": a}]})
            .to_string()
        })
        .collect();
    env.write("chats.jsonl", &(lines.join("\n") + "\n"));
    env.write(
        "hub.yaml",
        r#"
stages:
  chats: {kind: download, params: {path: chats.jsonl, category: auto}}
  code: {kind: mix, inputs: [chats], params: {by: category, weights: {code: 1.0}, total: 3}}
"#,
    );
    env.run("hub.yaml", 0);
    let m = show(&env, "chats");
    assert_eq!(
        m["stats"]["categories"],
        serde_json::json!({"code": 3, "math": 2, "chat": 3}),
        "{m}"
    );
    let pins = m["fingerprint"]["pins"].as_array().unwrap();
    assert!(
        pins.iter().any(|p| p["name"] == "category:auto"),
        "{pins:?}"
    );
    let mix = show(&env, "code");
    assert_eq!(
        mix["stats"]["categories"],
        serde_json::json!({"code": 3}),
        "{mix}"
    );
}

#[test]
fn a_gated_dataset_needs_the_token_which_never_shows() {
    let root = tempfile::tempdir().unwrap();
    let repo = root.path().join("acme/gated");
    std::fs::create_dir_all(&repo).unwrap();
    std::fs::write(repo.join(".gated"), "").unwrap();
    std::fs::copy(assets().join("gsm8k.jsonl"), repo.join("train.jsonl")).unwrap();
    let secret = "hf_SecretTokenValue123";
    let hub = Hub::start(root.path(), None, Some(secret));
    let mut env = Env::new();
    env.set("HF_ENDPOINT", &hub.endpoint());
    env.write(
        "hub.yaml",
        "stages:\n  gated: {kind: download, params: {hf: acme/gated}}\n",
    );

    let out = env.dflash(&["run", "hub.yaml"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("HTTP 401") && stderr.contains("HF_TOKEN"),
        "{stderr}"
    );

    env.set("HF_TOKEN", secret);
    let out = env.dflash(&["run", "hub.yaml"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains(secret) && !String::from_utf8_lossy(&out.stdout).contains(secret));
    for f in support::env::walk(env.path()) {
        let bytes = std::fs::read(&f).unwrap();
        assert!(
            !String::from_utf8_lossy(&bytes).contains(secret),
            "the token is in {}",
            f.display()
        );
    }
    assert_eq!(show(&env, "gated")["stats"]["rows"], 100);
}

#[test]
fn local_files_with_bad_rows_are_counted_not_dropped_silently() {
    let env = Env::new();
    env.write(
        "data/prompts.jsonl",
        concat!(
            "{\"id\": \"a\", \"prompt\": \"What is 2+2?\"}\n",
            "{\"id\": \"b\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Hello\"}]}\n",
            "not json\n",
            "{\"id\": \"c\", \"conversations\": [{\"from\": \"martian\", \"value\": \"zork\"}]}\n",
            "{\"id\": \"d\", \"instruction\": \"Sort\", \"input\": \"3 1 2\", \"output\": \"1 2 3\"}\n",
        ),
    );
    env.write(
        "hub.yaml",
        "stages:\n  local: {kind: download, params: {path: data, category: mixed}}\n",
    );
    env.run("hub.yaml", 0);
    let stats = show(&env, "local")["stats"].clone();
    assert_eq!(stats["rows"], 3);
    assert_eq!(stats["unmapped"], 2);
    let reasons = stats["unmapped_reasons"].as_object().unwrap();
    assert!(
        reasons.keys().any(|r| r.starts_with("not JSON")),
        "{reasons:?}"
    );
    assert!(
        reasons.keys().any(|r| r.contains("unknown role `martian`")),
        "{reasons:?}"
    );
    let examples = stats["unmapped_examples"].to_string();
    assert!(examples.contains("prompts.jsonl line 3"), "{examples}");
    assert_eq!(stats["pinned"].as_object().unwrap().len(), 1);

    // Editing the file changes the key: the pin is the content.
    env.write(
        "data/prompts.jsonl",
        "{\"id\": \"z\", \"prompt\": \"new\"}\n",
    );
    let (st, _) = env.run("hub.yaml", 0);
    assert_eq!(st["local"], "ran");
}

#[test]
fn a_download_without_exactly_one_source_is_an_error() {
    let env = Env::new();
    env.write(
        "p.yaml",
        "stages:\n  both: {kind: download, params: {path: a.jsonl, url: 'http://127.0.0.1:9/x.jsonl'}}\n",
    );
    let out = env.dflash(&["run", "p.yaml"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0));
    assert!(stderr.contains("exactly one source"), "{stderr}");
}

/// Three real datasets (skewed: 164 code, 100 math, 80 chat) plus copies of GSM8K prompts, some
/// exact (case and spacing changed), some near (the last word changed).
fn mix_env(mix_params: &str) -> Env {
    let env = Env::new();
    let a = assets();
    for f in ["HumanEval.jsonl.gz", "gsm8k.jsonl", "mt-bench.jsonl"] {
        std::fs::copy(a.join(f), env.path().join(f)).unwrap();
    }
    let mut copies = String::new();
    for (i, line) in std::fs::read_to_string(a.join("gsm8k.jsonl"))
        .unwrap()
        .lines()
        .take(20)
        .enumerate()
    {
        let v: Value = serde_json::from_str(line).unwrap();
        let prompt = v["prompt"].as_str().unwrap();
        let text = if i < 10 {
            format!("  {}  ", prompt.to_uppercase().replace(' ', "   "))
        } else {
            let cut = prompt.trim_end().rsplit_once(' ').unwrap().0;
            format!("{cut} altogether?")
        };
        copies
            .push_str(&serde_json::json!({"id": format!("copy-{i}"), "prompt": text}).to_string());
        copies.push('\n');
    }
    env.write("copies.jsonl", &copies);
    env.write(
        "mix.yaml",
        &format!(
            "stages:\n\
             \x20 code: {{kind: download, params: {{path: HumanEval.jsonl.gz, category: code}}}}\n\
             \x20 math: {{kind: download, params: {{path: gsm8k.jsonl, category: math}}}}\n\
             \x20 chat: {{kind: download, params: {{path: mt-bench.jsonl}}}}\n\
             \x20 copies: {{kind: download, params: {{path: copies.jsonl, category: math}}}}\n\
             \x20 prompts:\n\
             \x20   kind: mix\n\
             \x20   inputs: [code, math, chat, copies]\n\
             \x20   params: {mix_params}\n"
        ),
    );
    env
}

/// The `prompts` stage's output digest in a `run --json` report.
fn prompts_digest(report: &Value) -> Value {
    report["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["id"] == "prompts")
        .unwrap()["digest"]
        .clone()
}

fn mix_stats(env: &Env) -> Value {
    env.show("prompts", "mix.yaml")["stats"].clone()
}

#[test]
fn mix_rebalances_dedups_and_reports_the_composition() {
    let env = mix_env(
        "{weights: {code: 1, math: 1, chat: 1, copies: 1}, total: 240, seed: 7, eval_fraction: 0.1}",
    );
    let (st, v) = env.run("mix.yaml", 0);
    assert_eq!(st["prompts"], "ran");
    let s = mix_stats(&env);
    assert_eq!(s["before"]["rows"], 364);
    assert_eq!(s["before"]["sources"]["code"], 164);
    // The ten exact copies and (most of) the ten near copies of GSM8K prompts are gone,
    // whichever of each pair the seed preferred.
    assert_eq!(s["removed"]["exact_duplicates"], 10, "{s}");
    assert!(
        s["removed"]["near_duplicates"].as_u64().unwrap() >= 8,
        "{s}"
    );
    // 60 rows wanted per source; `copies` can't give them and the report says so.
    assert_eq!(s["sources"]["code"], 60);
    assert_eq!(s["sources"]["chat"], 60);
    let short = s["shortfalls"].as_array().unwrap();
    assert!(short.iter().any(|x| x["group"] == "copies"), "{s}");
    let rows = s["rows"].as_u64().unwrap();
    assert_eq!(
        rows,
        s["splits"]["train"].as_u64().unwrap() + s["splits"]["eval"].as_u64().unwrap()
    );
    assert!(s["splits"]["eval"].as_u64().unwrap() >= 15);
    assert!(s["composition"].as_str().unwrap().contains("before"));

    // pyarrow reads it.
    let files = exported_rows(&env, "prompts", "mix.yaml");
    assert_eq!(files["train-00000.arrow"]["rows"], s["splits"]["train"]);
    assert_eq!(files["eval-00000.arrow"]["rows"], s["splits"]["eval"]);

    // The same seed gives the same bytes; another seed another sample of the same shape.
    let digest = prompts_digest(&v);
    let again = mix_env(
        "{weights: {code: 1, math: 1, chat: 1, copies: 1}, total: 240, seed: 7, eval_fraction: 0.1}",
    );
    let (_, v2) = again.run("mix.yaml", 0);
    let d2 = prompts_digest(&v2);
    assert_eq!(digest, d2, "deterministic across stores");
    let other = mix_env(
        "{weights: {code: 1, math: 1, chat: 1, copies: 1}, total: 240, seed: 8, eval_fraction: 0.1}",
    );
    let (_, v3) = other.run("mix.yaml", 0);
    let d3 = prompts_digest(&v3);
    assert_ne!(digest, d3);
    assert_eq!(mix_stats(&other)["sources"]["code"], 60);
}

/// Held-out sets: GSM8K is the benchmark; its 20 copies (10 exact, 10 near) must not reach
/// training, and none of GSM8K's own rows either, whatever the weights ask.
#[test]
fn excluded_inputs_and_copies_of_their_prompts_never_enter_the_mix() {
    let env =
        mix_env("{weights: {code: 1, chat: 1, copies: 1}, total: 300, seed: 7, exclude: [math]}");
    let (st, _) = env.run("mix.yaml", 0);
    assert_eq!(st["prompts"], "ran");
    let s = mix_stats(&env);
    assert_eq!(s["held_out_rows"], 100, "{s}");
    assert!(s["sources"]["math"].is_null(), "{s}");
    // Every exact copy, and the near copies MinHash flags (as in the dedup test), held out.
    let copies = s["removed"]["held_out_copies"].as_u64().unwrap();
    assert!((18..=20).contains(&copies), "{s}");
    assert_eq!(
        s["sources"]["copies"].as_u64().unwrap_or(0),
        20 - copies,
        "{s}"
    );
    assert!(
        s["composition"]
            .as_str()
            .unwrap()
            .contains("held out: 100 rows"),
        "{s}"
    );

    // Without `exclude`, the same weights take the copies.
    let open = mix_env("{weights: {code: 1, chat: 1, copies: 1}, total: 300, seed: 7}");
    open.run("mix.yaml", 0);
    assert_eq!(mix_stats(&open)["sources"]["copies"], 20);

    // A held-out name that is not an input is refused before anything runs, naming it.
    let bad = mix_env("{weights: {code: 1}, total: 10, exclude: [gsm8k]}");
    let out = bad.dflash(&["run", "mix.yaml"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("param `exclude.0` of `prompts`: `gsm8k` is not an input of this stage"),
        "{stderr}"
    );
    assert!(!stderr.contains("started"), "{stderr}");
}

/// Exact dedup removes a row only because a kept row has its text: rows left out over quota
/// make none of their copies count as duplicates, and `available` counts distinct rows.
#[test]
fn rows_over_quota_make_no_duplicates() {
    let env = Env::new();
    let big: Vec<String> = (0..20)
        .map(|i| format!(r#"{{"id": "b{i}", "prompt": "question number {i} about the weather"}}"#))
        .collect();
    let small: Vec<String> = (0..10)
        .map(|i| format!(r#"{{"id": "s{i}", "prompt": "question number {i} about the weather"}}"#))
        .collect();
    env.write("big.jsonl", &(big.join("\n") + "\n"));
    env.write("small.jsonl", &(small.join("\n") + "\n"));
    env.write(
        "mix.yaml",
        "stages:\n  big: {kind: download, params: {path: big.jsonl}}\n  \
         small: {kind: download, params: {path: small.jsonl}}\n  \
         prompts: {kind: mix, inputs: [big, small], params: {quotas: {big: 1, small: 10}, near_dup: false}}\n",
    );
    let (st, _) = env.run("mix.yaml", 0);
    assert_eq!(st["prompts"], "ran");
    let s = mix_stats(&env);
    assert_eq!(s["sources"]["big"], 1, "{s}");
    // Only the copy of the one kept `big` row can be a duplicate in `small` (before the fix,
    // every `big` row seen before its copy, kept or not, took that copy away: 6 of 10 here).
    assert!(s["sources"]["small"].as_u64().unwrap() >= 9, "{s}");
    for short in s["shortfalls"].as_array().unwrap() {
        assert_eq!(short["available"], 10, "{s}");
    }
}

#[test]
fn a_quota_that_cannot_be_met_fails_when_strict() {
    let env = mix_env("{by: category, quotas: {code: 100, math: 500}, strict: true}");
    let out = env.dflash(&["run", "mix.yaml"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("quotas not met") && stderr.contains("`math` wants 500"),
        "{stderr}"
    );
    assert!(stderr.contains("hint:"), "{stderr}");
}

#[test]
fn a_plain_url_is_pinned_by_etag_and_a_changed_file_reruns() {
    let root = tempfile::tempdir().unwrap();
    let repo = root.path().join("acme/files");
    std::fs::create_dir_all(&repo).unwrap();
    std::fs::copy(assets().join("gsm8k.jsonl"), repo.join("gsm8k.jsonl")).unwrap();
    let hub = Hub::start(root.path(), None, None);
    let env = Env::new();
    let url = format!(
        "{}/datasets/acme/files/resolve/main/gsm8k.jsonl?token=not-shown",
        hub.endpoint()
    );
    env.write(
        "p.yaml",
        &format!("stages:\n  web: {{kind: download, params: {{url: '{url}', category: math}}}}\n"),
    );
    env.run("p.yaml", 0);
    let m = env.show("web", "p.yaml");
    assert_eq!(m["stats"]["rows"], 100);
    let pin = &m["fingerprint"]["pins"][0];
    assert!(
        pin["identity"].as_str().unwrap().starts_with("etag="),
        "{pin}"
    );
    assert!(
        !pin["name"].as_str().unwrap().contains("not-shown"),
        "query strings may hold signed tokens: {pin}"
    );

    // The server's file changes: its ETag does, so the key does.
    let mut text = std::fs::read_to_string(repo.join("gsm8k.jsonl")).unwrap();
    text.push_str("{\"id\": \"extra\", \"prompt\": \"What is 1 + 1?\"}\n");
    std::fs::write(repo.join("gsm8k.jsonl"), text).unwrap();
    let plan = String::from_utf8(env.dflash(&["plan", "p.yaml"]).stdout).unwrap();
    assert!(
        plan.contains("pending") && plan.contains("changed"),
        "{plan}"
    );
    env.run("p.yaml", 0);
    let m = env.show("web", "p.yaml");
    assert_eq!(m["stats"]["rows"], 101);
}

#[test]
fn an_object_store_url_is_read_with_the_environments_credentials() {
    let server = support::Seaweed::start();
    let prefix = server.url();
    let store = dflash::store::Store::open_with(&prefix, &server.options()).unwrap();
    let bytes = std::fs::read(assets().join("mt-bench.jsonl")).unwrap();
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(store.put_create("data/mt-bench.jsonl", bytes.into()))
        .unwrap();
    let mut env = Env::new();
    for (k, v) in server.env() {
        env.set(&k, &v);
    }
    env.write(
        "p.yaml",
        &format!("stages:\n  s3: {{kind: download, params: {{object: '{prefix}/data/mt-bench.jsonl'}}}}\n"),
    );
    let (st, _) = env.run("p.yaml", 0);
    assert_eq!(st["s3"], "ran");
    let m = env.show("s3", "p.yaml");
    assert_eq!(m["stats"]["rows"], 80);
    let pin = m["fingerprint"]["pins"][0].to_string();
    assert!(pin.contains("etag=") && pin.contains("size=48929"), "{pin}");
    assert!(!m.to_string().contains(support::SECRET_KEY));
}
