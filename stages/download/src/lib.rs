//! The `download` stage kind: fetch a dataset and write it as canonical conversations.
//!
//! Sources (exactly one per stage): a Hugging Face Hub dataset (`hf:` repo id at `revision:`,
//! resolved to a commit sha that is pinned into the key), a plain `url:` (pinned by ETag and
//! size, or by content when the server gives neither), an object-store URL `object:` (pinned by
//! ETag and size) and a local `path:` (a file or folder, pinned by content). Files are Parquet,
//! JSON Lines or JSON, optionally gzipped; records are mapped onto conversations by
//! [`mapping`]. Each source file becomes one shard, committed as soon as it is converted, so a
//! rerun after a crash fetches only the files not yet done, and a file cut off mid-download
//! resumes from where it stopped. Rows that can't be mapped are counted per reason and reported.

pub mod http;
pub mod hub;
pub mod mapping;
pub mod records;
pub mod topic;

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use dflash_stage_api::dataset::{self, Writer};
use dflash_stage_api::remote;
use dflash_stage_api::{
    CheckEnv, Issue, Param, ParamType, Pin, Pinner, StageContext, StageError, StageKind, StageLog,
    StageOutput,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::http::{Client, shown};
use crate::mapping::{FIELD_NAMES, Mapping, Shape};
use crate::records::Format;
use object_store::ObjectStoreExt;

/// The `download` stage kind.
pub struct DownloadKind;

#[derive(Deserialize)]
struct Params {
    hf: Option<String>,
    revision: String,
    subset: Option<String>,
    split: String,
    files: Vec<String>,
    url: Option<String>,
    object: Option<String>,
    path: Option<String>,
    format: Shape,
    fields: BTreeMap<String, String>,
    category: Option<String>,
    source: Option<String>,
    keep: Vec<String>,
    limit: Option<u64>,
}

/// Where the data comes from.
enum Source<'a> {
    Hub { repo: &'a str, revision: &'a str },
    Url(&'a str),
    Object(&'a str),
    Local(&'a str),
}

impl Params {
    fn parse(value: &Value) -> Result<Self, StageError> {
        let p: Self = serde_json::from_value(value.clone())
            .map_err(|e| StageError::new(format!("params do not fit: {e}")))?;
        for k in p.fields.keys() {
            if !FIELD_NAMES.contains(&k.as_str()) {
                let near = FIELD_NAMES
                    .iter()
                    .find(|n| n.starts_with(&k[..k.len().min(3)]))
                    .map_or(String::new(), |n| format!("; did you mean `{n}`?"));
                return Err(StageError::new(format!(
                    "`fields.{k}` is not a field a mapping reads{near}"
                ))
                .with_help(format!(
                    "fields that can be renamed: {}",
                    FIELD_NAMES.join(", ")
                )));
            }
        }
        Ok(p)
    }

    fn source(&self) -> Result<Source<'_>, StageError> {
        let given: Vec<Source<'_>> = [
            self.hf.as_deref().map(|repo| Source::Hub {
                repo,
                revision: &self.revision,
            }),
            self.url.as_deref().map(Source::Url),
            self.object.as_deref().map(Source::Object),
            self.path.as_deref().map(Source::Local),
        ]
        .into_iter()
        .flatten()
        .collect();
        let n = given.len();
        let mut it = given.into_iter();
        match (it.next(), n) {
            (Some(s), 1) => Ok(s),
            _ => Err(StageError::new(format!(
                "a download needs exactly one source, and this one has {n}"
            ))
            .with_help("give one of `hf:` (a Hub dataset id), `url:`, `object:` (s3://, gs://, az://) or `path:`")),
        }
    }
}

impl StageKind for DownloadKind {
    fn name(&self) -> &'static str {
        "download"
    }

    fn version(&self) -> u32 {
        // 2: conversations/2 (tool calls and tool definitions).
        2
    }

    fn summary(&self) -> &'static str {
        "fetch a dataset (Hub, URL, object store, local) as canonical conversations (Arrow)"
    }

    fn params(&self) -> Vec<Param> {
        let s = || ParamType::Str;
        vec![
            Param::new("hf", s(), "a Hugging Face Hub dataset id, e.g. `nvidia/Nemotron-Post-Training-Dataset-v2`"),
            Param::new("revision", s(), "branch, tag or commit of `hf:`; resolved to a commit sha that enters the key").default("main"),
            Param::new("subset", s(), "the dataset's config (a folder in the repo)"),
            Param::new("split", s(), "which split's files to take; also the output's split name").default("train"),
            Param::new("files", ParamType::List(Box::new(s())), "files of the repo to take (globs with `*`), instead of choosing by subset and split").default(json!([])),
            Param::new("url", s(), "an http(s) URL of one file"),
            Param::new("object", s(), "an object-store URL of one file (s3://, gs://, az://); credentials from the environment"),
            Param::new("path", s(), "a local file or folder"),
            Param::new("format", ParamType::Enum(Shape::NAMES), "the record shape; `auto` decides per record").default("auto"),
            Param::new("fields", ParamType::Map(Box::new(s())), "renames of the fields a shape reads, e.g. `{prompt: question, id: task_id}`").default(json!({})),
            Param::new("category", s(), "the category of every row (when the data has no category field); `auto`: judged from each row's first prompt and reply (`code`, `math` or `chat`), for `mix` to rebalance by"),
            Param::new("source", s(), "the rows' `source` (default: the stage id)"),
            Param::new("keep", ParamType::List(Box::new(s())), "fields kept as metadata").default(json!([])),
            Param::new("limit", ParamType::Int, "at most this many rows (files are read in order)").at_least(1.0),
        ]
    }

    fn check(&self, params: &Value, env: &CheckEnv<'_>) -> Vec<Issue> {
        let mut issues = Vec::new();
        let given: Vec<&str> = ["hf", "url", "object", "path"]
            .into_iter()
            .filter(|k| !params[*k].is_null())
            .collect();
        if given.len() != 1 {
            let at = given.get(1).copied();
            issues.push(Issue {
                at: at.map(|k| vec![dflash_stage_api::PathSeg::Key(k.to_owned())]).unwrap_or_default(),
                message: format!("a download needs exactly one source, and this one has {}", given.len()),
                help: Some("give one of `hf:` (a Hub dataset id), `url:`, `object:` (s3://, gs://, az://) or `path:`".into()),
            });
        }
        if let Some(url) = params["url"].as_str()
            && !dflash_stage_api::is_http_url(url)
        {
            issues.push(
                Issue::new("url", format!("`{url}` is not an http(s) URL"))
                    .help("`url:` downloads over HTTP; use `object:` for s3://, gs:// or az://, `path:` for local files"),
            );
        }
        if let Some(url) = params["object"].as_str()
            && !remote::is_object_url(url)
        {
            issues.push(
                Issue::new("object", format!("`{url}` is not an object-store URL"))
                    .help("`object:` takes s3://, gs:// or az:// URLs; use `url:` for http(s), `path:` for local files"),
            );
        }
        issues.extend(env.must_exist(
            params,
            "path",
            "a local file or folder of .parquet, .jsonl or .json files",
        ));
        if let Some(hf) = params["hf"].as_str()
            && hf.split('/').filter(|p| !p.is_empty()).count() != 2
        {
            issues.push(
                Issue::new("hf", format!("`{hf}` is not a Hub dataset id"))
                    .help("Hub ids are `owner/name`, e.g. `openai/gsm8k`"),
            );
        }
        issues
    }

    fn pin(&self, params: &Value, pinner: &dyn Pinner) -> Result<Vec<Pin>, StageError> {
        let mut pins = source_pins(params, pinner)?;
        // `category: auto` rows depend on the rules that judge them: a new version of the
        // rules makes a new artifact, never a different one under the old key.
        if params["category"] == "auto" {
            pins.push(Pin {
                name: "category:auto".into(),
                identity: topic::RULES.into(),
            });
        }
        Ok(pins)
    }

    fn run(&self, ctx: &StageContext<'_>) -> Result<StageOutput, StageError> {
        let p = Params::parse(ctx.params)?;
        let source_name = p.source.clone().unwrap_or_else(|| ctx.stage_id.to_owned());
        let mapping = Mapping {
            shape: p.format,
            fields: p.fields.clone(),
            category: p.category.clone(),
            source: source_name.clone(),
            keep: p.keep.clone(),
        };
        let client = Client::new(&hub::endpoint())?;
        let plan = plan_files(&p, ctx, &client)?;
        let mut log = StageLog::open(ctx.log_path)?;
        log.line(&format!("{} file(s) to read", plan.len()));

        let mut reports: Vec<FileReport> = Vec::new();
        let done = ctx.shards.done();
        let mut rows_so_far = 0u64;
        for (i, file) in plan.iter().enumerate() {
            if ctx.cancel.is_cancelled() {
                return Err(StageError::cancelled());
            }
            if p.limit.is_some_and(|l| rows_so_far >= l) {
                break;
            }
            let shard = format!("{i:05}");
            let report_path = format!("_download/{shard}.json");
            let report: FileReport = if done.contains(&shard) {
                let bytes = ctx.shards.read(&shard, &report_path)?;
                serde_json::from_slice(&bytes).map_err(|e| {
                    StageError::new(format!("shard {shard}'s report is unreadable: {e}"))
                })?
            } else {
                ctx.progress.set(
                    i as u64,
                    Some(plan.len() as u64),
                    &format!("fetching {}", file.name),
                );
                let local = fetch(file, ctx, &client)?;
                let dir = ctx.scratch_dir.join(format!("shard-{shard}"));
                std::fs::create_dir_all(dir.join("_download"))?;
                let remaining = p.limit.map(|l| l - rows_so_far);
                let report = convert(
                    &local,
                    file,
                    &mapping,
                    &dir.join(dataset::file_name(&p.split, i)),
                    remaining,
                    rows_so_far,
                    ctx,
                )?;
                std::fs::write(
                    dir.join(&report_path),
                    serde_json::to_vec_pretty(&report).expect("json"),
                )?;
                ctx.shards.commit(&shard, &dir)?;
                let _ = std::fs::remove_dir_all(&dir);
                if file.remote() {
                    let _ = std::fs::remove_file(&local);
                }
                report
            };
            log.line(&format!(
                "{}: {} rows, {} unmappable{}",
                report.file,
                report.rows,
                report.unmapped,
                report
                    .truncated_at
                    .map_or(String::new(), |b| format!(", truncated at byte {b}"))
            ));
            rows_so_far += report.rows;
            reports.push(report);
        }
        if rows_so_far == 0 {
            let names: Vec<&str> = plan.iter().map(|f| f.name.as_str()).collect();
            let reasons = merge_reasons(&reports);
            return Err(StageError::new(format!(
                "no rows could be mapped from {} ({})",
                names.join(", "),
                reasons
                    .keys()
                    .next()
                    .map_or("no records".into(), |r| format!("e.g. {r}"))
            ))
            .with_help("set `format:` and `fields:` to say which fields hold the conversation"));
        }
        Ok(StageOutput {
            stats: stats(&reports, &source_name, ctx.pins),
            summary: None,
        })
    }
}

