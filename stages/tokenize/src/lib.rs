//! The `tokenize` stage kind: conversations in, exactly the tokens the model will see out.
//!
//! Each conversation is rendered with the model's chat template (minijinja behaving as
//! `transformers`' Jinja does; `template`), the spans of text the model generated in assistant
//! turns are found from the template itself (`spans`), and the text is tokenized with the
//! model's tokenizer (`model`: a Hugging Face folder or a GGUF file). A token is trained on
//! (`loss_mask = 1`) when its character range overlaps a generated span, the same rule
//! `transformers` applies to its assistant masks. Rows are tokenized in parallel on every core;
//! each input file becomes one output file (`output`), committed as a shard as soon as it is
//! written, so a rerun after a crash redoes only the files that were not finished.

mod bpe;
mod chat;
mod encoder;
mod gguf;
mod model;
pub mod output;
mod spans;
mod stats;
mod template;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use arrow_array::Array as _;
use dflash_stage_api::dataset::{self, BatchView};
use dflash_stage_api::{
    CheckEnv, Issue, Param, ParamType, Pin, Pinner, StageContext, StageError, StageKind, StageLog,
    StageOutput, remote,
};
use rayon::prelude::*;
use serde::Deserialize;
use serde_json::{Value as Json, json};

pub use crate::bpe::Cache;
pub use crate::chat::Chat;
pub use crate::encoder::Encoder;
pub use crate::model::{Model, load as load_model};
pub use crate::spans::Which;
use crate::stats::{Drop, FileStats};
pub use crate::template::{ChatTemplate, Turn};

/// The `tokenize` stage kind.
pub struct TokenizeKind;

#[derive(Deserialize)]
struct Params {
    tokenizer: String,
    chat_template: Option<String>,
    template_kwargs: serde_json::Map<String, Json>,
    tools: Option<Json>,
    reasoning: String,
    train_on: String,
    max_length: Option<i64>,
    overflow: String,
    truncated: String,
}

