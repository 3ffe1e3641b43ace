//! `dflash report`: a run as one HTML page, checked in a real headless browser (Debian's
//! chromium, installed by `.ci/run`): it renders, draws the stage graph and the charts, and logs
//! no console errors.

use std::path::Path;
use std::process::Command;

mod support;
use support::env::Env;

const PIPELINE: &str = r#"
name: report
stages:
  code:
    kind: download
    params: {path: code.jsonl, format: alpaca, category: code}
  chat:
    kind: download
    params: {path: chat.jsonl, format: sharegpt}
  prompts:
    kind: mix
    inputs: [code, chat]
    params: {by: source, weights: {code: 0.5, chat: 0.5}, total: 20, seed: 0}
  tokens:
    kind: command
    params: {run: "cp train-00000.arrow eval-00000.arrow $DFLASH_OUT/",
             files: [train-00000.arrow, eval-00000.arrow]}
  drafter:
    kind: train
    inputs: [tokens]
    params: {target: tiny.gguf, draft_layers: 1, block_size: 4, anchors: 8, mask_token_id: 63,
             target_layers: [0, 2], epochs: 2, checkpoint_every: 5}
    matrix: {lr: [0.003, 0.01]}
  bench:
    kind: bench
    inputs: [drafter, tokens]
    params: {target: tiny.gguf, prompts: 2, max_new_tokens: 12}
  broken:
    kind: command
    inputs: [prompts]
    params: {run: "echo '<script>alert(1)</script>' >&2; exit 3"}
"#;

/// The quickstart's prompt files and a tiny target with its tokens, in `env`.
fn inputs(env: &Env) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for f in ["code.jsonl", "chat.jsonl"] {
        std::fs::copy(
            root.join("pipelines/quickstart").join(f),
            env.path().join(f),
        )
        .unwrap();
    }
    support::tiny_model(
        env.path(),
        &["tiny.gguf", "train-00000.arrow", "10", "24", "--held", "3"],
    );
}

#[test]
fn a_run_report_renders_in_a_real_browser_without_console_errors() {
    let env = Env::new();
    inputs(&env);
    env.write("p.yaml", PIPELINE);
    let (st, run) = env.run("p.yaml", 1);
    assert_eq!(st["broken"], "failed");
    assert_eq!(st["bench"], "ran");
    let id = run["run_id"].as_str().unwrap();

    let o = env.dflash(&["report", &id[..12], "-o", "report.html"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let html = std::fs::read_to_string(env.path().join("report.html")).unwrap();
    for want in [
        "class=\"dag\"",
        "training loss per optimizer step",
        // The held-out sequences' loss beside training's, with a legend naming both.
        ">held out</text>",
        "accuracy per block position",
        ">k = 1, held out</text>",
        // Held-out tau both ways: over anchors, and per decoding round (what bench measures).
        ">per decoding round</text>",
        "share of rows by source",
        "tau (tokens committed per verification round)",
        // Each method's tau beside the tau at which it would break even.
        ">break-even tau</text>",
        // How fast training went, from the stage's log: overall, and window by window (a
        // checkpoint every 5 steps).
        "sequence tokens a second over ",
        "sequence tokens a second, by window of steps",
        "id=\"stage-broken\"",
        // A sweep's drafters side by side (two, from `matrix:`), the best per-round tau bold.
        "Drafters compared",
        "<a href=\"#stage-drafter@lr=0.01\">drafter@lr=0.01</a>",
        "<strong>",
    ] {
        assert!(html.contains(want), "missing {want}");
    }
    // Text from stages is escaped, never markup.
    assert!(!html.contains("<script"), "unescaped text in the report");
    // `latest` is the same run.
    let o = env.dflash(&["report", "latest", "-o", "latest.html"]);
    assert!(o.status.success());
    assert_eq!(
        std::fs::read_to_string(env.path().join("latest.html")).unwrap(),
        html
    );
    // A copied store holds the stages' logs with the artifacts: the same page.
    let o = env.dflash(&["copy", "--from", "cache", "--to", "copied"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report_from_copy = |name: &str| {
        let o = env.dflash(&["report", &id[..12], "--store", "copied", "-o", name]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        std::fs::read_to_string(env.path().join(name)).unwrap()
    };
    assert!(report_from_copy("copied.html").contains("sequence tokens a second over "));
    // Without a log (a store copied before logs travelled with their artifacts): the page
    // without the pace, not an error.
    for dir in std::fs::read_dir(env.path().join("copied/blobs")).unwrap() {
        for blob in std::fs::read_dir(dir.unwrap().path()).unwrap() {
            let blob = blob.unwrap().path();
            if std::fs::read_to_string(&blob).is_ok_and(|t| t.contains(" sequence tokens/s")) {
                std::fs::remove_file(blob).unwrap();
            }
        }
    }
    let without = report_from_copy("without-logs.html");
    assert!(without.contains("training loss per optimizer step"));
    // `show --log` says so, pointing at the artifact.
    let key = run["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == "drafter@lr=0.01")
        .and_then(|s| s["key"].as_str())
        .unwrap()
        .to_owned();
    let o = env.dflash(&["show", &key[..12], "--store", "copied", "--log"]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("holds no log of `drafter@lr=0.01`") && err.contains(&key[..12]),
        "{err}"
    );
    let o = env.dflash(&["show", &key[..12], "--log"]);
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).contains(" sequence tokens/s"));
    assert!(
        !without.contains("sequence tokens a second"),
        "no log, no pace"
    );

    // The browser: the DOM it built, its console, and a screenshot.
    let url = format!("file://{}", env.path().join("report.html").display());
    let shot = env.path().join("shot.png");
    let browser = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
        ])
        .args([
            "--enable-logging=stderr",
            "--v=0",
            "--window-size=1200,1600",
        ])
        .arg(format!(
            "--user-data-dir={}",
            env.path().join("chromium").display()
        ))
        .arg(format!("--screenshot={}", shot.display()))
        .arg(&url)
        .output()
        .expect("chromium must be installed: `apt-get install chromium`, as .ci/run does");
    let log = String::from_utf8_lossy(&browser.stderr);
    assert!(browser.status.success(), "{log}");
    assert!(
        !log.lines()
            .any(|l| l.contains("CONSOLE") || l.contains("Uncaught")),
        "console messages: {log}"
    );
    assert!(
        std::fs::metadata(&shot).unwrap().len() > 10_000,
        "a blank screenshot"
    );
    let dom = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
        ])
        .arg(format!(
            "--user-data-dir={}",
            env.path().join("chromium").display()
        ))
        .arg("--dump-dom")
        .arg(&url)
        .output()
        .unwrap();
    let dom = String::from_utf8_lossy(&dom.stdout);
    // Eight stages drawn as eight nodes, and the charts.
    assert!(dom.matches("<rect x=").count() >= 8, "{dom}");
    assert!(dom.contains("<polyline"), "no loss curve in the DOM");
}

