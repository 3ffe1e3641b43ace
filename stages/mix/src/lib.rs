//! The `mix` stage kind: combine upstream conversation datasets to a chosen balance.
//!
//! Two passes over the inputs keep memory proportional to the output: the first reads each
//! file once and keeps a compact record per row (a sampling priority, a hash of the normalised
//! prompt, near-duplicate band hashes, its group and length: about 80 bytes), the second
//! re-reads only the chosen rows. In between, rows are considered in priority order — a
//! seeded hash of source and id, so the sample is deterministic and uniform within each group —
//! and taken while their group's quota lasts, skipping exact duplicates (normalised text) and
//! near duplicates (MinHash by one-permutation hashing over word 3-grams, 6 bands of 5, which
//! flags pairs above about 0.7 Jaccard similarity) of rows already taken. The composition
//! before and after, what was removed and why, and any quota that could not be met go into the
//! manifest and the stage log.

mod minhash;
mod report;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;

use dflash_stage_api::dataset::{self, BatchView, Conversation, Writer};
use dflash_stage_api::{
    CheckEnv, Issue, Param, ParamType, PathSeg, StageContext, StageError, StageKind, StageOutput,
};
use serde::Deserialize;
use serde_json::json;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::report::Report;

/// The `mix` stage kind.
pub struct MixKind;

#[derive(Deserialize)]
struct Params {
    by: String,
    weights: BTreeMap<String, f64>,
    quotas: BTreeMap<String, i64>,
    total: Option<i64>,
    seed: i64,
    dedup: bool,
    near_dup: bool,
    min_chars: i64,
    max_chars: Option<i64>,
    eval_fraction: f64,
    strict: bool,
    exclude: Vec<String>,
}

/// What pass 1 keeps of a row.
struct Candidate {
    priority: u64,
    text_hash: u64,
    bands: [u64; minhash::BANDS],
    group: u32,
    file: u32,
    row: u32,
    chars: u32,
}