impl StageKind for TokenizeKind {
    fn name(&self) -> &'static str {
        "tokenize"
    }

    fn version(&self) -> u32 {
        // 2: writes `tokenize.json` (how rows were rendered), which train and bench read.
        2
    }

    fn summary(&self) -> &'static str {
        "apply the chat template, tokenize, and mask the loss to the tokens the model generated"
    }

    fn params(&self) -> Vec<Param> {
        vec![
            Param::new(
                "tokenizer",
                ParamType::Str,
                "a model folder (`tokenizer.json`, `tokenizer_config.json`) or a `.gguf` file; \
                 local, or in an object store (`s3://bucket/models/Qwen3-8B`)",
            )
            .required()
            .content(),
            Param::new(
                "chat_template",
                ParamType::Str,
                "a Jinja file that replaces the model's chat template",
            )
            .content(),
            Param::new(
                "template_kwargs",
                ParamType::Map(Box::new(ParamType::Any)),
                "values the template reads, e.g. `enable_thinking: false`",
            )
            .default(json!({})),
            Param::new(
                "tools",
                ParamType::List(Box::new(ParamType::Any)),
                "tool definitions (JSON schemas) for rows that carry none",
            ),
            Param::new(
                "reasoning",
                ParamType::Enum(&["keep", "drop"]),
                "pass assistant reasoning to the template (`keep`) or leave it out",
            )
            .default("keep"),
            Param::new(
                "train_on",
                ParamType::Enum(&["all", "last"]),
                "train on every assistant turn or only the last one",
            )
            .default("all"),
            Param::new(
                "max_length",
                ParamType::Int,
                "the most tokens per row (see `overflow`)",
            )
            .at_least(1.0),
            Param::new(
                "overflow",
                ParamType::Enum(&["truncate", "drop"]),
                "rows longer than `max_length`: cut them there, or drop them",
            )
            .default("truncate"),
            Param::new(
                "truncated",
                ParamType::Enum(&["drop", "keep"]),
                "rows whose generation hit its length limit (`finish_reason: length`): drop \
                 them, or keep them without the end-of-turn token they never generated",
            )
            .default("drop"),
        ]
    }

    fn check(&self, params: &Json, env: &CheckEnv<'_>) -> Vec<Issue> {
        let mut issues = Vec::new();
        if let Some(t) = params["tokenizer"].as_str()
            && !remote::is_object_url(t)
        {
            let path = env.path(t);
            if !path.exists() {
                issues.extend(env.must_exist(
                    params,
                    "tokenizer",
                    "a model folder (tokenizer.json, tokenizer_config.json), a .gguf file, or an object-store URL",
                ));
            } else if path.is_dir() && !path.join("tokenizer.json").is_file() {
                let e = missing_tokenizer(Path::new(t));
                let mut issue = Issue::new("tokenizer", e.message);
                if let Some(h) = e.help {
                    issue = issue.help(h);
                }
                issues.push(issue);
            }
        }
        issues.extend(env.must_exist(params, "chat_template", "a Jinja file"));
        issues
    }

    fn pin(&self, params: &Json, pinner: &dyn Pinner) -> Result<Vec<Pin>, StageError> {
        let p: Params = serde_json::from_value(params.clone())
            .map_err(|e| StageError::new(format!("params do not fit: {e}")))?;
        let mut pins = Vec::new();
        if remote::is_object_url(&p.tokenizer) {
            for (name, url) in model::remote_files(&p.tokenizer) {
                if let Some(identity) = remote::identity(&url)? {
                    pins.push(Pin {
                        name: format!("tokenizer:{name}"),
                        identity,
                    });
                }
            }
            let has_tokenizer = pins
                .iter()
                .any(|p| p.name == "tokenizer:tokenizer.json" || model::is_gguf(&p.name));
            if !has_tokenizer {
                return Err(StageError::new(format!(
                    "`{}` holds no `tokenizer.json`",
                    remote::shown(&p.tokenizer)
                ))
                .with_help("give the prefix of a model folder, or the URL of a `.gguf` object"));
            }
        }
        // Local files by content alone, so a renamed copy keeps the key: `tokenizer` for one
        // file (a GGUF), `tokenizer:<file>` for a folder's files, `chat_template` for the
        // template.
        let path = Path::new(&p.tokenizer);
        let mut local: Vec<(String, PathBuf)> = Vec::new();
        if pins.is_empty() {
            if path.is_file() {
                local.push(("tokenizer".to_owned(), path.to_owned()));
            } else {
                for f in model::identity_files(path) {
                    let name = f.file_name().map_or_else(
                        || f.display().to_string(),
                        |n| n.to_string_lossy().into_owned(),
                    );
                    local.push((format!("tokenizer:{name}"), f));
                }
            }
            if local.is_empty() {
                return Err(missing_tokenizer(path));
            }
        }
        if let Some(t) = &p.chat_template {
            local.push(("chat_template".to_owned(), PathBuf::from(t)));
        }
        let local: Vec<Pin> = local
            .into_iter()
            .map(|(name, f)| {
                Ok(Pin {
                    name,
                    identity: pinner.file_digest(&f)?.to_hex(),
                })
            })
            .collect::<Result<_, StageError>>()?;
        pins.extend(local);
        Ok(pins)
    }

    fn run(&self, ctx: &StageContext<'_>) -> Result<StageOutput, StageError> {
        let p: Params = ctx.params()?;
        let mut log = StageLog::open(ctx.log_path)?;
        let started = Instant::now();
        let job = Job::new(&p, ctx)?;
        log.line(&format!(
            "loaded the tokenizer and template in {:.2} s ({} path)",
            started.elapsed().as_secs_f64(),
            if job.encoder.is_fast() {
                "fast byte-level BPE"
            } else {
                "tokenizers"
            }
        ));
        let files = input_files(ctx)?;
        let done = ctx.shards.done();
        let total = files.len() as u64;
        let mut per_file: Vec<FileStats> = Vec::new();
        for (i, (name, path)) in files.iter().enumerate() {
            if ctx.cancel.is_cancelled() {
                return Err(StageError::cancelled());
            }
            let report = format!("_tokenize/{name}.json");
            let stats: FileStats = if done.contains(name) {
                let bytes = ctx.shards.read(name, &report)?;
                serde_json::from_slice(&bytes).map_err(|e| {
                    StageError::new(format!("shard {name}'s report is unreadable: {e}"))
                })?
            } else {
                ctx.progress
                    .set(i as u64, Some(total), &format!("tokenizing {name}"));
                let dir = ctx.scratch_dir.join(format!("shard-{name}"));
                std::fs::create_dir_all(dir.join("_tokenize"))?;
                let t = Instant::now();
                let stats = job.file(path, &dir.join(name), ctx)?;
                let secs = t.elapsed().as_secs_f64();
                log.line(&format!(
                    "{name}: {} rows, {} tokens in {secs:.3} s ({:.0}K tokens/s)",
                    stats.rows,
                    stats.tokens,
                    stats.tokens as f64 / secs.max(1e-9) / 1e3
                ));
                std::fs::write(
                    dir.join(&report),
                    serde_json::to_vec_pretty(&stats).expect("json"),
                )?;
                ctx.shards.commit(name, &dir)?;
                let _ = std::fs::remove_dir_all(&dir);
                stats
            };
            per_file.push(stats);
        }
        let all = FileStats::merge(&per_file);
        if all.rows == 0 {
            let reason = all.dropped.iter().max_by_key(|(_, n)| **n).map_or_else(
                || "the inputs are empty".to_owned(),
                |(r, n)| format!("{n} rows: {r}"),
            );
            return Err(StageError::new(format!("no row could be tokenized ({reason})"))
                .with_help(all.examples.first().map_or_else(
                    || "tokenize takes conversations with assistant turns (from `download`, `mix` or `generate`)".to_owned(),
                    |e| format!("e.g. {e}"),
                )));
        }
        // How the rows were rendered travels with them: `train` records it with the drafter and
        // `bench` warns when it serves the drafter differently (thinking mode above all).
        std::fs::write(
            ctx.out_dir.join(dflash_stage_api::tokens::RENDERING_FILE),
            serde_json::to_vec_pretty(&job.describe()).expect("json"),
        )?;
        Ok(StageOutput {
            summary: Some(all.summary()),
            stats: all.to_manifest(&job.describe()),
        })
    }
}

