//! `dflash report RUN -o report.html`: one run as a single self-contained HTML page — the
//! stage graph coloured by status, each stage's timings, key, error and data summaries, and
//! charts where a picture reads faster than numbers: a mix's composition before and after, a
//! training loss curve, tau per method and prompt set. With `--against OTHER`, a first section
//! sets the two runs side by side: which stages produced other artifacts, and each bench's tau
//! per set and method in both. No scripts, no external resources.

mod charts;

use std::fmt::Write as _;

use dflash_stage_train::pace::Window;
use serde_json::Value;

use crate::store::{Manifest, RunRecord, StageResult, Store, StoreError};

/// What the page shows of one stage.
pub struct StageView {
    /// The run record's line.
    pub result: StageResult,
    /// Its manifest, when the stage has an artifact.
    pub manifest: Option<Manifest>,
    /// (step, loss) from a `train` artifact's `metrics.jsonl`.
    pub loss: Vec<(f64, f64)>,
    /// (step, loss on the held-out sequences), where `train` evaluated them.
    pub eval_loss: Vec<(f64, f64)>,
    /// Per block position k = 1, 2, 3: (step, training accuracy there).
    pub accuracy: Vec<Vec<(f64, f64)>>,
    /// (step, held-out accuracy at k = 1), where `train` evaluated.
    pub eval_accuracy: Vec<(f64, f64)>,
    /// (step, held-out tau over anchors drawn anywhere; per decoding round), where `train`
    /// evaluated (the second from train v4's metrics on).
    pub eval_tau: [Vec<(f64, f64)>; 2],
    /// How fast `train` went, window by window (its log's pace lines; wall time is kept out of
    /// the artifact).
    pub pace: Vec<Window>,
}

/// The block positions whose accuracy the report draws.
const ACCURACY_POSITIONS: usize = 3;