/// One file to read.
struct PlannedFile {
    /// How the file is named in reports (repo path, URL or local path).
    name: String,
    how: Fetch,
    format: Format,
}

enum Fetch {
    Http { url: String },
    Object { url: String },
    Local(PathBuf),
}

impl PlannedFile {
    fn remote(&self) -> bool {
        !matches!(self.how, Fetch::Local(_))
    }
}

fn format_of(name: &str) -> Result<Format, StageError> {
    Format::of(name).ok_or_else(|| {
        StageError::new(format!("`{name}` is not a format download reads"))
            .with_help("download reads .parquet, .jsonl, .json (each optionally .gz)")
    })
}

fn plan_files(
    p: &Params,
    ctx: &StageContext<'_>,
    client: &Client,
) -> Result<Vec<PlannedFile>, StageError> {
    Ok(match p.source()? {
        Source::Hub { repo, revision } => {
            // The sha pinned into the key, so the data is exactly what the key names.
            let pinned = ctx
                .pins
                .iter()
                .find(|pin| pin.name == format!("hf:{repo}@{revision}"))
                .map(|pin| pin.identity.clone())
                .ok_or_else(|| StageError::new("the dataset revision was not pinned"))?;
            let rev = hub::resolve(client, repo, &pinned)?;
            let chosen = choose_files(&rev.files, p)?;
            chosen
                .into_iter()
                .map(|f| {
                    Ok(PlannedFile {
                        format: format_of(&f)?,
                        how: Fetch::Http {
                            url: hub::file_url(repo, &rev.sha, &f),
                        },
                        name: f,
                    })
                })
                .collect::<Result<_, StageError>>()?
        }
        Source::Url(url) => vec![PlannedFile {
            name: shown(url),
            format: format_of(
                url::Url::parse(url)
                    .map(|u| u.path().to_owned())
                    .as_deref()
                    .unwrap_or(url),
            )?,
            how: Fetch::Http {
                url: url.to_owned(),
            },
        }],
        Source::Object(url) => vec![PlannedFile {
            name: shown(url),
            format: format_of(url)?,
            how: Fetch::Object {
                url: url.to_owned(),
            },
        }],
        Source::Local(path) => {
            let base = ctx.cwd.join(path);
            local_files(&base)?
                .into_iter()
                .map(|f| {
                    // Named as the user wrote it (relative to where dflash runs), so manifests
                    // carry no machine-specific absolute paths.
                    let shown = f.strip_prefix(ctx.cwd).unwrap_or(&f).display().to_string();
                    Ok(PlannedFile {
                        name: shown,
                        format: format_of(&f.display().to_string())?,
                        how: Fetch::Local(f),
                    })
                })
                .collect::<Result<_, StageError>>()?
        }
    })
}

