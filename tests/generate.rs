//! End-to-end tests of `generate`: against a fault-injecting OpenAI-compatible server written
//! for the tests (`tests/support/llm_server.py`, a mock) and against the real thing, llama.cpp's
//! server (llama-cpp-python) serving SmolLM2 on 127.0.0.1; `kill -9` in the middle of a run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

mod support;
use support::env::Env;
use support::free_port;
use support::hub::assets;

/// A running `llm_server.py`; killed on drop.
struct Mock {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Mock {
    fn start(dir: &Path, args: &[&str]) -> Self {
        let tag = free_port();
        let port_file = dir.join(format!("mock-{tag}.port"));
        let log = dir.join(format!("mock-{tag}.log"));
        let child = Command::new("python3")
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/llm_server.py"))
            .arg("--port-file")
            .arg(&port_file)
            .arg("--log")
            .arg(&log)
            .args(args)
            .stdout(Stdio::null())
            // Clients hanging up on purpose (timeouts, resets) make it print broken pipes.
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Generous: a deadline only on failure, and Python starts slowly on a loaded 2-core machine.
        let deadline = Instant::now() + Duration::from_secs(120);
        let port = loop {
            if let Ok(p) = std::fs::read_to_string(&port_file) {
                break p.trim().parse().unwrap();
            }
            assert!(Instant::now() < deadline, "the mock server did not start");
            std::thread::sleep(Duration::from_millis(20));
        };
        Self { child, port, log }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    /// Every request it saw.
    fn requests(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

impl Drop for Mock {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `count` one-turn prompts plus one two-turn conversation, as a `download` stage reads them.
fn prompts(env: &Env, count: usize) {
    let mut lines: Vec<String> = (0..count)
        .map(|i| format!(r#"{{"id": "p{i}", "prompt": "prompt number {i}"}}"#))
        .collect();
    lines.push(
        r#"{"id": "multi", "conversations": [{"from": "human", "value": "first question"}, {"from": "gpt", "value": "old answer"}, {"from": "human", "value": "second question"}, {"from": "gpt", "value": "old answer 2"}]}"#
            .into(),
    );
    env.write("prompts.jsonl", &(lines.join("\n") + "\n"));
}

/// `prompts.jsonl` -> a `generate` stage `answers` with `params` (YAML flow or block), plus
/// `more` stages.
fn pipeline_with(params: &str, more: &str) -> String {
    format!(
        "name: gen
stages:
  prompts:
    kind: download
    params: {{path: prompts.jsonl}}
  answers:
    kind: generate
    inputs: [prompts]
    params: {params}
{more}"
    )
}

fn pipeline(endpoints: &[String], extra: &str) -> String {
    let eps: Vec<String> = endpoints.iter().map(|e| format!("'{e}'")).collect();
    pipeline_with(
        &format!(
            "{{model: target, endpoints: [{}], max_in_flight: 4, request_timeout_s: 2, {extra}}}",
            eps.join(", ")
        ),
        "",
    )
}

/// The rows of the `answers` artifact: id -> row.
fn rows(env: &Env) -> BTreeMap<String, Value> {
    let out = env.path().join(format!("export-{}", free_port()));
    let o = env.dflash(&["export", "answers", "-p", "gen.yaml", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let py = Command::new("python3")
        .arg("-c")
        .arg(
            "import sys, os, json, pyarrow as pa\n\
             rows = []\n\
             for f in sorted(os.listdir(sys.argv[1])):\n\
             \x20   if f.endswith('.arrow'):\n\
             \x20       rows += pa.ipc.open_stream(open(os.path.join(sys.argv[1], f), 'rb')).read_all().to_pylist()\n\
             print(json.dumps(rows))",
        )
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        py.status.success(),
        "{}",
        String::from_utf8_lossy(&py.stderr)
    );
    let list: Vec<Value> = serde_json::from_slice(&py.stdout).unwrap();
    let mut by_id = BTreeMap::new();
    for r in list {
        let id = r["id"].as_str().unwrap().to_owned();
        assert!(
            by_id.insert(id.clone(), r).is_none(),
            "row `{id}` is duplicated"
        );
    }
    by_id
}

fn stats(env: &Env) -> Value {
    let o = env.dflash(&["show", "answers", "-p", "gen.yaml"]);
    assert!(o.status.success());
    serde_json::from_slice::<Value>(&o.stdout).unwrap()["stats"].clone()
}

#[test]
fn generates_turn_by_turn_and_a_rerun_sends_nothing() {
    let env = Env::new();
    let mock = Mock::start(env.path(), &[]);
    prompts(&env, 20);
    env.write(
        "gen.yaml",
        &pipeline(&[mock.url()], "thinking: false, seed: 7"),
    );
    let (st, _) = env.run("gen.yaml", 0);
    assert_eq!(st["answers"], "ran");
    let rows = rows(&env);
    assert_eq!(rows.len(), 21);
    assert_eq!(
        rows["p3"]["messages"][1]["content"],
        "echo[1]: prompt number 3"
    );
    // The second turn was generated from the first regenerated answer, not the old one.
    let multi = &rows["multi"]["messages"];
    assert_eq!(multi[1]["content"], "echo[1]: first question");
    assert_eq!(multi[3]["content"], "echo[3]: second question");
    assert_eq!(rows["p0"]["finish_reason"], "stop");
    let sent = mock.requests();
    assert_eq!(sent.len(), 22);
    assert!(
        sent.iter()
            .all(|r| r["kwargs"]["enable_thinking"] == false && r["seed"].is_u64()),
        "thinking mode and per-request seeds reach the server"
    );
    let s = stats(&env);
    assert_eq!(s["finish_reasons"]["stop"], 21);

    let (st, _) = env.run("gen.yaml", 0);
    assert_eq!(st["answers"], "cached");
    assert_eq!(
        mock.requests().len(),
        22,
        "the same pipeline twice sends nothing"
    );
}

#[test]
fn faults_are_retried_and_nothing_is_lost_or_duplicated() {
    for fault in ["burst5xx", "hang", "reset", "malformed"] {
        let env = Env::new();
        let mock = Mock::start(
            env.path(),
            &["--fault", fault, "--every", "4", "--hang", "5"],
        );
        prompts(&env, 24);
        env.write("gen.yaml", &pipeline(&[mock.url()], "attempts: 6"));
        let (st, _) = env.run("gen.yaml", 0);
        assert_eq!(st["answers"], "ran", "{fault}");
        let rows = rows(&env);
        assert_eq!(rows.len(), 25, "{fault}: every prompt answered once");
        assert!(
            rows.values().all(|r| r["finish_reason"] == "stop"),
            "{fault}"
        );
        let failed = mock
            .requests()
            .iter()
            .filter(|r| r["status"] != 200)
            .count();
        assert!(failed > 0, "{fault}: the fault was injected");
        // Errors a live server answers quickly never drain it (it is the only one: draining
        // would leave the work waiting); a hang is a timeout, evidence it may be down.
        let drained = stats(&env)["endpoints"][0]["drained"].as_u64().unwrap();
        if fault != "hang" {
            assert_eq!(drained, 0, "{fault}: a server that answers was drained");
        }
    }
}

#[test]
fn a_dead_endpoint_is_drained_and_its_requests_go_elsewhere() {
    let env2 = Env::new();
    let live = Mock::start(env2.path(), &[]);
    let dying = Mock::start(env2.path(), &["--delay", "0.05"]);
    prompts(&env2, 40);
    env2.write(
        "gen.yaml",
        &pipeline(&[dying.url(), live.url()], "attempts: 8"),
    );
    let mut run = Command::new(env!("CARGO_BIN_EXE_dflash"));
    run.args(["run", "gen.yaml", "--json"])
        .current_dir(env2.path())
        .env("DFLASH_WORK", env2.path().join(".work"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let child = run.spawn().unwrap();
    // Kill one server once it has answered a few requests: its in-flight and later requests
    // must be retried on the other.
    let deadline = Instant::now() + Duration::from_secs(120);
    while dying.requests().len() < 3 {
        assert!(
            Instant::now() < deadline,
            "the dying server got no requests"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(dying);
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let rows = rows(&env2);
    assert_eq!(rows.len(), 41, "every prompt answered exactly once");
    let drained = stats(&env2)["endpoints"][0]["drained"].as_u64().unwrap();
    assert!(drained >= 1, "the dead server was drained");
}

/// A retry never waits out a backoff while another server has room: with one of two servers
/// shedding every request with `Retry-After: 600`, every prompt it refuses is answered by the
/// other in the same run — waiting out the ten minutes would not finish before the guard below.
#[test]
fn a_retry_goes_to_a_server_with_room_instead_of_waiting() {
    let env = Env::new();
    let shedding = Mock::start(env.path(), &["--fault", "shed", "--every", "1"]);
    let live = Mock::start(env.path(), &["--delay", "0.02"]);
    prompts(&env, 30);
    env.write(
        "gen.yaml",
        &pipeline(&[shedding.url(), live.url()], "attempts: 3"),
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(["run", "gen.yaml", "--json"])
        .current_dir(env.path())
        .env("DFLASH_WORK", env.path().join(".work"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // A liveness guard, not a timing: the run takes about a second; a retry that waited for
    // the shedding server would hold it for ten minutes.
    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("retries waited out the shedding server's Retry-After");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success());
    assert_eq!(rows(&env).len(), 31, "every prompt answered");
    let shed = shedding.requests().len();
    assert!(shed > 0, "the shedding server was tried");
    assert_eq!(
        stats(&env)["endpoints"][0]["drained"].as_u64().unwrap(),
        0,
        "a server that answers is not drained"
    );
}

/// `max_in_flight` is per endpoint, and held: with one of two endpoints down, the survivor never
/// holds more requests than its limit, though the stage dispatches for both; and it is kept full.
#[test]
fn max_in_flight_is_held_per_endpoint_when_another_is_down() {
    let env = Env::new();
    let live = Mock::start(env.path(), &["--delay", "0.1"]);
    let down = format!("http://127.0.0.1:{}/v1", free_port());
    prompts(&env, 40);
    env.write("gen.yaml", &pipeline(&[down, live.url()], ""));
    env.run("gen.yaml", 0);
    assert_eq!(rows(&env).len(), 41, "every prompt answered");
    let held: Vec<u64> = live
        .requests()
        .iter()
        .map(|r| r["concurrent"].as_u64().unwrap())
        .collect();
    let most = held.iter().copied().max().unwrap();
    assert!(
        most <= 4,
        "the live server held {most} requests at once; `max_in_flight` is 4"
    );
    assert_eq!(most, 4, "the survivor is kept full: {held:?}");
}

/// What is saved survives a change of how the work is done: after a run is killed, pointing
/// `endpoints` at a replacement server and changing `attempts`, `max_in_flight`,
/// `request_timeout_s` and the shard sizes keeps the key (`plan` says partial, not "never run"),
/// and the rerun sends only what was not saved.
#[test]
fn operational_settings_changed_after_a_kill_resend_nothing_saved() {
    let env = Env::new();
    let first = Mock::start(env.path(), &["--delay", "0.02"]);
    prompts(&env, 300);
    env.write(
        "gen.yaml",
        &pipeline(&[first.url()], "shard_rows: 10, shard_seconds: 0.2"),
    );
    let mut child = env.run_until_shards("gen.yaml", 3);
    signal_run(&child, "-9");
    let _ = child.wait();
    drop(first);
    let replacement = Mock::start(env.path(), &[]);
    env.write(
        "gen.yaml",
        &pipeline_with(
            &format!(
                "{{model: target, endpoints: ['{}'], max_in_flight: 16, request_timeout_s: 30, \
                 attempts: 3, shard_rows: 50, shard_seconds: 5}}",
                replacement.url()
            ),
            "",
        ),
    );
    let plan = env.dflash(&["plan", "gen.yaml"]);
    let text = String::from_utf8_lossy(&plan.stdout);
    let line = text.lines().find(|l| l.contains("answers")).unwrap();
    assert!(line.starts_with("partial"), "{text}");
    env.run("gen.yaml", 0);
    assert_eq!(rows(&env).len(), 301, "every prompt answered once");
    // 302 requests in all (the two-turn conversation takes two); what the shards of ten rows
    // committed before the kill hold is not sent again (a changed key would send all 302).
    let resent = replacement.requests().len();
    assert!(resent <= 302 - 10, "{resent} requests after the change");
}

#[test]
fn a_wrong_model_name_or_no_server_fails_with_a_clear_error() {
    let env = Env::new();
    let mock = Mock::start(env.path(), &["--model", "Qwen/Qwen3-8B"]);
    prompts(&env, 2);
    env.write("gen.yaml", &pipeline(&[mock.url()], ""));
    let out = env.dflash(&["run", "gen.yaml"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("serves `Qwen/Qwen3-8B`, not `target`") && err.contains("set `model:`"),
        "{err}"
    );
    assert!(
        mock.requests().is_empty(),
        "nothing is generated for the wrong model"
    );

    env.write(
        "gen.yaml",
        &pipeline(&[format!("http://127.0.0.1:{}/v1", free_port())], ""),
    );
    let out = env.dflash(&["run", "gen.yaml"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("did not list its models"), "{err}");
}

#[test]
fn refused_prompts_are_saved_as_errors_and_truncation_is_counted() {
    let env = Env::new();
    let mock = Mock::start(env.path(), &["--fault", "refuse"]);
    env.write(
        "prompts.jsonl",
        "{\"id\": \"ok\", \"prompt\": \"short\"}\n{\"id\": \"bad\", \"prompt\": \"REFUSE this\"}\n{\"id\": \"long\", \"prompt\": \"a b c d e f g h i j\"}\n",
    );
    env.write("gen.yaml", &pipeline(&[mock.url()], "max_tokens: 4"));
    env.run("gen.yaml", 0);
    let rows = rows(&env);
    assert_eq!(
        rows["ok"]["messages"][1]["reasoning"], "thinking about short",
        "the server's reasoning_content is kept apart"
    );
    assert_eq!(rows["bad"]["finish_reason"], "error");
    assert!(
        rows["bad"]["metadata"]
            .as_str()
            .unwrap()
            .contains("HTTP 400")
    );
    assert_eq!(rows["long"]["finish_reason"], "length");
    let s = stats(&env);
    assert_eq!(s["finish_reasons"]["error"], 1);
    assert_eq!(s["finish_reasons"]["length"], 1, "{s}");
    assert_eq!(s["finish_reasons"]["stop"], 1, "{s}");
}

/// Send `signal` (`-9`, `-INT`) to a running `dflash run`.
fn signal_run(child: &std::process::Child, signal: &str) {
    let killed = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
}

/// Stop a run mid-generation with `signal`, rerun, and check every prompt is answered once.
fn interrupted_then_resumed(signal: &str) {
    let env = Env::new();
    let mock = Mock::start(env.path(), &["--delay", "0.02"]);
    prompts(&env, 300);
    env.write(
        "gen.yaml",
        &pipeline(&[mock.url()], "shard_rows: 10, shard_seconds: 0.2"),
    );
    let mut child = env.run_until_shards("gen.yaml", 3);
    signal_run(&child, signal);
    let status = child.wait().unwrap();
    assert!(
        !status.success(),
        "{signal}: the run was stopped ({status})"
    );
    let before = mock.requests().len();
    assert!(
        before < 301,
        "{signal}: stopped before the end ({before} requests)"
    );

    let (st, _) = env.run("gen.yaml", 0);
    assert_eq!(
        st["answers"], "resumed",
        "{signal}: the committed shards were kept"
    );
    let rows = rows(&env);
    assert_eq!(rows.len(), 301, "{signal}: every prompt exactly once");
    let resent = mock.requests().len() - before;
    assert!(
        resent < 301,
        "{signal}: the rerun sent only what was not saved ({resent} requests)"
    );
}

#[test]
fn kill_9_mid_generation_then_rerun_answers_every_prompt_exactly_once() {
    interrupted_then_resumed("-KILL");
}

#[test]
fn ctrl_c_mid_generation_saves_what_is_answered_and_a_rerun_sends_the_rest() {
    interrupted_then_resumed("-INT");
}

#[test]
fn launched_servers_share_the_work_and_are_stopped() {
    let env = Env::new();
    prompts(&env, 40);
    let port = free_port();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/llm_server.py");
    let log = env.path().join("launched.log");
    env.write(
        "gen.yaml",
        &pipeline_with(
            &format!(
                "{{model: target, max_in_flight: 2, launch: {{command: 'exec python3 {} --port {{port}} \
                 --delay 0.02 --log {}-{{gpu}}', gpus: [0, 1], port: {port}}}}}",
                script.display(),
                log.display()
            ),
            "",
        ),
    );
    let (st, _) = env.run("gen.yaml", 0);
    assert_eq!(st["answers"], "ran");
    assert_eq!(rows(&env).len(), 41);
    for gpu in 0..2 {
        let n = std::fs::read_to_string(format!("{}-{gpu}", log.display()))
            .unwrap()
            .lines()
            .count();
        assert!(n > 5, "server {gpu} took part ({n} requests)");
    }
    for p in [port, port + 1] {
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", p)).is_err(),
            "server on {p} is stopped"
        );
    }
    let files = stats(&env);
    assert_eq!(files["endpoints"].as_array().unwrap().len(), 2);
    let o = env.dflash(&["show", "answers", "-p", "gen.yaml"]);
    let m: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        m["files"]
            .to_string()
            .contains("_generate/servers/server-1.log"),
        "server logs are kept with the artifact: {}",
        m["files"]
    );
}

#[test]
fn llama_cpp_server_is_a_real_peer() {
    let env = Env::new();
    let server = support::LlamaServer::start(
        &assets().join("SmolLM2-135M-Instruct.Q4_1.gguf"),
        "smollm2",
        &[],
    );
    let port = server.port;
    env.write(
        "prompts.jsonl",
        "{\"id\": \"fr\", \"prompt\": \"What is the capital of France?\"}\n{\"id\": \"count\", \"prompt\": \"Count from one to twenty in words.\"}\n",
    );
    env.write(
        "gen.yaml",
        &pipeline_with(
            &format!(
                "{{model: smollm2, endpoints: ['http://127.0.0.1:{port}/v1'], max_in_flight: 1, \
                 max_tokens: 24, seed: 1}}"
            ),
            "",
        ),
    );
    let (st, _) = env.run("gen.yaml", 0);
    drop(server);
    assert_eq!(st["answers"], "ran");
    let rows = rows(&env);
    let fr = rows["fr"]["messages"][1]["content"].as_str().unwrap();
    assert!(fr.contains("Paris"), "{fr}");
    assert_eq!(
        rows["count"]["finish_reason"], "length",
        "24 tokens cannot count to twenty"
    );
    let s = stats(&env);
    assert!(s["completion_tokens"].as_u64().unwrap() > 24);
}

#[test]
fn the_candle_backend_generates_in_process_and_tokenize_reads_it() {
    let env = Env::new();
    std::os::unix::fs::symlink(
        assets().join("SmolLM2-135M-Instruct.Q4_1.gguf"),
        env.path().join("smollm2.gguf"),
    )
    .unwrap();
    env.write(
        "prompts.jsonl",
        "{\"id\": \"two\", \"conversations\": [{\"from\": \"human\", \"value\": \"Hi! Just say hi back.\"}, {\"from\": \"gpt\", \"value\": \"old\"}, {\"from\": \"human\", \"value\": \"Name a colour.\"}]}\n{\"id\": \"fr\", \"prompt\": \"What is the capital of France?\"}\n{\"id\": \"de\", \"prompt\": \"Germany's capital?\"}\n",
    );
    env.write(
        "gen.yaml",
        &pipeline_with(
            "{backend: candle, model: smollm2.gguf, max_tokens: 12, device: cpu, batch_size: 2}",
            "  tokens:\n    kind: tokenize\n    inputs: [answers]\n    params: {tokenizer: smollm2.gguf}\n",
        ),
    );
    let (st, _) = env.run("gen.yaml", 0);
    assert_eq!(st["tokens"], "ran");
    let rows = rows(&env);
    // The reply answers the question. (How close the candle backend's model is to llama.cpp's
    // is checked logit by logit in `the_target_agrees_with_llama_cpp_position_by_position`.)
    let fr = rows["fr"]["messages"][1]["content"].as_str().unwrap();
    assert!(fr.contains("Paris"), "{fr}");
    let two = &rows["two"]["messages"];
    assert_eq!(
        two.as_array().unwrap().len(),
        4,
        "both turns regenerated: {two}"
    );
    assert_ne!(two[1]["content"], "old");
    let s = stats(&env);
    assert!(s["completion_tokens"].as_u64().unwrap() > 5, "{s}");
    assert_eq!(s["throughput"]["device"], "cpu", "{s}");
    // Waves of two, the longest contexts first: `fr` with `two`'s first turn (`de`'s prompt is
    // the shortest), then `two`'s second turn with `de`, which took `fr`'s place (batches
    // decoded one after another would take three waves).
    assert_eq!(s["waves"]["count"], 2, "{s}");
    assert_eq!(s["waves"]["replies"], 4, "{s}");
    // What the waves cost is counted: every prefill position, the padding among them, the time.
    let (prompt, padded) = (
        s["waves"]["prompt_tokens"].as_u64().unwrap(),
        s["waves"]["padded_tokens"].as_u64().unwrap(),
    );
    assert!(prompt > 0 && padded >= prompt, "{s}");
    assert!(s["waves"]["steps"].as_u64().unwrap() >= 11, "{s}");
    assert!(s["waves"]["prefill_s"].as_f64().unwrap() > 0.0, "{s}");
    // The model file is pinned by content, and its path stays out of the key.
    let o = env.dflash(&["show", "answers", "-p", "gen.yaml"]);
    let m: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(m["fingerprint"]["pins"][0]["name"], "model", "{m}");
    assert!(m["fingerprint"]["params"].get("model").is_none(), "{m}");
    // `dflash estimate` sizes a changed stage from the rate this run measured on this CPU (with
    // `device: auto` it would size it on the GPU of `--gpus`).
    env.write(
        "gen.yaml",
        &std::fs::read_to_string(env.path().join("gen.yaml"))
            .unwrap()
            .replace("max_tokens: 12", "max_tokens: 14"),
    );
    let o = env.dflash(&["estimate", "gen.yaml", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let e: Value = serde_json::from_slice(&o.stdout).unwrap();
    let rate = e["assumptions"]["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "cpu_decode_tokens_per_s")
        .unwrap()
        .clone();
    let key = m["key"].as_str().unwrap();
    assert!(
        rate["source"]
            .as_str()
            .unwrap()
            .starts_with(&format!("measured: generate artifact {}", &key[..12])),
        "{rate}"
    );
    let t = &s["throughput"];
    let measured = t["tokens"].as_f64().unwrap() / t["seconds"].as_f64().unwrap();
    let at_135m = rate["value"].as_f64().unwrap();
    // The table scales to a 135M model; SmolLM2-135M is one, give or take its embeddings.
    assert!(
        (at_135m / measured - 1.0).abs() < 0.2,
        "{at_135m} vs {measured}"
    );
}

#[test]
fn the_expansion_pipeline_validates_and_plan_explains_it() {
    let mut env = Env::new();
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/expand.yaml"),
    )
    .unwrap();
    env.write("expand.yaml", &text);
    // No Hub here: pinning fails fast against a closed port, and plan says so per stage.
    env.set("HF_ENDPOINT", &format!("http://127.0.0.1:{}", free_port()));
    // The target's tokenizer is a local folder: without it, nothing is planned.
    let out = env.dflash(&["plan", "expand.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("`models/Qwen3-8B` does not exist"));
    env.write("models/Qwen3-8B/tokenizer.json", "{}");
    let out = env.dflash(&["plan", "expand.yaml"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan = String::from_utf8_lossy(&out.stdout);
    for (stage, kind) in [
        ("nemotron", "download"),
        ("prompts", "mix"),
        ("completions", "generate"),
        ("tokens", "tokenize"),
    ] {
        assert!(
            plan.lines().any(|l| l.contains(stage) && l.contains(kind)),
            "{plan}"
        );
    }
    assert!(plan.contains("cannot resolve dataset `nvidia/Nemotron-Post-Training-Dataset-v2`"));
    assert!(plan.contains("upstream `prompts` must run first"));
}

#[test]
fn n_samples_per_prompt_get_their_own_rows_and_seeds() {
    let env = Env::new();
    let mock = Mock::start(env.path(), &[]);
    prompts(&env, 3);
    env.write(
        "gen.yaml",
        &pipeline(&[mock.url()], "n: 2, seed: 1, turns: last"),
    );
    env.run("gen.yaml", 0);
    let rows = rows(&env);
    assert_eq!(rows.len(), 8);
    assert!(rows.contains_key("p0-s0") && rows.contains_key("p0-s1"));
    // `turns: last` keeps the earlier turns as they were and regenerates only the last reply.
    let multi = &rows["multi-s0"]["messages"];
    assert_eq!(multi[1]["content"], "old answer");
    assert_eq!(multi[3]["content"], "echo[3]: second question");
    let seeds: std::collections::BTreeSet<String> = mock
        .requests()
        .iter()
        .map(|r| r["seed"].to_string())
        .collect();
    assert_eq!(seeds.len(), 8, "every request has its own seed");
}

/// A Hugging Face folder (config.json, safetensors, tokenizer.json) is the same model as the GGUF
/// it was converted from: the same logits position by position (the folder's query and key rows
/// are in transformers' rotate-half layout, the GGUF's in llama.cpp's interleaved one, so a wrong
/// layout or name mapping shows at once), and the candle backend generates with it, renders
/// with its tokenizer_config.json's template and pins every file by content.
#[test]
fn a_hugging_face_folder_is_the_model_its_gguf_is() {
    let env = Env::new();
    let gguf = assets().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let folder = env.path().join("smollm2");
    support::gguf_to_hf(&gguf, &folder, &[]);
    let cpu = candle_core::Device::Cpu;
    let from_gguf = dflash_model::nn::Target::from_gguf(&gguf, &cpu).unwrap();
    let from_hf = dflash_model::nn::Target::load(&folder, &cpu).unwrap();
    assert_eq!(from_gguf.config, from_hf.config);
    let ids: Vec<u32> = (0..40u32).map(|i| (i * 977 + 13) % 49_152).collect();
    let logits = |t: &dflash_model::nn::Target| {
        let mut cache = dflash_model::nn::target::KvCache::default();
        t.extend(&ids, &mut cache, &[3]).unwrap()
    };
    let ((a, ta), (b, tb)) = (logits(&from_gguf), logits(&from_hf));
    let worst = |x: &candle_core::Tensor, y: &candle_core::Tensor| {
        (x - y)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    let scale = worst(&a, &a.zeros_like().unwrap());
    assert!(
        worst(&a, &b) < 1e-3 * scale,
        "logits differ by {} of {scale}",
        worst(&a, &b)
    );
    let (ta, tb) = (ta.unwrap(), tb.unwrap());
    assert!(worst(&ta, &tb) < 1e-3 * worst(&ta, &ta.zeros_like().unwrap()));

    env.write(
        "prompts.jsonl",
        "{\"id\": \"fr\", \"prompt\": \"What is the capital of France?\"}\n",
    );
    env.write(
        "gen.yaml",
        &pipeline_with(
            "{backend: candle, model: smollm2, max_tokens: 12}",
            "  tokens:\n    kind: tokenize\n    inputs: [answers]\n    params: {tokenizer: smollm2}\n",
        ),
    );
    let (st, _) = env.run("gen.yaml", 0);
    assert_eq!(st["tokens"], "ran");
    let fr = rows(&env)["fr"]["messages"][1]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(fr.contains("Paris"), "{fr}");
    let o = env.dflash(&["show", "answers", "-p", "gen.yaml"]);
    let pins =
        serde_json::from_slice::<Value>(&o.stdout).unwrap()["fingerprint"]["pins"].to_string();
    for file in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(
            pins.contains(&format!("\"model:{file}\"")),
            "{file} is not pinned: {pins}"
        );
    }
}

/// dflash's own model code (what the candle backend, `train` and `bench` run) against llama.cpp
/// on the same GGUF file, teacher-forced over a real text: the next-token choice at each position
/// and the logits. They are not bit-equal: llama.cpp quantizes activations to 8 bits for its
/// dot products, dflash multiplies dequantized weights in f32. A wrong rope, norm or head
/// layout agrees on almost nothing.
#[test]
fn the_target_agrees_with_llama_cpp_position_by_position() {
    let gguf = assets().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let text = "The quick brown fox jumps over the lazy dog. Speculative decoding drafts several \
                tokens with a small model and verifies them with the large one in a single pass, \
                so the output is exactly what the large model would have written.";
    let reference = Command::new("python3")
        .arg("-c")
        .arg(
            "import sys, json\n\
             import numpy as np\n\
             from llama_cpp import Llama\n\
             llm = Llama(model_path=sys.argv[1], verbose=False, n_ctx=512, logits_all=True)\n\
             ids = llm.tokenize(sys.argv[2].encode(), add_bos=False, special=False)\n\
             llm.eval(ids)\n\
             logits = np.array(llm.scores[:len(ids)])\n\
             print(json.dumps({'ids': ids, 'argmax': logits.argmax(-1).tolist(), 'logits': logits[:, :2000].tolist()}))",
        )
        .arg(&gguf)
        .arg(text)
        .output()
        .unwrap();
    assert!(
        reference.status.success(),
        "{}",
        String::from_utf8_lossy(&reference.stderr)
    );
    let r: Value = serde_json::from_slice(&reference.stdout).unwrap();
    let ids: Vec<u32> = r["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let target = dflash_model::nn::Target::from_gguf(&gguf, &candle_core::Device::Cpu).unwrap();
    let mut cache = dflash_model::nn::target::KvCache::default();
    let (logits, _) = target.extend(&ids, &mut cache, &[]).unwrap();
    let ours: Vec<Vec<f32>> = logits.to_vec2().unwrap();
    let theirs = r["argmax"].as_array().unwrap();
    let agree = ours
        .iter()
        .zip(theirs)
        .filter(|(row, t)| {
            let best = row
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0;
            best as u64 == t.as_u64().unwrap()
        })
        .count();
    let share = agree as f64 / ids.len() as f64;
    assert!(
        share >= 0.8,
        "next-token choices agree at {agree} of {} positions",
        ids.len()
    );
    let (mut diff, mut count) = (0f64, 0usize);
    for (row, t) in ours.iter().zip(r["logits"].as_array().unwrap()) {
        for (a, b) in row.iter().zip(t.as_array().unwrap()) {
            diff += (f64::from(*a) - b.as_f64().unwrap()).abs();
            count += 1;
        }
    }
    let mean = diff / count as f64;
    eprintln!(
        "agreement {agree}/{} mean abs logit diff {mean:.4}",
        ids.len()
    );
    assert!(mean < 0.5, "mean absolute logit difference {mean}");
}