/// HTML-escape text for element content and attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Read what the page needs from the store: each stage's manifest and, for `train`, its
/// metrics.
pub async fn gather(store: &Store, run: &RunRecord) -> Result<Vec<StageView>, StoreError> {
    let mut out = Vec::with_capacity(run.stages.len());
    for r in &run.stages {
        let manifest = match &r.key {
            Some(k) => store.manifest(k).await?,
            None => None,
        };
        let (mut loss, mut eval_loss) = (Vec::new(), Vec::new());
        let mut accuracy = vec![Vec::new(); ACCURACY_POSITIONS];
        let mut eval_accuracy = Vec::new();
        let mut eval_tau: [Vec<(f64, f64)>; 2] = Default::default();
        // One evaluation of the held-out sequences at step `s` (before the first step in the
        // stats, then in the metrics lines where `train` scored them).
        let mut held = |e: &Value, s: f64| {
            if let Some(l) = e["loss"].as_f64() {
                eval_loss.push((s, l));
            }
            if let Some(a) = e["accuracy"][0].as_f64() {
                eval_accuracy.push((s, a));
            }
            for (series, key) in eval_tau.iter_mut().zip(["tau", "tau_per_round"]) {
                if let Some(t) = e[key].as_f64() {
                    series.push((s, t));
                }
            }
        };
        if let Some(m) = &manifest
            && m.fingerprint.kind == "train"
            && let Some(f) = m.files.iter().find(|f| f.path == "metrics.jsonl")
        {
            if let Some(start) = m.stats.get("eval").map(|e| &e["start"]) {
                held(start, 0.0);
            }
            let bytes = store.get_blob(&f.digest).await?;
            for line in String::from_utf8_lossy(&bytes).lines() {
                let Ok(v) = serde_json::from_str::<Value>(line) else {
                    continue;
                };
                let Some(s) = v["step"].as_f64() else {
                    continue;
                };
                if let Some(l) = v["loss"].as_f64() {
                    loss.push((s, l));
                }
                for (k, series) in accuracy.iter_mut().enumerate() {
                    if let Some(a) = v["accuracy"][k].as_f64() {
                        series.push((s, a));
                    }
                }
                held(&v["eval"], s);
            }
        }
        // The log is not part of the artifact: without it, no pace, and the page as before.
        let mut pace = Vec::new();
        if let Some(m) = &manifest
            && m.fingerprint.kind == "train"
            && let Some(bytes) = store.stage_log(m).await?
        {
            pace.extend(
                String::from_utf8_lossy(&bytes)
                    .lines()
                    .filter_map(Window::parse),
            );
        }
        out.push(StageView {
            result: r.clone(),
            manifest,
            loss,
            eval_loss,
            accuracy,
            eval_accuracy,
            eval_tau,
            pace,
        });
    }
    Ok(out)
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}\
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}\
table{border-collapse:collapse;font-size:13px}td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:left}\
td.n{text-align:right;font-variant-numeric:tabular-nums}.status{font-weight:600}\
.ran{color:#2e7d32}.resumed{color:#1565c0}.cached{color:#607d8b}.failed{color:#c62828}.skipped{color:#9e9e9e}\
pre{background:#f6f8fa;padding:8px;font-size:12px;overflow-x:auto}.err{color:#c62828}";

/// Another run to set beside the page's.
pub struct Against<'a> {
    /// Its record.
    pub run: &'a RunRecord,
    /// Its stages.
    pub stages: &'a [StageView],
}

/// The page.
pub fn render(run: &RunRecord, stages: &[StageView], against: Option<&Against<'_>>) -> String {
    let mut h = String::new();
    let title = format!("dflash run {} · {}", run.run_id, run.pipeline);
    let _ = write!(
        h,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title><style>{STYLE}</style></head><body>",
        esc(&title)
    );
    let count = |s: &str| {
        stages
            .iter()
            .filter(|v| v.result.status.as_str() == s)
            .count()
    };
    let _ = write!(
        h,
        "<h1>{}</h1><p>pipeline <code>{}</code> · started {} · {:.2} s · ran {} · cached {} · resumed {} · failed {}</p>",
        esc(&title),
        esc(&run.pipeline_path),
        esc(&run.started),
        run.seconds,
        count("ran"),
        count("cached"),
        count("resumed"),
        count("failed"),
    );
    let nodes: Vec<charts::Node<'_>> = stages
        .iter()
        .map(|v| charts::Node {
            id: &v.result.id,
            kind: &v.result.kind,
            status: v.result.status.as_str(),
            seconds: v.result.seconds,
            inputs: v
                .manifest
                .as_ref()
                .map(|m| {
                    m.lineage
                        .inputs
                        .iter()
                        .map(|i| i.stage_id.as_str())
                        .collect()
                })
                .unwrap_or_default(),
        })
        .collect();
    if let Some(other) = against {
        comparison(&mut h, run, stages, other);
    }
    h.push_str(&charts::dag(&nodes));
    h.push_str("<table><tr><th>stage</th><th>kind</th><th>status</th><th>seconds</th><th>key</th><th>files</th><th>bytes</th></tr>");
    for v in stages {
        let r = &v.result;
        let (files, bytes) = v.manifest.as_ref().map_or((0, 0), |m| {
            (m.files.len(), m.files.iter().map(|f| f.size).sum::<u64>())
        });
        let _ = write!(
            h,
            "<tr><td><a href=\"#stage-{id}\">{id}</a></td><td>{kind}</td><td class=\"status {st}\">{st}</td><td class=\"n\">{secs:.2}</td><td><code>{key}</code></td><td class=\"n\">{files}</td><td class=\"n\">{bytes}</td></tr>",
            id = esc(&r.id),
            kind = esc(&r.kind),
            st = r.status.as_str(),
            secs = r.seconds,
            key = r.key.as_ref().map(|k| k.0.short(12)).unwrap_or_default(),
        );
    }
    h.push_str("</table>");
    drafters(&mut h, stages);
    for v in stages {
        stage_section(&mut h, v);
    }
    h.push_str("</body></html>\n");
    h
}

/// With several drafters in the run (a sweep), one table of what each reached on its held-out
/// sequences at its last evaluation, the best tau per decoding round (the figure that predicts
/// `bench`) in bold.
fn drafters(h: &mut String, stages: &[StageView]) {
    let last = |series: &[(f64, f64)]| series.last().map(|&(_, v)| v);
    let rows: Vec<(&StageView, Option<f64>)> = stages
        .iter()
        .filter(|v| v.result.kind == "train" && !v.loss.is_empty())
        .map(|v| (v, last(&v.eval_tau[1])))
        .collect();
    if rows.len() < 2 {
        return;
    }
    let best = rows
        .iter()
        .filter_map(|(_, t)| *t)
        .fold(f64::NEG_INFINITY, f64::max);
    let cell = |x: Option<f64>, digits: usize| {
        x.map_or_else(|| "-".to_owned(), |x| format!("{x:.digits$}"))
    };
    h.push_str("<h2 id=\"drafters\">Drafters compared</h2><p>each drafter's last evaluation on its held-out sequences; tau per decoding round is the figure <code>bench</code> measures</p><table><tr><th>drafter</th><th>steps</th><th>training loss</th><th>held-out loss</th><th>held-out tau over anchors</th><th>held-out tau per decoding round</th></tr>");
    for (v, per_round) in rows {
        let tau = cell(per_round, 3);
        let tau = if per_round == Some(best) {
            format!("<strong>{tau}</strong>")
        } else {
            tau
        };
        let _ = write!(
            h,
            "<tr><td><a href=\"#stage-{id}\">{id}</a></td><td class=\"n\">{steps}</td><td class=\"n\">{loss}</td><td class=\"n\">{eval_loss}</td><td class=\"n\">{anchors}</td><td class=\"n\">{tau}</td></tr>",
            id = esc(&v.result.id),
            steps = v.loss.last().map_or(0.0, |&(s, _)| s),
            loss = cell(last(&v.loss), 3),
            eval_loss = cell(last(&v.eval_loss), 3),
            anchors = cell(last(&v.eval_tau[0]), 3),
        );
    }
    h.push_str("</table>");
}

fn stage_section(h: &mut String, v: &StageView) {
    let r = &v.result;
    let _ = write!(
        h,
        "<h2 id=\"stage-{id}\">{id} <small>({kind}, <span class=\"{st}\">{st}</span>, {secs:.2} s)</small></h2>",
        id = esc(&r.id),
        kind = esc(&r.kind),
        st = r.status.as_str(),
        secs = r.seconds
    );
    if let Some(e) = &r.error {
        let _ = write!(h, "<p class=\"err\">error: {}</p>", esc(e));
        if let Some(hint) = &r.hint {
            let _ = write!(h, "<p>hint: {}</p>", esc(hint));
        }
    }
    let Some(m) = &v.manifest else { return };
    let _ = write!(
        h,
        "<p>key <code>{}</code> · output <code>{}</code> · produced {} on {}</p>",
        m.key.0.short(16),
        m.digest.short(16),
        esc(&m.lineage.started),
        esc(&m.lineage.host)
    );
    // Scalars at the top level of the stats, in a table; nested ones get charts below.
    let scalars: Vec<(&String, &Value)> = m
        .stats
        .iter()
        .filter(|(_, v)| v.is_number() || v.is_string() || v.is_boolean())
        .filter(|(_, v)| v.as_str().is_none_or(|s| !s.contains('\n')))
        .collect();
    if !scalars.is_empty() {
        h.push_str("<table>");
        for (k, val) in scalars {
            let shown = match val {
                Value::String(s) => s.clone(),
                Value::Number(n) => n
                    .as_f64()
                    .filter(|f| f.fract() != 0.0)
                    .map_or_else(|| n.to_string(), |f| format!("{f:.4}")),
                other => other.to_string(),
            };
            let _ = write!(
                h,
                "<tr><td>{}</td><td class=\"n\">{}</td></tr>",
                esc(k),
                esc(&shown)
            );
        }
        h.push_str("</table>");
    }
    match m.fingerprint.kind.as_str() {
        "mix" => mix_charts(h, &m.stats),
        "train" if !v.loss.is_empty() => {
            if v.eval_loss.is_empty() {
                h.push_str("<p>training loss per optimizer step</p>");
            } else {
                h.push_str("<p>training loss per optimizer step, and the loss on the held-out sequences (the <code>eval</code> split) where it was measured</p>");
            }
            h.push_str(&charts::lines(
                &[("training", &v.loss), ("held out", &v.eval_loss)],
                "step",
                "loss",
            ));
            if v.accuracy.iter().any(|a| !a.is_empty()) {
                h.push_str("<p>accuracy per block position (the drafted token equals the target's), per optimizer step</p>");
                let names: Vec<String> =
                    (1..=v.accuracy.len()).map(|k| format!("k = {k}")).collect();
                let mut series: Vec<(&str, &[(f64, f64)])> = names
                    .iter()
                    .zip(&v.accuracy)
                    .map(|(n, a)| (n.as_str(), a.as_slice()))
                    .collect();
                series.push(("k = 1, held out", &v.eval_accuracy));
                h.push_str(&charts::lines(&series, "step", "accuracy"));
            }
            if !v.eval_tau[1].is_empty() {
                h.push_str("<p>tau on the held-out sequences: the mean over anchors drawn anywhere, and per decoding round (the harmonic mean of the acceptance lengths: what a greedy decode of them measures, and what to compare with <code>bench</code>)</p>");
                h.push_str(&charts::lines(
                    &[
                        ("over anchors", &v.eval_tau[0]),
                        ("per decoding round", &v.eval_tau[1]),
                    ],
                    "step",
                    "tau",
                ));
            }
            pace_section(h, &v.pace);
        }
        "bench" => bench_chart(h, &m.stats),
        _ => {}
    }
    if let Some(text) = m.stats.get("composition").and_then(Value::as_str) {
        let _ = write!(h, "<pre>{}</pre>", esc(text));
    }
}

/// How fast training went: over all its windows, then (with several) sequence tokens a second
/// window by window.
fn pace_section(h: &mut String, pace: &[Window]) {
    let steps = |w: &Window| (w.last + 1).saturating_sub(w.first) as f64;
    let seconds: f64 = pace.iter().map(|w| steps(w) * w.seconds_per_step).sum();
    let n: f64 = pace.iter().map(steps).sum();
    if n == 0.0 || seconds <= 0.0 {
        return;
    }
    let tokens: f64 = pace
        .iter()
        .map(|w| w.sequence_tokens_per_second * steps(w) * w.seconds_per_step)
        .sum();
    let _ = write!(
        h,
        "<p>pace: {:.3} s a step, {:.0} sequence tokens a second over {n} steps (training steps only, from the stage's log)</p>",
        seconds / n,
        tokens / seconds
    );
    if pace.len() > 1 {
        let series: Vec<(f64, f64)> = pace
            .iter()
            .map(|w| (w.last as f64, w.sequence_tokens_per_second))
            .collect();
        h.push_str("<p>sequence tokens a second, by window of steps (each point at its window's last step)</p>");
        h.push_str(&charts::lines_from_zero(
            &[("sequence tokens/s", &series)],
            "step",
            "tokens/s",
        ));
    }
}

/// Shares before and after the mix, by source and by category.
fn mix_charts(h: &mut String, stats: &serde_json::Map<String, Value>) {
    for (group, noun) in [("sources", "source"), ("categories", "category")] {
        let (Some(after), Some(before)) = (
            stats.get(group).and_then(Value::as_object),
            stats
                .get("before")
                .and_then(|b| b.get(group))
                .and_then(Value::as_object),
        ) else {
            continue;
        };
        let mut labels: Vec<String> = before.keys().chain(after.keys()).cloned().collect();
        labels.sort();
        labels.dedup();
        let share = |m: &serde_json::Map<String, Value>| -> Vec<f64> {
            let total: f64 = m.values().filter_map(Value::as_f64).sum::<f64>().max(1.0);
            labels
                .iter()
                .map(|l| m.get(l).and_then(Value::as_f64).unwrap_or(0.0) / total)
                .collect()
        };
        let series = [("before", share(before)), ("after", share(after))];
        let _ = write!(h, "<p>share of rows by {noun}, before and after</p>");
        h.push_str(&charts::bars(&labels, &series, &|v| {
            format!("{:.1}%", v * 100.0)
        }));
    }
}

/// Tau per prompt set, one bar per method.
fn bench_chart(h: &mut String, stats: &serde_json::Map<String, Value>) {
    let Some(sets) = stats.get("sets").and_then(Value::as_object) else {
        return;
    };
    let labels: Vec<String> = sets.keys().cloned().collect();
    let mut methods: Vec<String> = Vec::new();
    for s in sets.values() {
        for m in s["methods"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, _)| k)
        {
            if !methods.contains(m) {
                methods.push(m.clone());
            }
        }
    }
    let series: Vec<(&str, Vec<f64>)> = methods
        .iter()
        .map(|m| {
            let v = labels
                .iter()
                .map(|l| sets[l]["methods"][m]["tau"].as_f64().unwrap_or(f64::NAN))
                .collect();
            (m.as_str(), v)
        })
        .collect();
    h.push_str("<p>tau (tokens committed per verification round) by prompt set</p>");
    h.push_str(&charts::bars(&labels, &series, &|v| format!("{v:.2}")));
    // Each method's tau beside the tau at which it would decode as fast as the target alone
    // (its round over the target's step): where the first bar is shorter, it slows decoding.
    let (mut pairs, mut tau, mut even) = (Vec::new(), Vec::new(), Vec::new());
    for (set, v) in sets {
        for (m, r) in v["methods"].as_object().into_iter().flatten() {
            if let (Some(t), Some(b)) = (r["tau"].as_f64(), r["break_even_tau"].as_f64())
                && m != "autoregressive"
            {
                pairs.push(format!("{set} {m}"));
                tau.push(t);
                even.push(b);
            }
        }
    }
    if !pairs.is_empty() {
        h.push_str("<p>tau against break-even tau (a round's time over the target's own step: the tau at which the method decodes as fast as the target alone)</p>");
        h.push_str(&charts::bars(
            &pairs,
            &[("tau", tau), ("break-even tau", even)],
            &|v| format!("{v:.2}"),
        ));
    }
}