const SPLIT_WORDS: &[&str] = &["train", "test", "validation", "valid", "dev", "eval"];

fn mentions_split(path: &str, split: &str) -> bool {
    path.split('/').any(|part| {
        let stem = part.split('.').next().unwrap_or(part);
        stem == split
            || stem.starts_with(&format!("{split}-"))
            || stem.starts_with(&format!("{split}_"))
            || stem.ends_with(&format!("-{split}"))
            || stem.ends_with(&format!("_{split}"))
    })
}

/// The repo files to read: `files:` globs, or the data files of `subset` and `split` (a repo
/// whose file names mention no split at all is all `train`, as the Hub treats it).
fn choose_files(all: &[String], p: &Params) -> Result<Vec<String>, StageError> {
    let data: Vec<&String> = all.iter().filter(|f| Format::of(f).is_some()).collect();
    let mut chosen: Vec<String> = if p.files.is_empty() {
        let in_subset: Vec<&String> = match &p.subset {
            Some(s) => data
                .iter()
                .copied()
                .filter(|f| f.split('/').rev().skip(1).any(|dir| dir == s))
                .collect(),
            None => data.clone(),
        };
        let any_split = in_subset
            .iter()
            .any(|f| SPLIT_WORDS.iter().any(|w| mentions_split(f, w)));
        if any_split {
            in_subset
                .into_iter()
                .filter(|f| mentions_split(f, &p.split))
                .cloned()
                .collect()
        } else if p.split == "train" {
            in_subset.into_iter().cloned().collect()
        } else {
            Vec::new()
        }
    } else {
        data.iter()
            .copied()
            .filter(|f| p.files.iter().any(|g| glob_match(g, f)))
            .cloned()
            .collect()
    };
    chosen.sort();
    if chosen.is_empty() {
        let listed: Vec<&str> = data.iter().take(12).map(|s| s.as_str()).collect();
        return Err(StageError::new(format!(
            "no data file of the repo matches {}",
            if p.files.is_empty() {
                format!(
                    "split `{}`{}",
                    p.split,
                    p.subset
                        .as_ref()
                        .map_or(String::new(), |s| format!(" of subset `{s}`"))
                )
            } else {
                format!("`files: {:?}`", p.files)
            }
        ))
        .with_help(if listed.is_empty() {
            "the repo has no .parquet, .jsonl or .json files".to_owned()
        } else {
            format!("its data files include: {}", listed.join(", "))
        }));
    }
    Ok(chosen)
}

