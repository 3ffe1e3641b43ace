//! End-to-end tests of the `dflash` binary: real processes, a real local store in a temp folder.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::Command;

use serde_json::Value;

mod support;
use support::env::Env;

fn statuses(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
        .collect()
}

const CHAIN: &str = r#"
name: chain
stages:
  a:
    kind: command
    params: {run: "echo alpha > $DFLASH_OUT/a.txt"}
  b:
    kind: command
    inputs: [a]
    params: {run: "tr a-z A-Z < $DFLASH_IN_A/a.txt > $DFLASH_OUT/b.txt", env: {MODE: one}}
  c:
    kind: command
    inputs: [b]
    params: {run: "cat $DFLASH_IN_B/b.txt $DFLASH_IN_B/b.txt > $DFLASH_OUT/c.txt"}
  side:
    kind: command
    params: {run: "echo side > $DFLASH_OUT/s.txt"}
"#;

#[test]
fn second_run_is_all_cached_and_outputs_are_right() {
    let env = Env::new();
    env.write("p.yaml", CHAIN);
    let (first, _) = env.run("p.yaml", 0);
    assert_eq!(
        first,
        statuses(&[("a", "ran"), ("b", "ran"), ("c", "ran"), ("side", "ran")])
    );
    let (second, json) = env.run("p.yaml", 0);
    assert_eq!(
        second,
        statuses(&[
            ("a", "cached"),
            ("b", "cached"),
            ("c", "cached"),
            ("side", "cached")
        ])
    );
    assert!(json["run_id"].as_str().is_some());
    let out = env.dflash(&["export", "c", "-p", "p.yaml", "exported"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(env.path().join("exported/c.txt")).unwrap(),
        "ALPHA\nALPHA\n"
    );
}

#[test]
fn changed_param_reruns_only_the_stage_and_its_dependants_and_plan_says_why() {
    let env = Env::new();
    env.write("p.yaml", CHAIN);
    env.run("p.yaml", 0);
    env.write("p.yaml", &CHAIN.replace("MODE: one", "MODE: two"));
    let plan = env.dflash(&["plan", "p.yaml", "--json"]);
    assert_eq!(plan.status.code(), Some(0));
    let v: Value = serde_json::from_slice(&plan.stdout).unwrap();
    let b = v["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == "b")
        .unwrap();
    assert_eq!(b["state"], "pending");
    assert_eq!(b["reason"], "param `env.MODE`: \"one\" -> \"two\"");
    let (st, _) = env.run("p.yaml", 0);
    // b's output bytes are unchanged by MODE, so c is cut off early and stays cached.
    assert_eq!(
        st,
        statuses(&[
            ("a", "cached"),
            ("b", "ran"),
            ("c", "cached"),
            ("side", "cached")
        ])
    );
    env.write("p.yaml", &CHAIN.replace("echo alpha", "echo beta"));
    let (st, _) = env.run("p.yaml", 0);
    assert_eq!(
        st,
        statuses(&[("a", "ran"), ("b", "ran"), ("c", "ran"), ("side", "cached")])
    );
}

#[test]
fn spelling_out_a_default_keeps_the_key() {
    let env = Env::new();
    env.write("p.yaml", CHAIN);
    let (_, first) = env.run("p.yaml", 0);
    env.write(
        "p.yaml",
        &CHAIN.replace(
            "params: {run: \"echo side > $DFLASH_OUT/s.txt\"}",
            "params: {run: \"echo side > $DFLASH_OUT/s.txt\", env: {}, files: [], pass_env: []}",
        ),
    );
    let (st, second) = env.run("p.yaml", 0);
    assert_eq!(st["side"], "cached");
    assert_eq!(first["stages"][3]["key"], second["stages"][3]["key"]);
}

#[test]
fn keys_are_stable_across_machines() {
    // Golden: a change here invalidates every user's store. Bump the key schema or the kind's version.
    let env = Env::new();
    env.write("p.yaml", CHAIN);
    let (_, v) = env.run("p.yaml", 0);
    assert_eq!(
        v["stages"][0]["key"],
        "bf56886029fefc402559b06a66823c62ea388c667c8f57dcb3230d91deb9f91e"
    );
}

#[test]
fn no_object_is_ever_replaced() {
    let env = Env::new();
    env.write("p.yaml", CHAIN);
    env.run("p.yaml", 0);
    let before = env.objects();
    env.run("p.yaml", 0);
    env.write("p.yaml", &CHAIN.replace("echo alpha", "echo gamma"));
    env.run("p.yaml", 0);
    let after = env.objects();
    for (path, obj) in &before {
        assert_eq!(after.get(path), Some(obj), "{path} was changed or removed");
    }
    assert!(after.len() > before.len());
}

#[test]
fn a_failing_stage_fails_the_run_but_independent_stages_finish() {
    let env = Env::new();
    env.write(
        "p.yaml",
        &CHAIN.replace("echo alpha > $DFLASH_OUT/a.txt", "echo boom >&2; exit 3"),
    );
    let (st, v) = env.run("p.yaml", 1);
    assert_eq!(
        st,
        statuses(&[
            ("a", "failed"),
            ("b", "skipped"),
            ("c", "skipped"),
            ("side", "ran")
        ])
    );
    let err = v["stages"][0]["error"].as_str().unwrap();
    assert!(err.contains("exited with status 3"), "{err}");
    let out = env.dflash(&["run", "p.yaml"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let log = stderr
        .lines()
        .find_map(|l| l.trim().strip_prefix("log: "))
        .expect("log path shown");
    assert!(std::fs::read_to_string(log).unwrap().contains("boom"));
    // Nothing was committed for the failed stage.
    let plan: Value =
        serde_json::from_slice(&env.dflash(&["plan", "p.yaml", "--json"]).stdout).unwrap();
    assert_eq!(plan["stages"][0]["state"], "pending");
    let reason = plan["stages"][0]["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("failed in run ") && reason.contains("exited with status 3"),
        "{reason}"
    );
}

/// A stage of 3 shards whose shard 2 fails until the file `ok` exists; every shard execution is
/// counted in runs.log.
const SHARDED_GEN: &str = r"  gen:
    kind: command
    params:
      shards: 3
      run: 'echo $DFLASH_SHARD >> runs.log; if [ $DFLASH_SHARD = 2 ] && [ ! -f ok ]; then exit 1; fi; echo row$DFLASH_SHARD > $DFLASH_OUT/part$DFLASH_SHARD.txt'
";

#[test]
fn sharded_command_resumes_without_redoing_finished_shards() {
    let env = Env::new();
    env.write("p.yaml", &format!("stages:\n{SHARDED_GEN}"));
    let (st, _) = env.run("p.yaml", 1);
    assert_eq!(st["gen"], "failed");
    let plan: Value =
        serde_json::from_slice(&env.dflash(&["plan", "p.yaml", "--json"]).stdout).unwrap();
    assert_eq!(plan["stages"][0]["state"], "partial");
    env.write("ok", "");
    let (st, _) = env.run("p.yaml", 0);
    assert_eq!(st["gen"], "resumed");
    assert_eq!(
        std::fs::read_to_string(env.path().join("runs.log")).unwrap(),
        "0\n1\n2\n2\n"
    );
    let out = env.dflash(&["export", "gen", "-p", "p.yaml", "x"]);
    assert!(out.status.success());
    for i in 0..3 {
        assert_eq!(
            std::fs::read_to_string(env.path().join(format!("x/part{i}.txt"))).unwrap(),
            format!("row{i}\n")
        );
    }
}

/// `dflash copy`: whole artifacts and the finished shards of a stage in progress go to another
/// store, create-only; what is too large stays behind whole; a run there is cached where the
/// artifacts came and resumes the shards; a second copy writes nothing.
#[test]
fn copy_takes_whole_artifacts_and_finished_shards_and_a_run_there_resumes() {
    let env = Env::new();
    let p = r"
stages:
  small:
    kind: command
    params: {run: 'echo small > $DFLASH_OUT/s.txt'}
  big:
    kind: command
    params: {run: 'head -c 4096 /dev/zero > $DFLASH_OUT/big.bin; echo ok > $DFLASH_OUT/ok.txt'}
";
    env.write("p.yaml", &format!("{p}{SHARDED_GEN}"));
    let (st, _) = env.run_with("p.yaml", &["-j", "1"], 1);
    assert_eq!(
        (st["small"].as_str(), st["big"].as_str(), st["gen"].as_str()),
        ("ran", "ran", "failed")
    );
    let copy = |args: &[&str]| -> Value {
        let mut all = vec!["copy", "--from", "cache", "--to", "other", "--json"];
        all.extend(args);
        let out = env.dflash(&all);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let first = copy(&["--max-file-bytes", "1K"]);
    assert_eq!(first["copied"], serde_json::json!(["small"]));
    assert_eq!(first["too_large"], serde_json::json!(["big"]));
    assert_eq!(first["shards"], 2);
    assert!(first["run_records"].as_u64().unwrap() >= 2);
    let verify = env.dflash(&["verify", "--store", "other"]);
    assert_eq!(verify.status.code(), Some(0));
    // A stage named: its finished shards, which the run record says are `gen`'s, and nothing else.
    let out = env.dflash(&[
        "copy", "--from", "cache", "--to", "only-gen", "--stage", "gen", "--json",
    ]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["copied"].clone(), v["shards"].clone()),
        (serde_json::json!([]), serde_json::json!(2))
    );
    // Copied again: everything is there already, nothing is written or replaced.
    let again = copy(&["--max-file-bytes", "1K"]);
    assert_eq!(again["copied"], serde_json::json!([]));
    assert_eq!(
        (again["already_there"].as_u64(), again["blobs"].as_u64()),
        (Some(1), Some(0))
    );
    // A run on the copy: `small` cached, `big` (left behind) runs, `gen` resumes at shard 2.
    env.write("ok", "");
    let (st, _) = env.run_with("p.yaml", &["--store", "other", "-j", "1"], 0);
    assert_eq!(
        (st["small"].as_str(), st["big"].as_str(), st["gen"].as_str()),
        ("cached", "ran", "resumed")
    );
    assert_eq!(
        std::fs::read_to_string(env.path().join("runs.log")).unwrap(),
        "0\n1\n2\n2\n"
    );
    // Only the stages asked for.
    let out = env.dflash(&[
        "copy", "--from", "other", "--to", "third", "--stage", "gen", "--json",
    ]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["copied"], serde_json::json!(["gen"]));
    // A size that is not one is an error that says how to write it.
    let bad = env.dflash(&[
        "copy",
        "--from",
        "cache",
        "--to",
        "x",
        "--max-file-bytes",
        "4Q",
    ]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown unit `Q`"));
}

/// A file over the store's part size (1 GiB; `DFLASH_BLOB_PART_BYTES` here) is stored as parts
/// and their list, uploaded and handed to the stage below a part at a time: it exports,
/// verifies and copies (part by part, as stored) as a whole file does, byte for byte; a whole
/// file copied into a store of smaller parts is parted there.
#[test]
fn a_file_larger_than_a_part_is_stored_in_parts_and_reads_back_whole() {
    let mut env = Env::new();
    env.write(
        "p.yaml",
        "stages:\n  big:\n    kind: command\n    params: {run: 'seq 1 2000 > $DFLASH_OUT/big.txt'}\n  count:\n    kind: command\n    inputs: {big: big}\n    params: {run: 'wc -l < $DFLASH_IN_BIG/big.txt > $DFLASH_OUT/n.txt'}\n",
    );
    env.set("DFLASH_BLOB_PART_BYTES", "1000");
    env.run("p.yaml", 0);
    let want: String = (1..=2000).map(|i| format!("{i}\n")).collect();
    // Uploaded a part at a time, and handed whole to the stage below.
    let out = env.dflash(&["export", "count", "-p", "p.yaml", "n"]);
    succeeded(&out);
    assert_eq!(
        std::fs::read_to_string(env.path().join("n/n.txt"))
            .unwrap()
            .trim(),
        "2000"
    );
    fn objects(env: &Env, store: &str) -> Vec<String> {
        walk(&env.path().join(store).join("blobs"))
    }
    let parts = objects(&env, "cache");
    assert_eq!(
        parts.iter().filter(|p| p.ends_with(".parts")).count(),
        1,
        "{parts:?}"
    );
    fn exported(env: &Env, store: &str, dir: &str) -> String {
        let out = env.dflash(&["export", "big", "-p", "p.yaml", "--store", store, dir]);
        succeeded(&out);
        std::fs::read_to_string(env.path().join(dir).join("big.txt")).unwrap()
    }
    assert_eq!(exported(&env, "cache", "x"), want);
    assert_eq!(
        env.dflash(&["verify", "--store", "cache"]).status.code(),
        Some(0)
    );
    // Copied part by part (as stored: a store's part size is how it writes, not how it
    // reads); a whole blob into a store of smaller parts is parted there.
    env.set("DFLASH_BLOB_PART_BYTES", "1073741824");
    let out = env.dflash(&["copy", "--from", "cache", "--to", "whole"]);
    succeeded(&out);
    let lists = |store: &str| -> Vec<String> {
        objects(&env, store)
            .into_iter()
            .filter(|p| p.ends_with(".parts"))
            .collect()
    };
    assert_eq!(lists("whole"), lists("cache"));
    let largest = objects(&env, "whole")
        .iter()
        .filter(|p| !p.ends_with(".parts"))
        .map(|p| {
            std::fs::metadata(env.path().join("whole/blobs").join(p))
                .unwrap()
                .len()
        })
        .max();
    assert_eq!(largest, Some(1000));
    assert_eq!(exported(&env, "whole", "y"), want);
    // Run with 1 GiB parts, the file is one object; copied into 700-byte parts, it is parted.
    env.run_with("p.yaml", &["--store", "plain"], 0);
    assert!(!objects(&env, "plain").iter().any(|p| p.ends_with(".parts")));
    env.set("DFLASH_BLOB_PART_BYTES", "700");
    let out = env.dflash(&["copy", "--from", "plain", "--to", "small"]);
    succeeded(&out);
    assert_eq!(
        objects(&env, "small")
            .iter()
            .filter(|p| p.ends_with(".parts"))
            .count(),
        1
    );
    assert_eq!(exported(&env, "small", "z"), want);
    assert_eq!(
        env.dflash(&["verify", "--store", "small"]).status.code(),
        Some(0)
    );
    // A part gone: `verify` names the artifact's file as missing, and export fails.
    let part = objects(&env, "small")
        .into_iter()
        .find(|p| {
            !p.ends_with(".parts")
                && std::fs::metadata(env.path().join("small/blobs").join(p))
                    .unwrap()
                    .len()
                    == 700
        })
        .unwrap();
    std::fs::remove_file(env.path().join("small/blobs").join(&part)).unwrap();
    let v = env.dflash(&["verify", "--store", "small", "--json"]);
    assert_eq!(
        v.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&v.stderr)
    );
    let v: Value = serde_json::from_slice(&v.stdout).unwrap();
    assert_eq!(v["corrupt"][0]["path"], "big.txt");
    assert_eq!(v["corrupt"][0]["problem"], "missing");
}

#[test]
fn command_sees_inputs_by_role_and_files_enter_the_key() {
    let env = Env::new();
    env.write("script.sh", "echo v1");
    let p = r#"
stages:
  up: {kind: command, params: {run: "echo data > $DFLASH_OUT/d.txt"}}
  down:
    kind: command
    inputs: {my-data: up}
    params: {files: [script.sh], run: "sh script.sh > $DFLASH_OUT/o.txt; cat $DFLASH_IN_MY_DATA/d.txt >> $DFLASH_OUT/o.txt"}
"#;
    env.write("p.yaml", p);
    env.run("p.yaml", 0);
    env.write("script.sh", "echo v2");
    let plan: Value =
        serde_json::from_slice(&env.dflash(&["plan", "p.yaml", "--json"]).stdout).unwrap();
    assert!(
        plan["stages"][1]["reason"]
            .as_str()
            .unwrap()
            .starts_with("source `file:script.sh` changed"),
        "{plan}"
    );
    let (st, _) = env.run("p.yaml", 0);
    assert_eq!(st["down"], "ran");
    env.dflash(&["export", "down", "-p", "p.yaml", "x"]);
    assert_eq!(
        std::fs::read_to_string(env.path().join("x/o.txt")).unwrap(),
        "v2\ndata\n"
    );
}

#[test]
fn export_never_writes_over_files() {
    let env = Env::new();
    env.write("p.yaml", CHAIN);
    env.run("p.yaml", 0);
    env.write("x/keep.txt", "mine");
    let out = env.dflash(&["export", "a", "-p", "p.yaml", "x"]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        std::fs::read_to_string(env.path().join("x/keep.txt")).unwrap(),
        "mine"
    );
}

/// `export --files GLOB` copies only the matching files (a trained drafter without its
/// checkpoints); a glob that matches nothing, or is not a glob, is refused before anything is
/// written, naming it and the artifact's files.
#[test]
fn export_takes_only_the_files_asked_for() {
    let env = Env::new();
    env.write(
        "p.yaml",
        "name: t\nstages:\n  trained:\n    kind: command\n    params: {run: \"mkdir -p $DFLASH_OUT/drafter $DFLASH_OUT/ckpt-000200 && echo w > $DFLASH_OUT/drafter/model.safetensors && echo c > $DFLASH_OUT/drafter/config.json && echo m > $DFLASH_OUT/metrics.jsonl && echo t > $DFLASH_OUT/training.json && echo s > $DFLASH_OUT/ckpt-000200/state.safetensors\"}\n",
    );
    env.run("p.yaml", 0);
    let export = |dir: &str, globs: &[&str]| {
        let mut args = vec!["export", "trained", "-p", "p.yaml", dir];
        for g in globs {
            args.extend(["--files", g]);
        }
        env.dflash(&args)
    };
    let out = export("x", &["drafter/*", "*.json*"]);
    succeeded(&out);
    let mut got: Vec<String> = walk(&env.path().join("x"));
    got.sort();
    assert_eq!(
        got,
        [
            "drafter/config.json",
            "drafter/model.safetensors",
            "metrics.jsonl",
            "training.json"
        ]
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("exported 4 files of"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // `*` stays within a folder; `**` crosses them.
    let out = export("y", &["**/*.safetensors"]);
    succeeded(&out);
    let mut got = walk(&env.path().join("y"));
    got.sort();
    assert_eq!(
        got,
        ["ckpt-000200/state.safetensors", "drafter/model.safetensors"]
    );
    for (globs, says) in [
        (
            &["drafter/*", "drafter.json"][..],
            "`--files drafter.json` matches none of the 5 files of",
        ),
        (&["drafter/[x"][..], "`--files drafter/[x` is not a glob"),
    ] {
        let out = export("z", globs);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(says), "{err}");
        assert!(!env.path().join("z").exists());
    }
    let out = export("z", &["drafter.json"]);
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("ckpt-000200/, drafter/, metrics.jsonl, training.json"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Fail with the command's stderr unless it succeeded.
fn succeeded(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every file under `dir` (`support::env::walk`), by its path relative to it.
fn walk(dir: &std::path::Path) -> Vec<String> {
    support::env::walk(dir)
        .iter()
        .map(|p| {
            p.strip_prefix(dir)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/")
        })
        .collect()
}

#[test]
fn only_runs_the_stage_and_what_it_needs() {
    let env = Env::new();
    env.write("p.yaml", CHAIN);
    let out = env.dflash(&["run", "p.yaml", "--only", "b", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let st: Vec<&str> = v["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["status"].as_str().unwrap())
        .collect();
    assert_eq!(st, ["ran", "ran", "skipped", "skipped"]);
    // Not "an upstream stage failed": nothing failed, they were not asked for.
    for s in &v["stages"].as_array().unwrap()[2..] {
        let why = s["error"].as_str().unwrap();
        assert!(why.starts_with("not asked for"), "{why}");
    }
    assert!(out.status.success());
    // Two stages below the selection (c waits on b, which was not asked for either).
    let out = env.dflash(&["run", "p.yaml", "--only", "a", "--json"]);
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let c = &v["stages"].as_array().unwrap()[2];
    assert_eq!(c["id"], "c");
    assert!(
        c["error"].as_str().unwrap().starts_with("not asked for"),
        "{c}"
    );
    assert_eq!(
        env.dflash(&["run", "p.yaml", "--only", "nope"])
            .status
            .code(),
        Some(2)
    );
}

/// `matrix:` makes one stage per combination of its values (`ID@param=value,...`, the first
/// param varying slowest), each keyed by its own params; a list input naming the declaring
/// stage takes them all, in order; `--only` by the declaring id runs them all; adding a value
/// runs only the new stage.
#[test]
fn a_matrix_makes_a_stage_per_combination() {
    let env = Env::new();
    let p = r#"
stages:
  sweep:
    kind: command
    params: {env: {WHAT: x}}
    matrix:
      run: ["echo $WHAT-one > $DFLASH_OUT/v.txt", "echo $WHAT-two > $DFLASH_OUT/v.txt"]
      env: [{WHAT: a}, {WHAT: b}]
  all:
    kind: command
    inputs: [sweep]
    params: {run: "cat $DFLASH_IN_SWEEP_RUN_0_ENV_0/v.txt $DFLASH_IN_SWEEP_RUN_0_ENV_1/v.txt $DFLASH_IN_SWEEP_RUN_1_ENV_0/v.txt $DFLASH_IN_SWEEP_RUN_1_ENV_1/v.txt > $DFLASH_OUT/all.txt"}
"#;
    // `env` is in both: refused, pointing at the matrix's entry.
    let err = errors_of(&env, "both.yaml", p);
    assert!(
        err.contains("param `env` of `sweep` is in both `params` and `matrix`"),
        "{err}"
    );
    let p = p.replace("    params: {env: {WHAT: x}}\n", "");
    env.write("p.yaml", &p);
    let (st, _) = env.run("p.yaml", 0);
    let ids = [
        "sweep@run=0,env=0",
        "sweep@run=0,env=1",
        "sweep@run=1,env=0",
        "sweep@run=1,env=1",
    ];
    for id in ids {
        assert_eq!(st[id], "ran", "{st:?}");
    }
    env.dflash(&["export", "all", "-p", "p.yaml", "out"]);
    assert_eq!(
        std::fs::read_to_string(env.path().join("out/all.txt")).unwrap(),
        "a-one\nb-one\na-two\nb-two\n"
    );
    let m = env.show("all", "p.yaml");
    let inputs: Vec<&str> = m["fingerprint"]["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert_eq!(inputs, ids, "{m}");
    // The declaring id is not an artifact: `show` names the variants instead.
    let out = env.dflash(&["show", "sweep", "-p", "p.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("`sweep` is a matrix of 4 stages") && err.contains("`sweep@run=1,env=0`"),
        "{err}"
    );
    // A third value: only its two stages (and what takes them all) run.
    let p3 = p.replace(
        r#""echo $WHAT-two > $DFLASH_OUT/v.txt"]"#,
        r#""echo $WHAT-two > $DFLASH_OUT/v.txt", "echo $WHAT-three > $DFLASH_OUT/v.txt"]"#,
    );
    env.write("p3.yaml", &p3);
    let out = env.dflash(&["run", "p3.yaml", "--only", "sweep", "--json"]);
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let ran: Vec<&str> = v["stages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["status"] == "ran")
        .map(|s| s["id"].as_str().unwrap())
        .collect();
    assert_eq!(ran, ["sweep@run=2,env=0", "sweep@run=2,env=1"], "{v}");
    // A variant with the same params as a stage beside it has its key: with jobs for both at
    // once, one runs and the other waits for it and is cached (any kind, not only the GPU's).
    env.write(
        "twin.yaml",
        r#"
stages:
  one: {kind: command, params: {run: "sleep 0.3; echo x > $DFLASH_OUT/x.txt"}}
  two:
    kind: command
    matrix: {run: ["sleep 0.3; echo x > $DFLASH_OUT/x.txt", "echo y > $DFLASH_OUT/y.txt"]}
"#,
    );
    let (st, _) = env.run_with("twin.yaml", &["-j", "4"], 0);
    let mut twins = [st["one"].as_str(), st["two@run=0"].as_str()];
    twins.sort_unstable();
    assert_eq!(twins, ["cached", "ran"], "{st:?}");
    // Malformed matrices, each located: an unknown param, an empty list, a role that would
    // take several stages.
    let err = errors_of(
        &env,
        "bad.yaml",
        r#"
stages:
  s:
    kind: command
    matrix: {runn: ["true"], shards: []}
  t:
    kind: command
    matrix: {run: ["true", "false"]}
  u:
    kind: command
    inputs: {mine: t}
    params: {run: "true"}
  v:
    kind: command
    matrix: {shards: [2, 3]}
  w:
    kind: command
    matrix: {run: ["true", "true"]}
"#,
    );
    assert!(
        err.contains("`matrix.run` of `w` lists a value twice"),
        "{err}"
    );
    // What every variant lacks alike is the declaring stage's, said once.
    assert_eq!(
        err.matches("stage `v` (`command`) needs param `run`")
            .count(),
        1,
        "{err}"
    );
    assert!(
        err.contains("has no param `runn`") && err.contains("did you mean `run`?"),
        "{err}"
    );
    assert!(
        err.contains("`matrix.shards` of `s` must be a non-empty list"),
        "{err}"
    );
    assert!(
        err.contains("input `mine` of `u` names `t`, a matrix of 2 stages"),
        "{err}"
    );
}

fn errors_of(env: &Env, name: &str, text: &str) -> String {
    env.write(name, text);
    let out = env.dflash(&["plan", name]);
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
    String::from_utf8(out.stderr).unwrap()
}

#[test]
fn pipeline_errors_are_located_and_reported_together() {
    let env = Env::new();
    let text = "name: bad\nstages:\n  a:\n    kind: comand\n  b:\n    kind: command\n    inputs: [a, nope]\n    params:\n      run: 42\n      shard: 3\n  c:\n    kind: command\n    params: {}\n";
    insta::assert_snapshot!(errors_of(&env, "bad.yaml", text));
}

#[test]
fn cycles_are_shown() {
    let env = Env::new();
    let text = "stages:\n  c: {kind: command, inputs: [d], params: {run: x}}\n  d: {kind: command, inputs: [e], params: {run: x}}\n  e: {kind: command, inputs: [c], params: {run: x}}\n";
    insta::assert_snapshot!(errors_of(&env, "cycle.yaml", text));
}

#[test]
fn syntax_duplicates_and_bombs_are_errors_not_panics() {
    let env = Env::new();
    insta::assert_snapshot!("syntax", errors_of(&env, "syn.yaml", "stages: [\n"));
    insta::assert_snapshot!(
        "duplicate",
        errors_of(
            &env,
            "dup.yaml",
            "stages:\n  a: {kind: command, params: {run: x}}\n  a: {kind: command}\n"
        )
    );
    let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
    for i in 1..12u8 {
        let (name, prev) = ((b'a' + i) as char, (b'a' + i - 1) as char);
        let refs = vec![format!("*{prev}"); 10].join(", ");
        writeln!(bomb, "{name}: &{name} [{refs}]").unwrap();
    }
    bomb.push_str("stages: {}\n");
    let err = errors_of(&env, "bomb.yaml", &bomb);
    assert!(err.contains("dflash::pipeline::too_large"), "{err}");
    env.write("bin.yaml", "");
    std::fs::write(env.path().join("bin.yaml"), b"stages: \xff\xfe\n").unwrap();
    let out = env.dflash(&["plan", "bin.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not UTF-8"));
    let out = env.dflash(&["plan", "missing.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read pipeline `missing.yaml`"));
}

/// Runs a two-stage chain, does `damage` to stage a's blob behind dflash's back, and checks that
/// `verify` reports the file with `problem` and that stage b, reading it, fails saying so
/// instead of feeding bad data downstream.
fn damaged_blob_is_reported(damage: impl FnOnce(&std::path::Path), problem: &str) -> Env {
    let env = Env::new();
    env.write("p.yaml", CHAIN);
    env.run("p.yaml", 0);
    assert_eq!(env.dflash(&["verify"]).status.code(), Some(0));
    let show: Value =
        serde_json::from_slice(&env.dflash(&["show", "a", "-p", "p.yaml"]).stdout).unwrap();
    let digest = show["files"][0]["digest"].as_str().unwrap().to_owned();
    damage(
        &env.path()
            .join("cache/blobs")
            .join(&digest[..2])
            .join(&digest),
    );
    let out = env.dflash(&["verify", "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["corrupt"][0]["path"], "a.txt");
    assert_eq!(v["corrupt"][0]["problem"], problem);
    env.write("p.yaml", &CHAIN.replace("MODE: one", "MODE: three"));
    let (st, v) = env.run("p.yaml", 1);
    assert_eq!(st["b"], "failed");
    let error = v["stages"][1]["error"].as_str().unwrap();
    assert!(error.contains(&format!("is {problem}")), "{error}");
    env
}

#[test]
fn verify_reports_corrupt_objects_and_a_corrupt_input_fails_the_stage() {
    // Bytes changed on disk (as a disk or a careless user might).
    damaged_blob_is_reported(
        |blob| {
            let mut perms = std::fs::metadata(blob).unwrap().permissions();
            #[allow(clippy::permissions_set_readonly_false)]
            perms.set_readonly(false);
            std::fs::set_permissions(blob, perms).unwrap();
            std::fs::write(blob, "tampered\n").unwrap();
        },
        "corrupt",
    );
}

/// A partial copy of a store (a manifest whose blob did not come along) is named as missing,
/// not as corrupt, and a stage that needs the file says which object is missing.
#[test]
fn verify_names_a_missing_blob_and_a_stage_needing_it_fails_saying_so() {
    let env = damaged_blob_is_reported(|blob| std::fs::remove_file(blob).unwrap(), "missing");
    let text = env.dflash(&["verify"]);
    assert!(String::from_utf8_lossy(&text.stdout).starts_with("missing"));
    assert!(String::from_utf8_lossy(&text.stderr).contains("0 corrupt, 1 missing"));
}

#[test]
fn ctrl_c_stops_cleanly_keeping_finished_shards() {
    let env = Env::new();
    // Shard 0 finishes; shard 1 announces itself and then waits far longer than the test.
    let p = r"
stages:
  gen:
    kind: command
    params:
      shards: 2
      run: 'if [ $DFLASH_SHARD = 1 ] && [ ! -f ok ]; then touch started; sleep 300; fi; echo $DFLASH_SHARD > $DFLASH_OUT/p$DFLASH_SHARD.txt'
";
    env.write("p.yaml", p);
    let child = Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(["run", "p.yaml", "--json"])
        .current_dir(env.path())
        .env("DFLASH_WORK", env.path().join(".work"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait for the real event: shard 1 has started (so shard 0 is committed).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !env.path().join("started").exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "shard 1 never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["stages"][0]["error"], "cancelled");
    let plan: Value =
        serde_json::from_slice(&env.dflash(&["plan", "p.yaml", "--json"]).stdout).unwrap();
    assert_eq!(plan["stages"][0]["state"], "partial");
    env.write("ok", "");
    let (st, _) = env.run("p.yaml", 0);
    assert_eq!(st["gen"], "resumed");
}

#[test]
fn lineage_and_diff_explain_what_changed() {
    let env = Env::new();
    env.write("p.yaml", CHAIN);
    let (_, first) = env.run("p.yaml", 0);
    env.write("q.yaml", &CHAIN.replace("echo alpha", "echo beta"));
    let (_, second) = env.run("q.yaml", 0);
    let (ra, rb) = (
        first["run_id"].as_str().unwrap(),
        second["run_id"].as_str().unwrap(),
    );
    let out = env.dflash(&["diff", ra, rb, "--json"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let a = &v["stages"][0];
    assert_eq!(a["change"], "changed");
    assert!(
        a["details"][0]
            .as_str()
            .unwrap()
            .starts_with("param `run`: \"echo alpha"),
        "{a}"
    );
    assert_eq!(v["stages"][3]["change"], "same");
    let b = &v["stages"][1];
    assert!(
        b["details"][0]
            .as_str()
            .unwrap()
            .starts_with("input `a` changed"),
        "{b}"
    );

    let files: Value =
        serde_json::from_slice(&env.dflash(&["diff", "p.yaml", "q.yaml", "--json"]).stdout)
            .unwrap();
    let changes: Vec<&str> = files["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["change"].as_str().unwrap())
        .collect();
    assert_eq!(changes, ["changed", "changed", "changed", "same"]);

    let (ka, kb) = (
        first["stages"][0]["key"].as_str().unwrap(),
        second["stages"][0]["key"].as_str().unwrap(),
    );
    let arts: Value =
        serde_json::from_slice(&env.dflash(&["diff", &ka[..12], &kb[..12], "--json"]).stdout)
            .unwrap();
    assert_eq!(arts["stages"][0]["id"], "a -> a");
    assert!(
        arts["stages"][0]["details"][0]
            .as_str()
            .unwrap()
            .starts_with("param `run`"),
        "{arts}"
    );
    let tree: Value = serde_json::from_slice(
        &env.dflash(&["lineage", "c", "-p", "q.yaml", "--json"])
            .stdout,
    )
    .unwrap();
    assert_eq!(tree["stage"], "c");
    assert_eq!(tree["inputs"][0]["stage"], "b");
    assert_eq!(tree["inputs"][0]["inputs"][0]["stage"], "a");
    let dot = String::from_utf8(
        env.dflash(&["lineage", "c", "-p", "q.yaml", "--dot"])
            .stdout,
    )
    .unwrap();
    assert_eq!(dot.matches(" -> ").count(), 2, "{dot}");
}

const SHARDED: &str = r"
stages:
  gen:
    kind: command
    params:
      shards: 3
      run: 'echo $DFLASH_SHARD >> runs.log; if [ $DFLASH_SHARD = $WAIT ]; then touch started; n=0; while [ ! -f ok ] && [ $n -lt 2400 ]; do sleep 0.05; n=$((n+1)); done; fi; echo row$DFLASH_SHARD > $DFLASH_OUT/p$DFLASH_SHARD.txt'
      pass_env: [WAIT]
  after: {kind: command, inputs: [gen], params: {run: 'cat $DFLASH_IN_GEN/*.txt > $DFLASH_OUT/all.txt'}}
";

/// Start a run whose shard `wait` blocks until `ok` exists (two minutes at most: a shard
/// orphaned by the kill must not outlive the test's folder, looping); SIGKILL dflash once that
/// shard has started; let the orphaned shard go; rerun. Returns the rerun's JSON and the shard
/// log.
fn killed_then_rerun(wait: &str, failpoint: bool) -> (Value, String) {
    let env = Env::new();
    env.write("p.yaml", SHARDED);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dflash"));
    cmd.args(["run", "p.yaml"])
        .current_dir(env.path())
        .env("WAIT", wait)
        .env("DFLASH_WORK", env.path().join(".work"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    if failpoint {
        // The crash comes from inside, right before the manifest is written.
        env.write("ok", "");
        let status = cmd
            .env("DFLASH_FAILPOINT", "before-manifest")
            .status()
            .unwrap();
        assert!(!status.success());
    } else {
        let mut child = cmd.spawn().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !env.path().join("started").exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "the waiting shard never started"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        child.kill().unwrap(); // SIGKILL: no chance to clean up
        child.wait().unwrap();
        env.write("ok", "");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(["run", "p.yaml", "--json"])
        .current_dir(env.path())
        .env("WAIT", wait)
        .env("DFLASH_WORK", env.path().join(".work"))
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    // Same artifacts as an uninterrupted run in a fresh store.
    let fresh = Env::new();
    fresh.write("p.yaml", SHARDED);
    fresh.write("ok", "");
    let w: Value = serde_json::from_slice(
        &Command::new(env!("CARGO_BIN_EXE_dflash"))
            .args(["run", "p.yaml", "--json"])
            .current_dir(fresh.path())
            .env("WAIT", wait)
            .env("DFLASH_WORK", fresh.path().join(".work"))
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    assert_eq!(v["stages"][0]["digest"], w["stages"][0]["digest"]);
    assert_eq!(v["stages"][1]["digest"], w["stages"][1]["digest"]);
    (
        v,
        std::fs::read_to_string(env.path().join("runs.log")).unwrap(),
    )
}

/// A run that crashed before its end record (here right before the manifest) leaves finished
/// shards no run record names: a copy of the whole store takes them, and a run on the copy
/// redoes none of them.
#[test]
fn copy_takes_the_shards_of_a_run_that_crashed_before_its_record() {
    let env = Env::new();
    env.write("p.yaml", SHARDED);
    env.write("ok", "");
    let status = Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(["run", "p.yaml"])
        .current_dir(env.path())
        .env("WAIT", "none")
        .env("DFLASH_WORK", env.path().join(".work"))
        .env("DFLASH_FAILPOINT", "before-manifest")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success());
    let out = env.dflash(&["copy", "--from", "cache", "--to", "other", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["shards"], 3, "{v}");
    let out = Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(["run", "p.yaml", "--json", "--store", "other"])
        .current_dir(env.path())
        .env("WAIT", "none")
        .env("DFLASH_WORK", env.path().join(".work-copy"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["stages"][0]["status"], "resumed");
    let log = std::fs::read_to_string(env.path().join("runs.log")).unwrap();
    assert_eq!(
        (runs_of(&log, "0"), runs_of(&log, "1"), runs_of(&log, "2")),
        (1, 1, 1),
        "{log}"
    );
}

fn runs_of(log: &str, shard: &str) -> usize {
    log.lines().filter(|l| *l == shard).count()
}

#[test]
fn kill_9_before_any_shard_finished() {
    let (v, log) = killed_then_rerun("0", false);
    assert_eq!(v["stages"][0]["status"], "ran");
    assert_eq!(
        (runs_of(&log, "0"), runs_of(&log, "1"), runs_of(&log, "2")),
        (2, 1, 1),
        "{log}"
    );
}

#[test]
fn kill_9_mid_shards_keeps_finished_shards() {
    let (v, log) = killed_then_rerun("1", false);
    assert_eq!(v["stages"][0]["status"], "resumed");
    assert_eq!(
        (runs_of(&log, "0"), runs_of(&log, "1"), runs_of(&log, "2")),
        (1, 2, 1),
        "{log}"
    );
}

#[test]
fn crash_right_before_the_manifest_leaves_nothing_done_and_no_shard_redone() {
    let (v, log) = killed_then_rerun("none", true);
    assert_eq!(v["stages"][0]["status"], "resumed");
    assert_eq!(
        (runs_of(&log, "0"), runs_of(&log, "1"), runs_of(&log, "2")),
        (1, 1, 1),
        "{log}"
    );
}

/// A stand-in for an S3 look-alike that ignores If-None-Match and overwrites (no such server
/// can be installed here, so this one is written in the test): every PUT answers 200.
fn overwriting_s3() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            std::thread::spawn(move || {
                use std::io::{BufRead, BufReader, Read, Write};
                let mut reader = BufReader::new(s.try_clone().unwrap());
                loop {
                    let mut len = 0usize;
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    loop {
                        let mut h = String::new();
                        reader.read_line(&mut h).unwrap();
                        if h == "\r\n" || h.is_empty() {
                            break;
                        }
                        if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                            len = v.trim().parse().unwrap();
                        }
                    }
                    let mut body = vec![0; len];
                    reader.read_exact(&mut body).unwrap();
                    let _ =
                        s.write_all(b"HTTP/1.1 200 OK\r\nETag: \"x\"\r\nContent-Length: 0\r\n\r\n");
                }
            });
        }
    });
    port
}

#[test]
fn a_store_that_overwrites_is_refused() {
    let env = Env::new();
    env.write("p.yaml", CHAIN);
    let port = overwriting_s3();
    // dflash with `args` against the overwriting server, its credentials in the environment.
    let against = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_dflash"))
            .args(args)
            .current_dir(env.path())
            .env("NO_COLOR", "1")
            .env("DFLASH_WORK", env.path().join(".work"))
            .env("AWS_ENDPOINT", format!("http://127.0.0.1:{port}"))
            .env("AWS_ALLOW_HTTP", "true")
            .env("AWS_REGION", "us-east-1")
            .env("AWS_ACCESS_KEY_ID", "AKIATESTKEY")
            .env("AWS_SECRET_ACCESS_KEY", "very-secret-value")
            .output()
            .unwrap()
    };
    let out = against(&["run", "p.yaml", "--store", "s3://bucket/prefix"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("store `s3://bucket/prefix` overwrote an existing object"),
        "{stderr}"
    );
    assert!(stderr.contains("--allow-overwriting-store"), "{stderr}");
    assert!(!stderr.contains("very-secret-value"));
    assert!(!env.path().join(".work/logs").exists(), "no stage ran");
    // A copy into it is refused the same way, before any artifact goes.
    env.run("p.yaml", 0);
    let out = against(&[
        "copy",
        "--from",
        "cache",
        "--to",
        "s3://bucket/prefix",
        "--json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("overwrote an existing object"), "{stderr}");
    assert!(stderr.contains("--allow-overwriting-store"), "{stderr}");
    assert!(out.stdout.is_empty(), "nothing was copied");
}

#[test]
fn independent_stages_run_concurrently() {
    let env = Env::new();
    // Each stage waits (up to 30 s) until the other has started: only a concurrent run passes.
    let p = r"
stages:
  a: {kind: command, params: {run: 'touch a.on; i=0; while [ ! -f b.on ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; [ -f b.on ] && touch $DFLASH_OUT/a'}}
  b: {kind: command, params: {run: 'touch b.on; i=0; while [ ! -f a.on ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; [ -f a.on ] && touch $DFLASH_OUT/b'}}
";
    env.write("p.yaml", p);
    let out = env.dflash(&["run", "p.yaml", "--jobs", "2", "--json"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_ten_thousand_stage_pipeline_plans() {
    let env = Env::new();
    let mut p = String::from("stages:\n");
    for i in 0..10_000 {
        let inputs = if i == 0 {
            String::new()
        } else {
            format!(", inputs: [s{}, s{}]", i - 1, i / 2)
        };
        writeln!(
            p,
            "  s{i}: {{kind: command{inputs}, params: {{run: 'echo {i} > $DFLASH_OUT/o'}}}}"
        )
        .unwrap();
    }
    env.write("big.yaml", &p);
    let out = env.dflash(&["plan", "big.yaml", "--json"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["stages"].as_array().unwrap().len(), 10_000);
    assert_eq!(
        v["stages"][9_999]["reason"],
        "upstream `s9998` must run first"
    );
}

#[test]
fn plan_output_reads_well() {
    let env = Env::new();
    env.write("p.yaml", CHAIN);
    env.run("p.yaml", 0);
    env.write(
        "p.yaml",
        &CHAIN
            .replace("MODE: one", "MODE: two")
            .replace("echo side", "echo other"),
    );
    let out = env.dflash(&["plan", "p.yaml"]);
    assert_eq!(out.status.code(), Some(0));
    insta::assert_snapshot!(String::from_utf8(out.stdout).unwrap());
}

/// What dflash sets for its own CPU matmuls (`RAYON_NUM_THREADS`, see `dflash_model::threads`)
/// stays dflash's: a `command` stage's script gets the environment the user started dflash with
/// (no `RAYON_NUM_THREADS`, no mark saying dflash set it), and a value the user set, theirs.
#[test]
fn commands_get_the_users_thread_setting_not_dflashs() {
    let mut env = Env::new();
    let child_env = |env: &Env, run: &str| -> String {
        env.write(
            "p.yaml",
            &format!("stages:\n  seen:\n    kind: command\n    params: {{run: '{run}'}}\n"),
        );
        let (st, _) = env.run("p.yaml", 0);
        assert_eq!(st["seen"], "ran", "{st:?}");
        let out = env.path().join(format!("out-{}", run.len()));
        let o = env.dflash(&["export", "seen", "-p", "p.yaml", out.to_str().unwrap()]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        std::fs::read_to_string(out.join("env.txt")).unwrap()
    };
    let seen = child_env(&env, "env > $DFLASH_OUT/env.txt");
    assert!(seen.contains("DFLASH_STAGE=seen"), "{seen}");
    assert!(
        !seen.contains("RAYON_NUM_THREADS") && !seen.contains("DFLASH_SETTLED"),
        "{seen}"
    );
    env.set("RAYON_NUM_THREADS", "3");
    let seen = child_env(&env, "env >> $DFLASH_OUT/env.txt");
    assert!(seen.lines().any(|l| l == "RAYON_NUM_THREADS=3"), "{seen}");
    assert!(!seen.contains("DFLASH_SETTLED"), "{seen}");
}