fn missing_tokenizer(path: &Path) -> StageError {
    StageError::new(format!(
        "the tokenizer `{}` holds neither `tokenizer.json` nor a GGUF file",
        path.display()
    ))
    .with_help("give a model folder holding `tokenizer.json`, or a `.gguf` file")
}

/// The input files by output name: `<split>-<nnnnn>.arrow`, numbered per split across inputs.
fn input_files(ctx: &StageContext<'_>) -> Result<Vec<(String, PathBuf)>, StageError> {
    let mut by_split: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for input in ctx.inputs {
        for (split, files) in dataset::files(&input.dir)? {
            by_split.entry(split).or_default().extend(files);
        }
    }
    if by_split.is_empty() {
        return Err(StageError::new("the inputs hold no conversation datasets")
            .with_help("tokenize takes `download`, `mix` or `generate` stages as inputs"));
    }
    Ok(by_split
        .into_iter()
        .flat_map(|(split, files)| {
            files
                .into_iter()
                .enumerate()
                .map(move |(i, f)| (dataset::file_name(&split, i), f))
        })
        .collect())
}

/// Everything fixed for a run: the model, the template and the policies.
struct Job {
    model: Model,
    encoder: Encoder,
    template: ChatTemplate,
    tools: Option<Json>,
    keep_reasoning: bool,
    which: Which,
    max_length: Option<usize>,
    drop_overflow: bool,
    keep_truncated: bool,
    kwargs: serde_json::Map<String, Json>,
}