/// `*` matches within one path segment, `**` across segments.
fn glob_match(pattern: &str, text: &str) -> bool {
    fn go(p: &[u8], t: &[u8]) -> bool {
        match p.split_first() {
            None => t.is_empty(),
            Some((b'*', rest)) if rest.first() == Some(&b'*') => {
                (0..=t.len()).any(|i| go(&rest[1..], &t[i..]))
            }
            Some((b'*', rest)) => (0..=t.len())
                .take_while(|&i| i == 0 || t[i - 1] != b'/')
                .any(|i| go(rest, &t[i..])),
            Some((c, rest)) => t.first() == Some(c) && go(rest, &t[1..]),
        }
    }
    go(pattern.as_bytes(), text.as_bytes())
}

/// What a `download` of local files will hold, counted by reading them as the stage maps them:
/// the rows (before `limit`) and their user turns (a multi-turn benchmark asks one each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalCounts {
    /// Records that map to a conversation.
    pub rows: u64,
    /// Their user messages.
    pub user_turns: u64,
}

/// [`LocalCounts`] for a `download` stage's params when its source is a local `path:` (relative
/// to `base`) of at most `max_bytes` in all; `None` for any other source, a larger one or one
/// that cannot be read (the stage itself says why when it runs). For `dflash estimate`.
pub fn local_counts(params: &Value, base: &Path, max_bytes: u64) -> Option<LocalCounts> {
    let p = Params::parse(params).ok()?;
    let Ok(Source::Local(path)) = p.source() else {
        return None;
    };
    let path = base.join(path);
    let files = local_files(&path).ok()?;
    let bytes: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).map_or(u64::MAX, |m| m.len()))
        .fold(0, u64::saturating_add);
    if bytes > max_bytes {
        return None;
    }
    let mapping = Mapping {
        shape: p.format,
        fields: p.fields.clone(),
        category: None,
        source: String::new(),
        keep: Vec::new(),
    };
    let mut counts = LocalCounts {
        rows: 0,
        user_turns: 0,
    };
    for file in &files {
        let format = Format::of(&file.display().to_string())?;
        let mut ordinal = 0;
        records::for_each(file, format, &mut |_, rec| {
            if let Ok((_, conv)) = rec.and_then(|r| mapping.map(&r, ordinal)) {
                counts.rows += 1;
                counts.user_turns +=
                    conv.messages.iter().filter(|m| m.role == "user").count() as u64;
            }
            ordinal += 1;
            ControlFlow::Continue(())
        })
        .ok()?;
    }
    Some(counts)
}