/// The two runs side by side: each stage's artifact in both (the same bytes or not), and each
/// bench's tau per set and method in both, with the change.
fn comparison(h: &mut String, run: &RunRecord, stages: &[StageView], other: &Against<'_>) {
    let _ = write!(
        h,
        "<h2 id=\"against\">This run ({}) against run {}</h2><p>that run: pipeline <code>{}</code> · started {} · {:.2} s</p>",
        esc(&run.run_id),
        esc(&other.run.run_id),
        esc(&other.run.pipeline_path),
        esc(&other.run.started),
        other.run.seconds
    );
    h.push_str("<table><tr><th>stage</th><th>this run</th><th>that run</th><th>artifact</th></tr>");
    let theirs = |id: &str| other.stages.iter().find(|v| v.result.id == id);
    for v in stages {
        let r = &v.result;
        let o = theirs(&r.id);
        let same = match (r.digest, o.and_then(|o| o.result.digest)) {
            (Some(a), Some(b)) if a == b => "the same bytes",
            (Some(_), Some(_)) => "differs",
            _ => "-",
        };
        let _ = write!(
            h,
            "<tr><td>{}</td><td class=\"status {st}\">{st}</td><td class=\"status {ot}\">{ot}</td><td>{same}</td></tr>",
            esc(&r.id),
            st = r.status.as_str(),
            ot = o.map_or("absent", |o| o.result.status.as_str()),
        );
    }
    h.push_str("</table>");
    for v in stages.iter().filter(|v| v.result.kind == "bench") {
        let (Some(mine), Some(o)) = (
            v.manifest.as_ref().map(|m| &m.stats),
            theirs(&v.result.id)
                .and_then(|o| o.manifest.as_ref())
                .map(|m| &m.stats),
        ) else {
            continue;
        };
        let Some(sets) = mine.get("sets").and_then(Value::as_object) else {
            continue;
        };
        let _ = write!(
            h,
            "<p>tau of <code>{}</code>, this run against that one</p><table><tr><th>set</th><th>method</th><th>this run</th><th>that run</th><th>change</th></tr>",
            esc(&v.result.id)
        );
        let mut labels = Vec::new();
        let mut this_tau = Vec::new();
        let mut that_tau = Vec::new();
        for (set, s) in sets {
            for (method, m) in s["methods"].as_object().into_iter().flatten() {
                let a = m["tau"].as_f64();
                let b = o["sets"][set]["methods"][method]["tau"].as_f64();
                let shown =
                    |t: Option<f64>| t.map_or_else(|| "-".to_owned(), |t| format!("{t:.2}"));
                let change = match (a, b) {
                    (Some(a), Some(b)) if b > 0.0 => format!("{:+.1}%", (a / b - 1.0) * 100.0),
                    _ => "-".to_owned(),
                };
                let _ = write!(
                    h,
                    "<tr><td>{}</td><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{change}</td></tr>",
                    esc(set),
                    esc(method),
                    shown(a),
                    shown(b)
                );
                labels.push(format!("{set} {method}"));
                this_tau.push(a.unwrap_or(f64::NAN));
                that_tau.push(b.unwrap_or(f64::NAN));
            }
        }
        h.push_str("</table>");
        let series = [("this run", this_tau), ("that run", that_tau)];
        h.push_str(&charts::bars(&labels, &series, &|v| format!("{v:.2}")));
    }
}