impl Job {
    fn new(p: &Params, ctx: &StageContext<'_>) -> Result<Self, StageError> {
        let cwd = ctx.cwd;
        let template_text = p
            .chat_template
            .as_ref()
            .map(|t| {
                let path = cwd.join(t);
                std::fs::read_to_string(&path).map_err(|e| {
                    StageError::new(format!("cannot read the chat template `{t}`: {e}"))
                })
            })
            .transpose()?;
        let model_path = if remote::is_object_url(&p.tokenizer) {
            model::fetch_remote(&p.tokenizer, ctx.pins, &ctx.scratch_dir.join("model"))?
        } else {
            cwd.join(&p.tokenizer)
        };
        if model::identity_files(&model_path).is_empty() {
            return Err(missing_tokenizer(Path::new(&p.tokenizer)));
        }
        let mut model = model::load(&model_path, template_text)?;
        // Token files hold whole rows: `max_length` is applied here, never by the tokenizer.
        model
            .tokenizer
            .with_truncation(None)
            .map_err(|e| StageError::new(e.to_string()))?;
        model.tokenizer.with_padding(None);
        // The fast path was built from the tokenizer's own JSON, before truncation was unset:
        // it never truncates or pads.
        let encoder = Encoder::from_parts(model.tokenizer.clone(), model.fast.take());
        let template = ChatTemplate::new(&model.template, &model.special, &p.template_kwargs)
            .map_err(|e| {
                StageError::new(e.0).with_help("check `chat_template:` or the model's template")
            })?;
        if let Some(m) = p.max_length
            && m < 1
        {
            return Err(StageError::new(format!(
                "`max_length` is {m}; it must be at least 1"
            )));
        }
        Ok(Self {
            template,
            tools: p.tools.clone(),
            keep_reasoning: p.reasoning == "keep",
            which: if p.train_on == "last" {
                Which::Last
            } else {
                Which::All
            },
            max_length: p.max_length.map(|m| m as usize),
            drop_overflow: p.overflow == "drop",
            keep_truncated: p.truncated == "keep",
            kwargs: p.template_kwargs.clone(),
            model,
            encoder,
        })
    }

    /// What the manifest says about how rows were tokenized.
    fn describe(&self) -> Json {
        json!({
            "template_kwargs": self.kwargs,
            "end_tokens": self.model.end_tokens,
            "vocab_size": self.model.tokenizer.get_vocab_size(true),
            "fast_bpe": self.encoder.is_fast(),
        })
    }

    /// Tokenize one input file into `out`.
    fn file(
        &self,
        input: &Path,
        out: &Path,
        ctx: &StageContext<'_>,
    ) -> Result<FileStats, StageError> {
        let mut stats = FileStats::default();
        let mut writer = output::Writer::create(out)?;
        for batch in dataset::read_batches(input)? {
            if ctx.cancel.is_cancelled() {
                return Err(StageError::cancelled());
            }
            let view = BatchView::new(&batch);
            let results: Vec<Result<(output::Row, u32, bool), Drop>> = (0..view.len())
                .into_par_iter()
                .map_init(
                    || CacheGuard(&self.encoder, Some(self.encoder.take_cache())),
                    |cache, i| self.row(&view, i, cache.1.as_mut().expect("held")),
                )
                .collect();
            let mut rows = Vec::with_capacity(results.len());
            for (i, r) in results.into_iter().enumerate() {
                match r {
                    Ok((row, unlike_prompt, cut)) => {
                        stats.add(&row, unlike_prompt, cut);
                        rows.push(row);
                    }
                    Err(d) => stats.drop(view.id.value(i), &d),
                }
            }
            writer.write(&rows)?;
        }
        writer.finish()?;
        Ok(stats)
    }