fn local_files(path: &Path) -> Result<Vec<PathBuf>, StageError> {
    let meta = std::fs::metadata(path).map_err(|e| {
        StageError::new(format!("cannot read `{}`: {e}", path.display()))
            .with_help("a relative `path:` is relative to the directory dflash runs in")
    })?;
    if meta.is_file() {
        return Ok(vec![path.to_owned()]);
    }
    let mut out = Vec::new();
    let mut stack = vec![path.to_owned()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir)? {
            let p = e?.path();
            if p.is_dir() {
                stack.push(p);
            } else if Format::of(&p.display().to_string()).is_some() {
                out.push(p);
            }
        }
    }
    out.sort();
    if out.is_empty() {
        return Err(StageError::new(format!(
            "the folder `{}` holds no .parquet, .jsonl or .json files",
            path.display()
        )));
    }
    Ok(out)
}

/// Bring one file to local disk (resuming an interrupted download); returns its path.
fn fetch(
    file: &PlannedFile,
    ctx: &StageContext<'_>,
    client: &Client,
) -> Result<PathBuf, StageError> {
    match &file.how {
        Fetch::Local(p) => Ok(p.clone()),
        Fetch::Http { url } => {
            let name = blake3::hash(url.as_bytes()).to_hex()[..16].to_owned();
            let ext = file.name.rsplit('/').next().unwrap_or("data");
            let dest = ctx.resume_dir.join(format!("{name}-{ext}"));
            let head = client.head(url).map_err(|e| StageError::new(e.message))?;
            let fetched = std::sync::atomic::AtomicU64::new(0);
            client.download(url, &dest, head.size, ctx.cancel, &|n| {
                let so_far = fetched.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n;
                ctx.progress
                    .set(so_far, head.size, &format!("{} bytes", file.name));
            })?;
            Ok(dest)
        }
        Fetch::Object { url } => {
            let dest = ctx.resume_dir.join(
                blake3::hash(url.as_bytes()).to_hex()[..16].to_owned()
                    + "-"
                    + url.rsplit('/').next().unwrap_or("data"),
            );
            if !dest.exists() {
                let (store, path) = remote::open(url)?;
                let bytes = remote::block_on(async { store.get(&path).await?.bytes().await })?
                    .map_err(|e| StageError::new(format!("cannot read `{}`: {e}", shown(url))))?;
                let part = dest.with_extension("part");
                std::fs::write(&part, &bytes)?;
                std::fs::rename(&part, &dest)?;
            }
            Ok(dest)
        }
    }
}