/// `--against`: two runs of the story side by side — the drafter trained longer, so the train
/// and bench artifacts differ while the mix is the same bytes — and each bench's tau in both.
#[test]
fn a_report_sets_two_runs_side_by_side() {
    let env = Env::new();
    inputs(&env);
    // One drafter (no sweep), no failing stage.
    let pipeline = PIPELINE
        .replace(
            "  broken:\n    kind: command\n    inputs: [prompts]\n    params: {run: \"echo '<script>alert(1)</script>' >&2; exit 3\"}\n",
            "",
        )
        .replace(
            "checkpoint_every: 5}\n    matrix: {lr: [0.003, 0.01]}",
            "checkpoint_every: 5, lr: 0.003}",
        );
    assert!(!pipeline.contains("broken") && !pipeline.contains("matrix"));
    env.write("p.yaml", &pipeline);
    let (_, first) = env.run("p.yaml", 0);
    env.write("q.yaml", &pipeline.replace("epochs: 2", "epochs: 6"));
    let (st, second) = env.run("q.yaml", 0);
    assert_eq!(st["drafter"], "ran");
    assert_eq!(st["prompts"], "cached");
    let (a, b) = (
        second["run_id"].as_str().unwrap(),
        first["run_id"].as_str().unwrap(),
    );
    let o = env.dflash(&["report", a, "--against", b, "-o", "both.html"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let html = std::fs::read_to_string(env.path().join("both.html")).unwrap();
    assert!(
        html.contains(&format!("This run ({a}) against run {b}")),
        "{html}"
    );
    let row = |stage: &str| {
        let at = html
            .find(&format!("<tr><td>{stage}</td>"))
            .unwrap_or_else(|| panic!("no row for {stage}"));
        html[at..at + html[at..].find("</tr>").unwrap()].to_owned()
    };
    assert!(
        row("prompts").contains("the same bytes"),
        "{}",
        row("prompts")
    );
    assert!(row("drafter").contains("differs"), "{}", row("drafter"));
    assert!(html.contains("tau of <code>bench</code>, this run against that one"));
    // Each method's tau in both runs: autoregressive decoding commits one token per round.
    let ar = html
        .find("<td>autoregressive</td>")
        .expect("an autoregressive row");
    assert!(
        html[ar..].starts_with(
            "<td>autoregressive</td><td class=\"n\">1.00</td><td class=\"n\">1.00</td><td class=\"n\">+0.0%</td>"
        ),
        "{}",
        &html[ar..ar + 200]
    );
    // An unknown run is refused, naming it.
    let o = env.dflash(&["report", a, "--against", "nope", "-o", "x.html"]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!env.path().join("x.html").exists());
}