impl StageKind for MixKind {
    fn name(&self) -> &'static str {
        "mix"
    }

    fn version(&self) -> u32 {
        // 2: conversations/2 (tool calls and tool definitions).
        // 3: `exclude` (held-out inputs).
        3
    }

    fn summary(&self) -> &'static str {
        "combine datasets by weights or quotas per source or category; dedup, filter, eval split"
    }

    fn params(&self) -> Vec<Param> {
        let num_map = || ParamType::Map(Box::new(ParamType::Float));
        vec![
            Param::new(
                "by",
                ParamType::Enum(&["source", "category"]),
                "what `weights` and `quotas` are keyed by",
            )
            .default("source"),
            Param::new(
                "weights",
                num_map(),
                "shares of `total` per group (normalised); groups not listed are left out",
            )
            .default(json!({}))
            .at_least(0.0),
            Param::new(
                "quotas",
                ParamType::Map(Box::new(ParamType::Int)),
                "rows per group; groups not listed are left out",
            )
            .default(json!({}))
            .at_least(0.0),
            Param::new(
                "total",
                ParamType::Int,
                "rows wanted in all (with `weights`, or alone for a uniform sample)",
            )
            .at_least(1.0),
            Param::new("seed", ParamType::Int, "the sampling seed").default(0),
            Param::new(
                "dedup",
                ParamType::Bool,
                "drop exact duplicates of the normalised prompt",
            )
            .default(true),
            Param::new(
                "near_dup",
                ParamType::Bool,
                "drop near duplicates (MinHash, about 0.7 Jaccard over word 3-grams)",
            )
            .default(true),
            Param::new(
                "min_chars",
                ParamType::Int,
                "drop rows whose prompt is shorter (characters)",
            )
            .default(1)
            .at_least(0.0),
            Param::new(
                "max_chars",
                ParamType::Int,
                "drop rows whose prompt is longer (characters)",
            )
            .at_least(1.0),
            Param::new(
                "eval_fraction",
                ParamType::Float,
                "this share of each group's rows goes to the `eval` split",
            )
            .default(0.0)
            .within(dflash_stage_api::Bounds {
                low: Some((0.0, true)),
                high: Some((1.0, false)),
            }),
            Param::new(
                "strict",
                ParamType::Bool,
                "fail when a quota can't be met instead of reporting it",
            )
            .default(false),
            Param::new(
                "exclude",
                ParamType::List(Box::new(ParamType::Str)),
                "inputs held out (benchmark sets): none of their rows is taken, and rows whose prompt copies or nearly copies one of theirs are dropped",
            )
            .default(json!([])),
        ]
    }

    fn check(&self, params: &serde_json::Value, env: &CheckEnv<'_>) -> Vec<Issue> {
        let mut issues = Vec::new();
        let weights = params["weights"].as_object().cloned().unwrap_or_default();
        let quotas = params["quotas"].as_object().cloned().unwrap_or_default();
        if !weights.is_empty() && !quotas.is_empty() {
            issues.push(
                Issue::new("quotas", "`weights` and `quotas` are both given")
                    .help("use one: weights are shares of `total`, quotas are row counts"),
            );
        }
        if !weights.is_empty() && params["total"].is_null() {
            issues.push(
                Issue::new("weights", "`weights` need a `total`")
                    .help("say how many rows the mix should have, e.g. `total: 200000`"),
            );
        }
        let sum: f64 = weights.values().filter_map(serde_json::Value::as_f64).sum();
        if !weights.is_empty() && sum <= 0.0 {
            issues.push(
                Issue::new("weights", "every weight is 0, so nothing would be taken")
                    .help("give at least one group a positive share"),
            );
        }
        if let (Some(lo), Some(hi)) = (params["min_chars"].as_u64(), params["max_chars"].as_u64())
            && hi < lo
        {
            issues.push(
                Issue::new(
                    "max_chars",
                    format!("{hi} is below `min_chars` ({lo}): every row would be dropped"),
                )
                .help("`max_chars` must be at least `min_chars`"),
            );
        }
        let excluded: Vec<&str> = params["exclude"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(serde_json::Value::as_str)
            .collect();
        for (i, name) in excluded.iter().enumerate() {
            if !env.inputs.contains(name) {
                issues.push(
                    Issue::new("exclude", format!("`{name}` is not an input of this stage"))
                        .below(PathSeg::Index(i))
                        .help("list the held-out sets among `inputs:` too, so their prompts can be matched"),
                );
            }
        }
        if !env.inputs.is_empty() && env.inputs.iter().all(|i| excluded.contains(i)) {
            issues.push(
                Issue::new("exclude", "every input is held out: nothing is left to mix")
                    .help("hold out the benchmark sets only, and mix the training data"),
            );
        }
        issues
    }

    fn run(&self, ctx: &StageContext<'_>) -> Result<StageOutput, StageError> {
        let p: Params = ctx.params()?;
        if !p.weights.is_empty() && !p.quotas.is_empty() {
            return Err(StageError::new("`weights` and `quotas` are both given")
                .with_help("use one: weights need `total`, quotas are row counts"));
        }
        if !p.weights.is_empty() && p.total.is_none() {
            return Err(StageError::new("`weights` need a `total`")
                .with_help("say how many rows the mix should have, e.g. `total: 200000`"));
        }
        if !(0.0..1.0).contains(&p.eval_fraction) {
            return Err(StageError::new(format!(
                "`eval_fraction` is {}; it must be in [0, 1)",
                p.eval_fraction
            )));
        }
        if let Some(bad) = p
            .exclude
            .iter()
            .find(|e| !ctx.inputs.iter().any(|i| &i.name == *e))
        {
            return Err(StageError::new(format!(
                "`exclude` names `{bad}`, which is not an input of this stage"
            ))
            .with_help(
                "list the held-out sets among `inputs:` too, so their prompts can be matched",
            ));
        }
        // Each file, and whether its input is held out.
        let mut files: Vec<PathBuf> = Vec::new();
        let mut held_out_file: Vec<bool> = Vec::new();
        for input in ctx.inputs {
            let held = p.exclude.contains(&input.name);
            for f in dataset::files(&input.dir)?.into_values().flatten() {
                files.push(f);
                held_out_file.push(held);
            }
        }
        if files.is_empty() {
            return Err(StageError::new("the inputs hold no conversation datasets")
                .with_help("mix takes `download` (or other dataset) stages as inputs"));
        }

        // Pass 1: compact records.
        let mut report = Report::default();
        let mut groups: Vec<String> = Vec::new();
        let mut group_ids: HashMap<String, u32> = HashMap::new();
        let mut cands: Vec<Candidate> = Vec::new();
        // The held-out prompts' text hashes and near-duplicate bands.
        let mut held_text: HashSet<u64> = HashSet::new();
        let mut held_bands: HashSet<(usize, u64)> = HashSet::new();
        let seed = p.seed as u64;
        for (fi, path) in files.iter().enumerate() {
            let mut row_base = 0u32;
            for batch in dataset::read_batches(path)? {
                let v = BatchView::new(&batch);
                for i in 0..v.len() {
                    let source = v.source.value(i);
                    let category = v.category_of(i);
                    let prompt = prompt_text(&v, i);
                    if held_out_file[fi] {
                        let normal = normalise(&prompt);
                        held_text.insert(xxh3_64(normal.as_bytes()));
                        if p.near_dup {
                            for (b, h) in minhash::bands(&normal).into_iter().enumerate() {
                                held_bands.insert((b, h));
                            }
                        }
                        report.held_out_rows += 1;
                        continue;
                    }
                    let chars = prompt.chars().count();
                    report.before.add(source, category, chars);
                    let reason = if prompt.trim().is_empty() {
                        Some("empty prompt")
                    } else if chars < p.min_chars.max(0) as usize {
                        Some("shorter than min_chars")
                    } else if p.max_chars.is_some_and(|m| chars > m.max(0) as usize) {
                        Some("longer than max_chars")
                    } else {
                        None
                    };
                    if let Some(r) = reason {
                        *report.filtered.entry(r.into()).or_default() += 1;
                        continue;
                    }
                    let key = if p.by == "category" {
                        category.unwrap_or("(none)")
                    } else {
                        source
                    };
                    let next = groups.len() as u32;
                    let group = *group_ids.entry(key.to_owned()).or_insert_with(|| {
                        groups.push(key.to_owned());
                        next
                    });
                    let normal = normalise(&prompt);
                    let mut id_key = Vec::with_capacity(source.len() + v.id.value(i).len() + 1);
                    id_key.extend_from_slice(source.as_bytes());
                    id_key.push(0);
                    id_key.extend_from_slice(v.id.value(i).as_bytes());
                    cands.push(Candidate {
                        priority: xxh3_64_with_seed(&id_key, seed),
                        text_hash: xxh3_64(normal.as_bytes()),
                        bands: if p.near_dup {
                            minhash::bands(&normal)
                        } else {
                            [0; minhash::BANDS]
                        },
                        group,
                        file: fi as u32,
                        row: row_base + i as u32,
                        chars: chars as u32,
                    });
                }
                row_base += v.len() as u32;
                if ctx.cancel.is_cancelled() {
                    return Err(StageError::cancelled());
                }
            }
            ctx.progress
                .set(fi as u64 + 1, Some(files.len() as u64 * 2), "reading");
        }

        // Quotas per group (None: unlimited).
        // What a group could give: its rows, less exact copies of each other when deduplicating.
        let available: Vec<u64> = {
            let mut a = vec![0u64; groups.len()];
            let mut distinct: HashSet<(u32, u64)> = HashSet::new();
            for c in &cands {
                if !p.dedup || distinct.insert((c.group, c.text_hash)) {
                    a[c.group as usize] += 1;
                }
            }
            a
        };
        let quota: Vec<Option<u64>> = groups
            .iter()
            .map(|g| {
                if !p.quotas.is_empty() {
                    Some(p.quotas.get(g).map_or(0, |&q| q.max(0) as u64))
                } else if !p.weights.is_empty() {
                    let sum: f64 = p.weights.values().sum();
                    let w = p.weights.get(g).copied().unwrap_or(0.0);
                    Some((p.total.unwrap_or(0) as f64 * w / sum).round() as u64)
                } else {
                    None
                }
            })
            .collect();
        for name in p.weights.keys().chain(p.quotas.keys()) {
            if !group_ids.contains_key(name) {
                report.unknown_groups.push(name.clone());
            }
        }

        // Selection in priority order.
        cands.sort_unstable_by_key(|c| (c.priority, c.file, c.row));
        let mut taken = vec![0u64; groups.len()];
        let mut seen_text: HashSet<u64> = HashSet::new();
        let mut seen_bands: HashSet<(usize, u64)> = HashSet::new();
        let uniform_cap = if p.weights.is_empty() && p.quotas.is_empty() {
            p.total.map(|t| t.max(0) as u64)
        } else {
            None
        };
        let mut total_taken = 0u64;
        let mut chosen: Vec<(u32, u32, u64, u32)> = Vec::new(); // file, row, priority, group
        for c in &cands {
            let g = c.group as usize;
            if quota[g] == Some(0) {
                report.not_listed += 1;
                continue;
            }
            // A copy of a held-out prompt, exact or near, whatever `dedup` says.
            if held_text.contains(&c.text_hash)
                || (p.near_dup
                    && c.bands
                        .iter()
                        .enumerate()
                        .any(|(b, h)| held_bands.contains(&(b, *h))))
            {
                report.held_out_copies += 1;
                continue;
            }
            // A duplicate only of a row kept: a row left out (over quota) makes no copy of it
            // count as one.
            if p.dedup && seen_text.contains(&c.text_hash) {
                report.exact_dups += 1;
                continue;
            }
            if p.near_dup
                && c.bands
                    .iter()
                    .enumerate()
                    .any(|(b, h)| seen_bands.contains(&(b, *h)))
            {
                report.near_dups += 1;
                continue;
            }
            if quota[g].is_some_and(|q| taken[g] >= q)
                || uniform_cap.is_some_and(|t| total_taken >= t)
            {
                report.over_quota += 1;
                continue;
            }
            if p.dedup {
                seen_text.insert(c.text_hash);
            }
            if p.near_dup {
                for (b, h) in c.bands.iter().enumerate() {
                    seen_bands.insert((b, *h));
                }
            }
            taken[g] += 1;
            total_taken += 1;
            report.after_chars.push(c.chars);
            chosen.push((c.file, c.row, c.priority, c.group));
        }
        drop(cands);
        for (g, name) in groups.iter().enumerate() {
            if let Some(q) = quota[g]
                && q > 0
                && taken[g] < q
            {
                report.shortfalls.push(json!({"group": name, "quota": q, "taken": taken[g], "available": available[g]}));
            }
        }
        if p.strict && !report.shortfalls.is_empty() {
            return Err(StageError::new(format!("quotas not met: {}", report.shortfall_text())).with_help("lower the quota, add data for that group, or drop `strict: true` to accept the shortfall"));
        }
        if total_taken == 0 {
            return Err(
                StageError::new("the mix is empty: no row was taken").with_help(format!(
                    "groups by {} in the inputs: {}; `weights`/`quotas` must name some of them",
                    p.by,
                    groups.join(", ")
                )),
            );
        }

        // Eval split: the first `eval_fraction` of each group's rows in priority order.
        let mut eval_left: Vec<u64> = taken
            .iter()
            .map(|&t| (t as f64 * p.eval_fraction).round() as u64)
            .collect();
        let mut split_of: HashMap<(u32, u32), (u64, bool)> = HashMap::with_capacity(chosen.len());
        for &(f, r, prio, g) in &chosen {
            let eval = eval_left[g as usize] > 0;
            if eval {
                eval_left[g as usize] -= 1;
            }
            split_of.insert((f, r), (prio, eval));
        }
        drop(chosen);

        // Pass 2: the chosen rows, in priority order (a deterministic shuffle).
        let mut rows: Vec<(u64, bool, Conversation)> = Vec::with_capacity(split_of.len());
        for (fi, path) in files.iter().enumerate() {
            let mut row_base = 0u32;
            for batch in dataset::read_batches(path)? {
                let v = BatchView::new(&batch);
                for i in 0..v.len() {
                    if let Some(&(prio, eval)) = split_of.get(&(fi as u32, row_base + i as u32)) {
                        rows.push((prio, eval, v.row(i)));
                    }
                }
                row_base += v.len() as u32;
            }
            ctx.progress.set(
                (files.len() + fi + 1) as u64,
                Some(files.len() as u64 * 2),
                "writing",
            );
        }
        rows.sort_by(|(pa, _, a), (pb, _, b)| (pa, &a.source, &a.id).cmp(&(pb, &b.source, &b.id)));
        let mut counts = BTreeMap::new();
        for (split, want_eval) in [("train", false), ("eval", true)] {
            let mut part = 0;
            let mut writer: Option<Writer> = None;
            let mut n = 0u64;
            for (_, _, row) in rows.iter().filter(|(_, e, _)| *e == want_eval) {
                if writer
                    .as_ref()
                    .is_some_and(|w| w.rows() as usize >= dataset::ROWS_PER_FILE)
                {
                    writer.take().expect("open").finish()?;
                    part += 1;
                }
                if writer.is_none() {
                    writer = Some(Writer::create(
                        &ctx.out_dir.join(dataset::file_name(split, part)),
                    )?);
                }
                report.after.add(&row.source, row.category.as_deref(), 0);
                writer.as_mut().expect("open").push(row.clone())?;
                n += 1;
            }
            if let Some(w) = writer {
                w.finish()?;
            }
            counts.insert(split, n);
        }
        let text = report.render(&p.by, &counts);
        std::fs::write(ctx.log_path, &text)?;
        let mut stats = report.stats(&counts);
        stats.insert("composition".into(), json!(text));
        Ok(StageOutput {
            stats,
            summary: Some(text),
        })
    }
}

/// The text a row is judged by: its user turns.
fn prompt_text(v: &BatchView<'_>, i: usize) -> String {
    let mut out = String::new();
    for j in v.message_range(i) {
        if v.role.value(j) == "user" {
            if !out.is_empty() {
                out.push('\n');
            }
            out.push_str(v.content.value(j));
        }
    }
    out
}

/// Lower case, whitespace runs collapsed to one space, trimmed: trivially different copies
/// hash alike.
fn normalise(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for word in text.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.extend(word.chars().flat_map(char::to_lowercase));
    }
    out
}