/// What converting one file found.
#[derive(Debug, Default, Serialize, Deserialize)]
struct FileReport {
    file: String,
    rows: u64,
    unmapped: u64,
    reasons: BTreeMap<String, u64>,
    examples: Vec<String>,
    shapes: BTreeMap<String, u64>,
    categories: BTreeMap<String, u64>,
    truncated_at: Option<u64>,
    /// The rows' user turns: what a multi-turn benchmark asks (MT-Bench's 80 rows are 160
    /// turns to decode). Absent in shards written before it was counted.
    #[serde(default)]
    user_turns: Option<u64>,
}

/// A reason with its numbers blanked, so "turn 3 ..." and "turn 7 ..." count together.
fn reason_class(reason: &str) -> String {
    let mut out = String::new();
    let mut last_digit = false;
    for c in reason.chars() {
        if c.is_ascii_digit() {
            if !last_digit {
                out.push('N');
            }
            last_digit = true;
        } else {
            out.push(c);
            last_digit = false;
        }
    }
    out
}

fn convert(
    local: &Path,
    file: &PlannedFile,
    mapping: &Mapping,
    out: &Path,
    limit: Option<u64>,
    ordinal_base: u64,
    ctx: &StageContext<'_>,
) -> Result<FileReport, StageError> {
    let mut writer = Writer::create(out)?;
    let mut report = FileReport {
        file: file.name.clone(),
        user_turns: Some(0),
        ..FileReport::default()
    };
    let mut failure = None;
    let mut seen = 0u64;
    let notes = records::for_each(local, file.format, &mut |loc, rec| {
        seen += 1;
        let mapped = rec.and_then(|v| mapping.map(&v, ordinal_base + seen - 1));
        match mapped {
            Ok((shape, conv)) => {
                *report.shapes.entry(shape.name().to_owned()).or_default() += 1;
                *report
                    .categories
                    .entry(conv.category.clone().unwrap_or_else(|| "(none)".into()))
                    .or_default() += 1;
                let turns = conv.messages.iter().filter(|m| m.role == "user").count() as u64;
                if let Err(e) = writer.push(conv) {
                    failure = Some(e);
                    return ControlFlow::Break(());
                }
                report.rows += 1;
                if let Some(t) = report.user_turns.as_mut() {
                    *t += turns;
                }
            }
            Err(reason) => {
                report.unmapped += 1;
                if report.examples.len() < 5 {
                    report
                        .examples
                        .push(format!("{} {loc}: {reason}", file.name));
                }
                *report.reasons.entry(reason_class(&reason)).or_default() += 1;
            }
        }
        if seen.is_multiple_of(10_000) {
            if ctx.cancel.is_cancelled() {
                return ControlFlow::Break(());
            }
            ctx.progress
                .set(report.rows, None, &format!("rows of {}", file.name));
        }
        if limit.is_some_and(|l| report.rows >= l) {
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    })?;
    if let Some(e) = failure {
        return Err(e);
    }
    if ctx.cancel.is_cancelled() {
        return Err(StageError::cancelled());
    }
    writer.finish()?;
    report.truncated_at = notes.truncated_at;
    Ok(report)
}

fn merge_reasons(reports: &[FileReport]) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for r in reports {
        for (k, v) in &r.reasons {
            *out.entry(k.clone()).or_default() += v;
        }
    }
    out
}

