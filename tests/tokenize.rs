//! End-to-end tests of `tokenize` against the real thing: the real Qwen3 tokenizer and chat
//! template, real conversations (ShareGPT, HumanEval and crafted ones with reasoning, tool
//! calls, non-ASCII text and code), and Python `transformers` as the reference for every token
//! id and every loss-mask bit (`tests/support/tokenize_reference.py`).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

mod support;
use support::env::Env;
use support::hub::assets;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A test folder with the crafted conversations and links to the real model and data files.
fn env_with(pipeline: &str) -> Env {
    let env = Env::new();
    let a = assets();
    for (name, target) in [
        ("qwen3", a.join("qwen3")),
        ("sharegpt.json", a.join("sharegpt.json")),
        ("HumanEval.jsonl.gz", a.join("HumanEval.jsonl.gz")),
        ("smollm2.gguf", a.join("SmolLM2-135M-Instruct.Q4_1.gguf")),
        (
            "conversations.jsonl",
            repo().join("tests/data/conversations.jsonl"),
        ),
    ] {
        std::os::unix::fs::symlink(target, env.path().join(name)).unwrap();
    }
    env.write("tok.yaml", pipeline);
    env
}

const SOURCES: &str = r"
  crafted:
    kind: download
    params: {path: conversations.jsonl, format: messages}
  sharegpt:
    kind: download
    params: {path: sharegpt.json, format: sharegpt, limit: 300}
  humaneval:
    kind: download
    params: {path: HumanEval.jsonl.gz, format: alpaca, fields: {instruction: prompt, output: canonical_solution}, category: code}
";