    /// Tokenize row `i` of a batch; also says how many of its trained turns do not follow the
    /// generation prompt, and whether it was cut at `max_length`.
    fn row(
        &self,
        v: &BatchView<'_>,
        i: usize,
        cache: &mut Cache,
    ) -> Result<(output::Row, u32, bool), Drop> {
        let finish = (!v.finish_reason.is_null(i)).then(|| v.finish_reason.value(i));
        let cut_off = finish == Some("length");
        if cut_off && !self.keep_truncated {
            return Err(Drop::new(
                "generation hit its length limit (finish_reason `length`)",
            ));
        }
        if finish == Some("error") {
            return Err(Drop::new("generation failed (finish_reason `error`)"));
        }
        let range = v.message_range(i);
        let mut turns = Vec::with_capacity(range.len());
        for j in range {
            let tool_calls = if v.tool_calls.is_null(j) {
                None
            } else {
                Some(
                    serde_json::from_str::<Json>(v.tool_calls.value(j))
                        .map_err(|e| Drop::detail("tool_calls are not JSON", e))?,
                )
            };
            turns.push(Turn {
                role: v.role.value(j),
                content: v.content.value(j),
                reasoning: (self.keep_reasoning && !v.reasoning.is_null(j))
                    .then(|| v.reasoning.value(j)),
                tool_calls,
            });
        }
        let row_tools = if v.tools.is_null(i) {
            None
        } else {
            Some(
                serde_json::from_str::<Json>(v.tools.value(i))
                    .map_err(|e| Drop::detail("tools are not JSON", e))?,
            )
        };
        let tools = row_tools.as_ref().or(self.tools.as_ref());
        let rendered = spans::render(
            &self.template,
            &turns,
            tools,
            self.which,
            &self.model.end_tokens,
            cut_off,
        )
        .map_err(|e| match e {
            spans::SpanError::NoAssistantTurn => Drop::new("no assistant turn after a prompt"),
            spans::SpanError::Template(m) => Drop::detail("the chat template failed", m),
            spans::SpanError::Unlocatable(t) => Drop::detail(
                "the template renders an assistant turn where it cannot be located",
                format!("message {t}"),
            ),
        })?;
        let (ids, offsets) = self
            .encoder
            .encode(&rendered.text, cache)
            .map_err(|e| Drop::detail("the tokenizer failed", e))?;
        // Vocabularies stay far below 2^31 ids.
        #[allow(clippy::cast_possible_wrap)]
        let mut input_ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        let mut loss_mask = mask(&offsets, &rendered.spans);
        let cut = self.max_length.is_some_and(|max| input_ids.len() > max);
        if let Some(max) = self.max_length
            && cut
        {
            if self.drop_overflow {
                return Err(Drop::new("longer than max_length"));
            }
            input_ids.truncate(max);
            loss_mask.truncate(max);
        }
        if !loss_mask.contains(&1) {
            return Err(Drop::new(if self.max_length.is_some() {
                "no generated token within max_length"
            } else {
                "no generated token"
            }));
        }
        Ok((
            output::Row {
                id: v.id.value(i).to_owned(),
                source: v.source.value(i).to_owned(),
                input_ids,
                loss_mask,
            },
            rendered.unlike_prompt,
            cut,
        ))
    }
}

/// A worker's word cache, returned to the encoder's pool when the worker is done.
struct CacheGuard<'a>(&'a Encoder, Option<Cache>);

impl std::ops::Drop for CacheGuard<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.1.take() {
            self.0.put_cache(c);
        }
    }
}

/// 1 for every token whose byte range overlaps a span (spans and tokens are both in order).
pub fn mask(offsets: &[(usize, usize)], spans: &[std::ops::Range<usize>]) -> Vec<i8> {
    let mut out = Vec::with_capacity(offsets.len());
    let mut s = 0;
    for &(start, end) in offsets {
        while s < spans.len() && spans[s].end <= start {
            s += 1;
        }
        let hit = spans
            .get(s)
            .is_some_and(|sp| start < sp.end && end > sp.start);
        out.push(i8::from(hit));
    }
    out
}