fn stats(reports: &[FileReport], source: &str, pins: &[Pin]) -> serde_json::Map<String, Value> {
    let mut shapes: BTreeMap<String, u64> = BTreeMap::new();
    let mut categories: BTreeMap<String, u64> = BTreeMap::new();
    for r in reports {
        for (k, v) in &r.shapes {
            *shapes.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &r.categories {
            *categories.entry(k.clone()).or_default() += v;
        }
    }
    let examples: Vec<&String> = reports.iter().flat_map(|r| &r.examples).take(5).collect();
    let files: Vec<Value> = reports
        .iter()
        .map(|r| json!({"file": r.file, "rows": r.rows, "unmapped": r.unmapped, "truncated_at": r.truncated_at}))
        .collect();
    let mut m = serde_json::Map::new();
    m.insert(
        "rows".into(),
        json!(reports.iter().map(|r| r.rows).sum::<u64>()),
    );
    m.insert(
        "unmapped".into(),
        json!(reports.iter().map(|r| r.unmapped).sum::<u64>()),
    );
    // Only where every file's were counted (a shard from an older dflash has none).
    let turns: Option<u64> = reports.iter().map(|r| r.user_turns).sum();
    if let Some(t) = turns {
        m.insert("user_turns".into(), json!(t));
    }
    m.insert("unmapped_reasons".into(), json!(merge_reasons(reports)));
    m.insert("unmapped_examples".into(), json!(examples));
    m.insert("source".into(), json!(source));
    m.insert(
        "sources".into(),
        json!({ source: reports.iter().map(|r| r.rows).sum::<u64>() }),
    );
    m.insert("categories".into(), json!(categories));
    m.insert("shapes".into(), json!(shapes));
    m.insert("files".into(), json!(files));
    m.insert(
        "pinned".into(),
        json!(
            pins.iter()
                .map(|p| (p.name.clone(), p.identity.clone()))
                .collect::<BTreeMap<_, _>>()
        ),
    );
    m
}

/// The pins of a download's source (see [`DownloadKind`]'s `pin`).
fn source_pins(params: &Value, pinner: &dyn Pinner) -> Result<Vec<Pin>, StageError> {
    let p = Params::parse(params)?;
    match p.source()? {
        Source::Hub { repo, revision } => {
            let client = Client::new(&hub::endpoint())?;
            let rev = hub::resolve(&client, repo, revision)?;
            Ok(vec![Pin {
                name: format!("hf:{repo}@{revision}"),
                identity: rev.sha,
            }])
        }
        Source::Url(url) => {
            let client = Client::new(&hub::endpoint())?;
            let head = client.head(url).map_err(|e| StageError::new(e.message))?;
            let identity = match (&head.etag, &head.last_modified) {
                (Some(etag), _) => format!("etag={etag};size={}", head.size.unwrap_or(0)),
                (None, Some(lm)) => {
                    format!("last-modified={lm};size={}", head.size.unwrap_or(0))
                }
                // Nothing identifies the object but its bytes: hash them.
                (None, None) => {
                    let dir = tempfile::tempdir()?;
                    let tmp = dir.path().join("object");
                    client.download(
                        url,
                        &tmp,
                        head.size,
                        &dflash_stage_api::Cancel::new(),
                        &|_| {},
                    )?;
                    let digest = blake3::hash(&std::fs::read(&tmp)?);
                    format!("blake3={digest}")
                }
            };
            Ok(vec![Pin {
                name: format!("url:{}", shown(url)),
                identity,
            }])
        }
        Source::Object(url) => {
            let (store, path) = remote::open(url)?;
            let meta = remote::block_on(store.head(&path))?
                .map_err(|e| StageError::new(format!("cannot read `{}`: {e}", shown(url))))?;
            Ok(vec![Pin {
                name: format!("object:{}", shown(url)),
                identity: format!("etag={};size={}", meta.e_tag.unwrap_or_default(), meta.size),
            }])
        }
        Source::Local(path) => local_files(Path::new(path))?
            .iter()
            .map(|f| {
                Ok(Pin {
                    name: format!("file:{}", f.display()),
                    identity: pinner.file_digest(f)?.to_hex(),
                })
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(split: &str, subset: Option<&str>, files: &[&str]) -> Params {
        Params::parse(&json!({
            "hf": "a/b", "revision": "main", "split": split, "subset": subset,
            "files": files, "format": "auto", "fields": {}, "keep": [],
        }))
        .unwrap()
    }

    #[test]
    fn files_are_chosen_by_split_and_subset() {
        let all: Vec<String> = [
            "README.md",
            "data/train-00000-of-00002.parquet",
            "data/train-00001-of-00002.parquet",
            "data/test-00000-of-00001.parquet",
            "chat/train.jsonl",
            "code/train.jsonl",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            choose_files(&all, &params("test", None, &[])).unwrap(),
            vec!["data/test-00000-of-00001.parquet"]
        );
        assert_eq!(
            choose_files(&all, &params("train", Some("code"), &[])).unwrap(),
            vec!["code/train.jsonl"]
        );
        assert_eq!(
            choose_files(&all, &params("train", None, &["data/*.parquet"]))
                .unwrap()
                .len(),
            3
        );
        let err = choose_files(&all, &params("validation", None, &[])).unwrap_err();
        assert!(
            err.help
                .unwrap()
                .contains("data/train-00000-of-00002.parquet")
        );
    }

    #[test]
    fn a_repo_without_split_names_is_train() {
        let all = vec!["mt-en.jsonl".to_owned()];
        assert_eq!(
            choose_files(&all, &params("train", None, &[])).unwrap(),
            all
        );
        assert!(choose_files(&all, &params("test", None, &[])).is_err());
    }

    #[test]
    fn globs() {
        assert!(glob_match("data/*.parquet", "data/x.parquet"));
        assert!(!glob_match("*.parquet", "data/x.parquet"));
        assert!(glob_match("**.parquet", "data/x.parquet"));
    }

    #[test]
    fn mistyped_field_names_are_refused() {
        let err = Params::parse(&json!({
            "path": "x", "revision": "main", "split": "train", "files": [],
            "format": "auto", "fields": {"promt": "q"}, "keep": [],
        }))
        .err()
        .unwrap();
        assert!(
            err.message.contains("did you mean `prompt`"),
            "{}",
            err.message
        );
    }

    #[test]
    fn reasons_group_without_numbers() {
        assert_eq!(
            reason_class("turn 12 has the unknown role `x`"),
            "turn N has the unknown role `x`"
        );
    }
}