fn export(env: &Env, stage: &str) -> PathBuf {
    let out = env.path().join(format!("export-{stage}"));
    if out.exists() {
        return out;
    }
    let o = env.dflash(&["export", stage, "-p", "tok.yaml", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

/// Compare a tokenize stage's output with `transformers`; returns the reference's report.
fn reference(env: &Env, stage: &str, kwargs: &str, train_on: &str, reasoning: &str) -> Value {
    reference_for(env, "qwen3", stage, kwargs, train_on, reasoning)
}

/// Compare with the reference for `model` (a folder: `transformers`; a `.gguf`: llama.cpp).
fn reference_for(
    env: &Env,
    model: &str,
    stage: &str,
    kwargs: &str,
    train_on: &str,
    reasoning: &str,
) -> Value {
    let convs: Vec<String> = ["crafted", "sharegpt", "humaneval"]
        .iter()
        .map(|s| export(env, s).display().to_string())
        .collect();
    let tokens = export(env, stage);
    let out = Command::new("python3")
        .arg(repo().join("tests/support/tokenize_reference.py"))
        .arg(env.path().join(model))
        .arg(convs.join(":"))
        .arg(&tokens)
        .args([kwargs, train_on, reasoning])
        .output()
        .unwrap();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| {
        panic!(
            "the reference failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert!(
        out.status.success() && report["mismatches"].as_array().unwrap().is_empty(),
        "dflash and transformers differ: {:#}",
        report["mismatches"]
    );
    report
}

fn count(report: &Value, key: &str) -> u64 {
    report[key].as_u64().unwrap()
}

fn segments(report: &Value, id: &str) -> Vec<String> {
    report["segments"][id]
        .as_array()
        .unwrap_or_else(|| panic!("no row `{id}` in {:#}", report["segments"]))
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn qwen3_tokens_and_masks_equal_transformers_thinking_on_and_off() {
    let env = env_with(&format!(
        "name: tok\nstages:{SOURCES}
  think:
    kind: tokenize
    inputs: [crafted, sharegpt, humaneval]
    params: {{tokenizer: qwen3}}
  nothink:
    kind: tokenize
    inputs: [crafted, sharegpt, humaneval]
    params: {{tokenizer: qwen3, template_kwargs: {{enable_thinking: false}}, train_on: last, reasoning: drop}}
  nothink_all:
    kind: tokenize
    inputs: [crafted, sharegpt, humaneval]
    params: {{tokenizer: qwen3, template_kwargs: {{enable_thinking: false}}}}
"
    ));
    let (status, _) = env.run("tok.yaml", 0);
    assert_eq!(status["think"], "ran");

    let think = reference(&env, "think", "{}", "all", "keep");
    // Every kind of row the issue names was compared, not just the easy ones.
    assert!(count(&think, "compared") > 400, "{think:#}");
    for key in [
        "with_reasoning",
        "with_tool_calls",
        "with_tools",
        "non_ascii",
        "multi_turn",
    ] {
        assert!(count(&think, key) > 0, "no row {key}: {think:#}");
    }
    assert!(
        count(&think, "expected_dropped") >= 1,
        "`prompt-only` at least"
    );

    // What is trained on, read back as text: reasoning of the last turn only (the template
    // drops earlier turns' reasoning), tool calls, the end-of-turn token, trailing spaces kept.
    assert_eq!(
        segments(&think, "three-turns"),
        [
            "b<|im_end|>",
            "d  <|im_end|>",
            "<think>\nlast one\n</think>\n\nf<|im_end|>"
        ]
    );
    let tools = segments(&think, "tools");
    assert_eq!(tools.len(), 2, "{tools:?}");
    assert!(
        tools[0].starts_with(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\""
        ) && tools[0].ends_with("</tool_call><|im_end|>"),
        "{tools:?}"
    );
    assert_eq!(
        segments(&think, "think-multi"),
        [
            "17 × 23 = **391**.<|im_end|>",
            "<think>\n391 / 7 = 55.857...\n</think>\n\nAbout 55.86.<|im_end|>"
        ]
    );

    let nothink = reference(
        &env,
        "nothink",
        r#"{"enable_thinking": false}"#,
        "last",
        "drop",
    );
    // Thinking off: the empty think block belongs to the prompt, so only the answer is trained.
    assert_eq!(segments(&nothink, "three-turns"), ["f<|im_end|>"]);
    assert_eq!(segments(&nothink, "unicode").len(), 1);
    // A reply that thinks, tokenized for thinking off, is flagged: its text does not follow the
    // generation prompt the model will be served with.
    let show = env.dflash(&["show", "nothink", "-p", "tok.yaml"]);
    let stats: Value = serde_json::from_slice(&show.stdout).unwrap();
    let flagged = &stats["stats"]["turns_unlike_generation_prompt_examples"];
    assert!(
        flagged
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v == "inline-think"),
        "{flagged}"
    );
    assert_eq!(count(&nothink, "compared"), count(&think, "compared"));

    // Thinking off, every turn trained: replies that begin like the rest of the generation
    // prompt (`<think>\n\n</think>\n\n`) keep their first characters trained.
    let all = reference(
        &env,
        "nothink_all",
        r#"{"enable_thinking": false}"#,
        "all",
        "keep",
    );
    let angle = segments(&all, "angle-replies");
    for (k, reply) in ["<https://example.com>", "<think", "<", "</", "<t"]
        .iter()
        .enumerate()
    {
        assert_eq!(angle[k], format!("{reply}<|im_end|>"), "{angle:?}");
    }
    assert_eq!(angle.last().unwrap(), "<done><|im_end|>", "{angle:?}");
    // Earlier turns that Qwen3 renders without the empty think block are history, not a
    // mismatch: only a final turn that thinks is flagged.
    let show = env.dflash(&["show", "nothink_all", "-p", "tok.yaml"]);
    let stats: Value = serde_json::from_slice(&show.stdout).unwrap();
    let flagged: Vec<&str> = stats["stats"]["turns_unlike_generation_prompt_examples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(flagged.contains(&"inline-think"), "{flagged:?}");
    for ordinary in ["angle-replies"] {
        assert!(
            !flagged.contains(&ordinary),
            "{ordinary} flagged: {flagged:?}"
        );
    }
}

#[test]
fn token_files_carry_stats_and_hf_datasets_reads_them() {
    let env = env_with(&format!(
        "name: tok\nstages:{SOURCES}
  short:
    kind: tokenize
    inputs: [crafted, humaneval]
    params: {{tokenizer: qwen3, max_length: 64, overflow: drop}}
"
    ));
    env.run("tok.yaml", 0);
    let show = env.dflash(&["show", "short", "-p", "tok.yaml"]);
    assert!(show.status.success());
    let manifest: Value = serde_json::from_slice(&show.stdout).unwrap();
    let stats = &manifest["stats"];
    let reasons = stats["dropped_reasons"].as_object().unwrap();
    assert!(
        reasons["longer than max_length"].as_u64().unwrap() > 100,
        "{stats:#}"
    );
    assert_eq!(reasons["no assistant turn after a prompt"], 1);
    assert!(stats["max_length"].as_u64().unwrap() <= 64);
    let rows = stats["rows"].as_u64().unwrap();
    assert!(rows > 0);

    // Hugging Face `datasets` memory-maps the files as they are.
    let dir = export(&env, "short");
    let out = Command::new("python3")
        .arg("-c")
        .arg(
            "import sys, glob, datasets\n\
             files = sorted(glob.glob(sys.argv[1] + '/*.arrow'))\n\
             ds = datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in files])\n\
             r = ds[0]\n\
             assert len(r['input_ids']) == len(r['loss_mask']) == r['length'], r\n\
             print(len(ds), sorted(ds.column_names))",
        )
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("{rows} ['id', 'input_ids', 'length', 'loss_mask', 'source']")
    );
}

#[test]
fn a_gguf_model_tokenizes_as_llama_cpp_does() {
    // SmolLM2's GGUF holds no tokenizer.json: vocabulary, merges, pre-tokenizer name and chat
    // template come from its metadata; llama.cpp (llama-cpp-python) is the reference.
    let env = env_with(&format!(
        "name: tok\nstages:{SOURCES}
  smol:
    kind: tokenize
    inputs: [crafted, sharegpt, humaneval]
    params: {{tokenizer: smollm2.gguf}}
"
    ));
    env.run("tok.yaml", 0);
    let report = reference_for(&env, "smollm2.gguf", "smol", "{}", "all", "keep");
    assert!(count(&report, "compared") > 400, "{report:#}");
    assert!(count(&report, "non_ascii") > 0);
    assert_eq!(
        segments(&report, "three-turns"),
        ["b<|im_end|>", "d  <|im_end|>", "f<|im_end|>"],
        "SmolLM2's template has no reasoning"
    );
}

/// Texts to tokenize: every message of the crafted, ShareGPT and HumanEval conversations.
fn corpus() -> Vec<String> {
    let env = env_with(&format!("name: tok\nstages:{SOURCES}"));
    env.run("tok.yaml", 0);
    let mut out = Vec::new();
    for stage in ["crafted", "sharegpt", "humaneval"] {
        let dir = export(&env, stage);
        for f in dflash_stage_api::dataset::files(&dir)
            .unwrap()
            .into_values()
            .flatten()
        {
            for row in dflash_stage_api::dataset::read_rows(&f).unwrap() {
                let joined: Vec<&str> = row.messages.iter().map(|m| m.content.as_str()).collect();
                out.push(joined.join("<|im_end|>\n<|im_start|>user\n"));
            }
        }
    }
    out
}

/// Variants of the real Qwen3 tokenizer that exercise every shape the fast path accepts:
/// Llama 3's split with `ignore_merges`, GPT-2's byte-level regex after single digits, and
/// ByteLevel offset trimming.
fn variants() -> Vec<(&'static str, tokenizers::Tokenizer)> {
    let qwen = assets().join("qwen3/tokenizer.json");
    let spec: Value = serde_json::from_slice(&std::fs::read(&qwen).unwrap()).unwrap();
    let with = |f: &dyn Fn(&mut Value)| {
        let mut s = spec.clone();
        f(&mut s);
        s.to_string().parse::<tokenizers::Tokenizer>().unwrap()
    };
    let gguf =
        dflash_stage_tokenize::load_model(&assets().join("SmolLM2-135M-Instruct.Q4_1.gguf"), None)
            .unwrap()
            .tokenizer;
    vec![
        ("qwen3", with(&|_| {})),
        ("smollm2-gguf", gguf),
        (
            "llama3-split+ignore_merges+trim",
            with(&|s| {
                s["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = Value::from(
                    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
                );
                s["model"]["ignore_merges"] = Value::from(true);
                s["post_processor"]["trim_offsets"] = Value::from(true);
            }),
        ),
        (
            "digits+gpt2+trim",
            with(&|s| {
                s["normalizer"] = Value::Null;
                s["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Digits", "individual_digits": true},
                    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]});
                s["post_processor"]["trim_offsets"] = Value::from(true);
            }),
        ),
    ]
}

fn hf(t: &tokenizers::Tokenizer, text: &str) -> (Vec<u32>, Vec<(usize, usize)>) {
    let e = t.encode(text, false).unwrap();
    (e.get_ids().to_vec(), e.get_offsets().to_vec())
}

#[test]
fn the_fast_bpe_path_equals_tokenizers_on_real_text() {
    let texts = corpus();
    assert!(texts.len() > 400);
    for (name, tok) in variants() {
        let enc = dflash_stage_tokenize::Encoder::new(tok.clone(), true);
        assert!(enc.is_fast(), "{name}: the fast path should apply");
        let mut cache = enc.take_cache();
        let mut tokens = 0;
        for text in &texts {
            let want = hf(&tok, text);
            let got = enc.encode(text, &mut cache).unwrap();
            assert_eq!(got.0, want.0, "{name}: ids differ for {text:?}");
            assert_eq!(got.1, want.1, "{name}: offsets differ for {text:?}");
            tokens += want.0.len();
        }
        assert!(tokens > 300_000, "{name}: {tokens} tokens");
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]
    /// Strings built from the characters where splitting rules differ: spaces before words,
    /// runs of spaces and newlines, tabs, digits, apostrophes, CJK, emoji, combining and
    /// non-NFC sequences, and special-token text.
    #[test]
    fn the_fast_bpe_path_equals_tokenizers_on_tricky_strings(
        parts in proptest::collection::vec(proptest::sample::select(vec![
            " ", "  ", "   ", "\n", "\n\n", " \n", "\t", "\r\n", "\u{a0}", "\u{3000}", "a", "Hello",
            "world", "'s", "'LL", "don't", "123", "4567", "٣", "x1y2", "中文", "🦀", "👍🏽", "é",
            "e\u{301}", "Å", "!", "...", "(", "```", "<|im_end|>", "<think>", "</think>", "Ġ",
            "ſ", "İ", "-----", "__init__", "\u{200b}", "\u{4}", "\u{13}x",
        ]), 0..24)
    ) {
        let text: String = parts.concat();
        for (name, tok, enc) in VARIANTS.iter() {
            let mut cache = enc.take_cache();
            let got = enc.encode(&text, &mut cache).unwrap();
            proptest::prop_assert_eq!(got, hf(tok, &text), "{} on {:?}", name, text);
        }
    }
}

type Variant = (
    &'static str,
    tokenizers::Tokenizer,
    dflash_stage_tokenize::Encoder,
);

static VARIANTS: std::sync::LazyLock<Vec<Variant>> = std::sync::LazyLock::new(|| {
    variants()
        .into_iter()
        .map(|(n, t)| {
            let e = dflash_stage_tokenize::Encoder::new(t.clone(), true);
            (n, t, e)
        })
        .collect()
});

#[test]
fn a_model_folder_in_an_object_store_is_pinned_by_etag_and_tokenizes_the_same() {
    let server = support::Seaweed::start();
    let prefix = server.url();
    let store = dflash::store::Store::open_with(&prefix, &server.options()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        let bytes = std::fs::read(assets().join("qwen3").join(f)).unwrap();
        rt.block_on(store.put_create(&format!("models/qwen3/{f}"), bytes.into()))
            .unwrap();
    }
    let mut env = env_with(&format!(
        "name: tok\nstages:
  crafted:
    kind: download
    params: {{path: conversations.jsonl, format: messages}}
  local:
    kind: tokenize
    inputs: [crafted]
    params: {{tokenizer: qwen3}}
  remote:
    kind: tokenize
    inputs: [crafted]
    params: {{tokenizer: '{prefix}/models/qwen3'}}
"
    ));
    for (k, v) in server.env() {
        env.set(&k, &v);
    }
    let (status, _) = env.run("tok.yaml", 0);
    assert_eq!(status["remote"], "ran");
    let show = |stage: &str| -> Value {
        let o = env.dflash(&["show", stage, "-p", "tok.yaml"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let (local, remote) = (show("local"), show("remote"));
    assert_eq!(
        local["files"], remote["files"],
        "the same bytes from either place"
    );
    let pins = remote["fingerprint"]["pins"].to_string();
    assert!(
        pins.contains("tokenizer:tokenizer.json") && pins.contains("etag="),
        "{pins}"
    );
    assert!(!remote.to_string().contains(support::SECRET_KEY));
}

/// Long unbroken text (a markdown table rule, a base64 blob, a run of one character) merges in
/// O(n log n), not by rescanning the word for every merge; the ids and offsets stay those of
/// `tokenizers`. (Its speed is measured in `bench/tokenizer_speed.py long`, not timed here.)
#[test]
fn long_unbroken_words_tokenize_as_tokenizers_does() {
    let mut blob = String::new();
    let mut x: u32 = 7;
    while blob.len() < 6000 {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
        let c = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
            [(x >> 16) as usize % 64];
        blob.push(c as char);
    }
    let texts = [
        "-".repeat(20_000),
        format!("|{}|\n", "-".repeat(3_001)),
        "=".repeat(4_097) + "abc",
        "ab".repeat(2_500),
        "aaaaab".repeat(700),
        blob,
        ".".repeat(999) + " " + &"😀".repeat(300),
    ];
    for (name, tok) in variants() {
        let enc = dflash_stage_tokenize::Encoder::new(tok.clone(), true);
        let mut cache = enc.take_cache();
        for text in &texts {
            let got = enc.encode(text, &mut cache).unwrap();
            let want = hf(&tok, text);
            assert_eq!(got.0, want.0, "{name}: ids differ on {:?}...", &text[..40]);
            assert_eq!(
                got.1,
                want.1,
                "{name}: offsets differ on {:?}...",
                &text[..40]
            );
        }
    }
}
