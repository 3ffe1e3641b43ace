//! The `generate` stage kind: regenerate the assistant turns of upstream conversations with the
//! target model, on any number of OpenAI-compatible servers (SGLang, vLLM, llama.cpp's server),
//! optionally started by the stage itself (`launch`).
//!
//! Every prompt (times `n` samples) is one request key. Answers are saved as they arrive into
//! create-only shards (`shards`), so a crash or Ctrl-C costs at most one shard's worth of work: a
//! rerun reads which keys the committed shards answer and sends only the rest; a finished stage
//! is cached like any other. Requests are spread over the endpoints by free capacity and retried
//! on transient failures (`client`). Multi-turn conversations are regenerated turn by turn: each
//! assistant turn is generated from the conversation so far, with the earlier turns already
//! regenerated (`turns: all`), or only the last reply is (`turns: last`).

mod client;
mod launch;
mod local;
mod shards;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dflash_stage_api::dataset::{self, Conversation, Message};
use dflash_stage_api::{
    CheckEnv, Issue, Param, ParamType, PathSeg, Pin, Pinner, StageContext, StageError, StageKind,
    StageLog, StageOutput,
};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Map, Value as Json, json};
use xxhash_rust::xxh3::xxh3_64;

use crate::client::{Client, Endpoint, Failure, Reply};
use crate::local::Local;
use crate::shards::{Answered, ShardWriter};

/// The `generate` stage kind.
pub struct GenerateKind;

#[derive(Deserialize)]
struct Params {
    backend: String,
    model: String,
    endpoints: Vec<String>,
    max_in_flight: i64,
    launch: Option<Json>,
    max_tokens: i64,
    temperature: f64,
    top_p: f64,
    seed: Option<i64>,
    stop: Vec<String>,
    n: i64,
    thinking: Option<bool>,
    chat_template_kwargs: Map<String, Json>,
    extra_body: Map<String, Json>,
    keep_reasoning: bool,
    turns: String,
    truncated: String,
    request_timeout_s: i64,
    attempts: i64,
    shard_rows: i64,
    shard_seconds: f64,
    batch_size: i64,
    device: String,
}

impl StageKind for GenerateKind {
    fn name(&self) -> &'static str {
        "generate"
    }

    fn version(&self) -> u32 {
        // 2: the candle backend decodes batches with dflash's own model code (dense weights).
        // 3: its batches are prefilled together, left-padded (rounding can differ from 2's).
        3
    }

    fn uses_accelerator(&self, params: &serde_json::Value) -> bool {
        // In process (candle), or servers it starts here on this machine's GPUs; running
        // servers elsewhere (`endpoints`) use none of this machine's.
        params["backend"] == "candle" || params["launch"].is_object()
    }

    fn summary(&self) -> &'static str {
        "regenerate assistant turns with the target model on OpenAI-compatible servers"
    }

    fn params(&self) -> Vec<Param> {
        let strs = || ParamType::List(Box::new(ParamType::Str));
        let any_map = || ParamType::Map(Box::new(ParamType::Any));
        vec![
            Param::new(
                "backend",
                ParamType::Enum(&["openai", "candle"]),
                "OpenAI-compatible servers, or in-process generation with candle",
            )
            .default("openai"),
            Param::new(
                "model",
                ParamType::Str,
                "the served model name, checked against each endpoint's /v1/models; with \
                 `backend: candle`, a GGUF file or a Hugging Face model folder",
            )
            .required()
            .content(),
            Param::new(
                "endpoints",
                strs(),
                "base URLs of running servers, e.g. `http://10.0.0.5:30000/v1`",
            )
            .default(json!([]))
            .operational(),
            Param::new(
                "max_in_flight",
                ParamType::Int,
                "requests each endpoint holds at once",
            )
            .default(64)
            .operational()
            .at_least(1.0),
            Param::new(
                "launch",
                ParamType::Any,
                "start servers: {command: \"... --port {port}\", gpus: [0, 1, ...], port: 30000, \
                 ready_path: /v1/models, ready_timeout_s: 1800}",
            )
            .operational(),
            Param::new("max_tokens", ParamType::Int, "the most tokens per reply").default(2048).at_least(1.0),
            Param::new("temperature", ParamType::Float, "sampling temperature").default(0.0).at_least(0.0),
            Param::new("top_p", ParamType::Float, "nucleus sampling").default(1.0).within(
                dflash_stage_api::Bounds {
                    low: Some((0.0, false)),
                    high: Some((1.0, true)),
                },
            ),
            Param::new(
                "seed",
                ParamType::Int,
                "a base seed; each request gets its own, derived from it and the prompt",
            ),
            Param::new("stop", strs(), "stop strings").default(json!([])),
            Param::new("n", ParamType::Int, "samples per prompt").default(1).at_least(1.0),
            Param::new(
                "thinking",
                ParamType::Bool,
                "thinking mode, sent as `chat_template_kwargs.enable_thinking`",
            ),
            Param::new(
                "chat_template_kwargs",
                any_map(),
                "values for the server's chat template",
            )
            .default(json!({})),
            Param::new(
                "extra_body",
                any_map(),
                "more request fields, passed through (e.g. `top_k`, `repetition_penalty`)",
            )
            .default(json!({})),
            Param::new(
                "keep_reasoning",
                ParamType::Bool,
                "keep the reasoning (`reasoning_content`) apart from the content",
            )
            .default(true),
            Param::new(
                "turns",
                ParamType::Enum(&["all", "last"]),
                "regenerate every assistant turn in order, or only the last reply",
            )
            .default("all"),
            Param::new(
                "truncated",
                ParamType::Enum(&["keep", "drop"]),
                "replies cut off by `max_tokens` (`finish_reason: length`): keep them, marked, \
                 or leave them out",
            )
            .default("keep"),
            Param::new(
                "request_timeout_s",
                ParamType::Int,
                "seconds one request may take",
            )
            .default(1800)
            .operational()
            .at_least(1.0),
            Param::new(
                "attempts",
                ParamType::Int,
                "tries per request before the stage gives up",
            )
            .default(8)
            .operational()
            .at_least(1.0),
            Param::new(
                "shard_rows",
                ParamType::Int,
                "save a shard after this many rows...",
            )
            .default(2000)
            .operational()
            .at_least(1.0),
            Param::new(
                "shard_seconds",
                ParamType::Float,
                "...or after this many seconds",
            )
            .default(60.0)
            .operational()
            .above(0.0),
            Param::new(
                "batch_size",
                ParamType::Int,
                "candle backend: conversations decoded together (one pass reads the weights once for all of them)",
            )
            .default(8)
            .at_least(1.0),
            Param::new(
                "device",
                ParamType::Enum(dflash_model::nn::device::CHOICES),
                "candle backend: where the model runs (`auto`: GPU 0 when this build and machine have one)",
            )
            .default("auto"),
        ]
    }

    fn check(&self, params: &Json, env: &CheckEnv<'_>) -> Vec<Issue> {
        let mut issues = Vec::new();
        if params["backend"] == "candle" {
            issues.extend(env.must_exist(
                params,
                "model",
                "with `backend: candle`, the model itself: a GGUF file or a Hugging Face model folder",
            ));
            return issues;
        }
        let endpoints = params["endpoints"].as_array().cloned().unwrap_or_default();
        if endpoints.is_empty() && params["launch"].is_null() {
            issues.push(Issue {
                at: Vec::new(),
                message: "generate has no server".into(),
                help: Some("list `endpoints:` of running servers, say how to `launch:` them, or decode in process with `backend: candle`".into()),
            });
        }
        for (i, url) in endpoints.iter().enumerate() {
            if !url.as_str().is_some_and(dflash_stage_api::is_http_url) {
                issues.push(
                    Issue::new("endpoints", format!("{url} is not an http(s) URL"))
                        .below(PathSeg::Index(i))
                        .help(
                            "endpoints are base URLs ending in /v1, e.g. http://10.0.0.5:30000/v1",
                        ),
                );
            }
        }
        if !params["launch"].is_null()
            && let Err(e) = serde_json::from_value::<launch::Launch>(params["launch"].clone())
        {
            issues.push(
                Issue::new("launch", format!("does not fit: {e}"))
                    .help("launch: {command: \"sglang ... --port {port}\", gpus: [0, 1]}"),
            );
        }
        issues
    }

    fn pin(&self, params: &Json, pinner: &dyn Pinner) -> Result<Vec<Pin>, StageError> {
        // A local model enters the key by content; a served one by its name (the servers'
        // own identity is recorded in the manifest).
        if params["backend"] != "candle" {
            return Ok(Vec::new());
        }
        let model = params["model"].as_str().unwrap_or_default();
        dflash_stage_api::pin_model(
            "model",
            model,
            pinner,
            "with `backend: candle`, `model:` is a GGUF file or a Hugging Face model folder",
        )
    }

    fn run(&self, ctx: &StageContext<'_>) -> Result<StageOutput, StageError> {
        let p: Params = ctx.params()?;
        let launch: Option<launch::Launch> = p
            .launch
            .as_ref()
            .map(|l| {
                serde_json::from_value(l.clone()).map_err(|e| {
                    StageError::new(format!("`launch` does not fit: {e}"))
                        .with_help("launch: {command: \"sglang ... --port {port}\", gpus: [0, 1]}")
                })
            })
            .transpose()?;
        if p.backend == "openai" && p.endpoints.is_empty() && launch.is_none() {
            return Err(StageError::new("generate has no server")
                .with_help("list `endpoints:` of running servers, or say how to `launch:` them"));
        }
        if p.n < 1 || p.max_tokens < 1 || p.max_in_flight < 1 {
            return Err(StageError::new(
                "`n`, `max_tokens` and `max_in_flight` must be at least 1",
            ));
        }
        let mut log = StageLog::open(ctx.log_path)?;
        let resumed = shards::resume(ctx)?;
        let tasks = tasks(ctx, &p)?;
        let todo: Vec<&Task> = tasks
            .iter()
            .filter(|t| !resumed.keys.contains(&t.key))
            .collect();
        log.line(&format!(
            "{} requests, {} answered by earlier attempts, {} to send",
            tasks.len(),
            tasks.len() - todo.len(),
            todo.len()
        ));

        let every = Duration::from_secs_f64(p.shard_seconds.max(0.01));
        let started = Instant::now();
        let tokens = AtomicU64::new(0);
        let answered = AtomicU64::new(0);
        let progress = Counters {
            tokens: &tokens,
            answered: &answered,
            total: todo.len() as u64,
            started,
        };
        // Where the in-process backend decoded (`cpu` or `cuda`), for `dflash estimate`.
        let mut ran_on = None;
        // The in-process backend's waves: how many, and the replies they decoded.
        let mut waves = Waves::default();
        let (reports, endpoints) = if p.backend == "candle" {
            let device = dflash_model::nn::device::select(&p.device)?;
            ran_on = Some(if device.is_cuda() { "cuda" } else { "cpu" });
            let mut local = Local::load(&ctx.cwd.join(&p.model), &template_kwargs(&p), &device)?;
            log.line(&format!(
                "loaded `{}` in {:.1} s",
                p.model,
                started.elapsed().as_secs_f64()
            ));
            let reports = with_writer(ctx, &resumed, p.shard_rows, every, |tx| {
                generate_locally(&mut local, &todo, &p, ctx, tx, &progress, &mut waves)
            })?;
            log.line(&format!(
                "{} waves of {:.1} replies on average (batch_size {}); {:.0}% of the prefills' \
                 positions padding; {:.1} s prefilling, {:.1} s in {} steps",
                waves.waves,
                waves.mean(),
                p.batch_size,
                100.0 * waves.padding_share(),
                waves.prefill_s,
                waves.decode_s,
                waves.steps
            ));
            (reports, Vec::new())
        } else {
            let servers = launch
                .as_ref()
                .map(|l| launch::start(l, &ctx.out_dir.join("_generate/servers"), ctx.cancel))
                .transpose()?;
            let mut urls = p.endpoints.clone();
            if let Some(s) = &servers {
                urls.extend(s.endpoints.iter().cloned());
            }
            let capacity = p.max_in_flight as usize;
            let endpoints = urls.iter().map(|u| Endpoint::new(u, capacity)).collect();
            let client = Client::new(
                endpoints,
                &p.model,
                request_body(&p),
                Duration::from_secs(p.request_timeout_s.max(1) as u64),
                p.attempts.max(1) as u32,
            )?;
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| StageError::new(format!("cannot start a runtime: {e}")))?;
            let served = rt.block_on(client.check_models())?;
            let reports = with_writer(ctx, &resumed, p.shard_rows, every, |tx| {
                rt.block_on(dispatch(&client, &todo, &p, ctx, tx, &progress))
            })?;
            drop(servers);
            let endpoints: Vec<Json> = client
                .endpoints
                .iter()
                .zip(&served)
                .map(|(e, (url, models))| {
                    json!({"url": url, "models": models, "sent": e.sent.load(Ordering::Relaxed),
                           "failed_attempts": e.errors.load(Ordering::Relaxed),
                           "drained": e.drained_times()})
                })
                .collect();
            (reports, endpoints)
        };

        let mut finish: BTreeMap<String, u64> = BTreeMap::new();
        let (mut rows, mut dropped, mut completion_tokens) = (0u64, 0u64, 0u64);
        for r in &reports {
            rows += r.rows;
            dropped += r.dropped;
            completion_tokens += r.completion_tokens;
            for (k, v) in &r.finish {
                *finish.entry(k.clone()).or_default() += v;
            }
        }
        let secs = started.elapsed().as_secs_f64();
        log.line(&format!(
            "sent {} requests in {secs:.1} s; {} tokens generated this attempt",
            todo.len(),
            tokens.load(Ordering::Relaxed)
        ));
        let servers = endpoints.len().max(1);
        let mut stats = Map::new();
        stats.insert("rows".into(), json!(rows));
        stats.insert("requests".into(), json!(tasks.len()));
        stats.insert("finish_reasons".into(), json!(finish));
        stats.insert("dropped_truncated".into(), json!(dropped));
        stats.insert("completion_tokens".into(), json!(completion_tokens));
        stats.insert("model".into(), json!(p.model));
        if !endpoints.is_empty() {
            stats.insert("endpoints".into(), Json::Array(endpoints));
        }
        stats.insert("shards".into(), json!(reports.len()));
        // This attempt's own throughput (a resumed run counts only what it generated), which
        // `dflash estimate` uses for later stages with the same model.
        stats.insert(
            "throughput".into(),
            json!({"backend": p.backend, "device": ran_on, "servers": servers,
                   "tokens": tokens.load(Ordering::Relaxed), "seconds": secs}),
        );
        if waves.waves > 0 {
            stats.insert("waves".into(), waves.stats(p.batch_size));
        }
        let summary = format!(
            "{rows} rows, {completion_tokens} tokens generated; finish: {}",
            finish
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        Ok(StageOutput {
            stats,
            summary: Some(summary),
        })
    }
}

/// The chat template kwargs: `chat_template_kwargs` with `thinking` as `enable_thinking`.
fn template_kwargs(p: &Params) -> Map<String, Json> {
    let mut kwargs = p.chat_template_kwargs.clone();
    if let Some(t) = p.thinking {
        kwargs.insert("enable_thinking".into(), json!(t));
    }
    kwargs
}

/// Sampling and template fields sent with every request.
fn request_body(p: &Params) -> Map<String, Json> {
    let mut body = p.extra_body.clone();
    let kwargs = template_kwargs(p);
    body.insert("max_tokens".into(), json!(p.max_tokens));
    body.insert("temperature".into(), json!(p.temperature));
    body.insert("top_p".into(), json!(p.top_p));
    if !p.stop.is_empty() {
        body.insert("stop".into(), json!(p.stop));
    }
    if !kwargs.is_empty() {
        body.insert("chat_template_kwargs".into(), Json::Object(kwargs));
    }
    body
}

/// One request: a prompt row and a sample number.
struct Task {
    key: String,
    split: String,
    sample: u32,
    row: Conversation,
}

/// Every request the inputs ask for, in input order.
fn tasks(ctx: &StageContext<'_>, p: &Params) -> Result<Vec<Task>, StageError> {
    let mut out = Vec::new();
    for input in ctx.inputs {
        for (split, files) in dataset::files(&input.dir)? {
            for f in files {
                for row in dataset::read_rows(&f)? {
                    let samples = p.n as u32;
                    if samples == 0 {
                        continue;
                    }
                    let task = |row: dataset::Conversation, sample: u32| Task {
                        key: format!("{}\u{1f}{}\u{1f}{sample}", row.source, row.id),
                        split: split.clone(),
                        sample,
                        row,
                    };
                    // Every sample but the last holds a copy; the last takes the row itself.
                    for sample in 0..samples - 1 {
                        out.push(task(row.clone(), sample));
                    }
                    out.push(task(row, samples - 1));
                }
            }
        }
    }
    if out.is_empty() {
        return Err(StageError::new("the inputs hold no conversations")
            .with_help("generate takes `download` or `mix` stages as inputs"));
    }
    Ok(out)
}

/// Send every task, at most the endpoints' capacity at once; answered rows go to `tx`.
async fn dispatch(
    client: &Client,
    todo: &[&Task],
    p: &Params,
    ctx: &StageContext<'_>,
    tx: &mpsc::Sender<Answered>,
    c: &Counters<'_>,
) -> Result<(), StageError> {
    // Four times the servers' slots: each endpoint's limit is held by the client's slots, and
    // requests waiting out a retry's backoff (a quarter to three quarters of a second at first)
    // must not leave the servers short of work.
    let mut stream = futures::stream::iter(todo.iter().map(|t| converse(client, t, p)))
        .buffer_unordered(client.capacity() * 4);
    // A tick wakes the loop when no answer comes (every request hanging), so Ctrl-C and
    // progress do not wait for one.
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            next = stream.next() => match next {
                None => return Ok(()),
                Some(Ok(a)) => {
                    c.add(&a);
                    if tx.send(a).is_err() {
                        // The writer stopped on an error of its own, which it reports.
                        return Ok(());
                    }
                }
                // Requests still in flight are abandoned: not saved, so a rerun sends them.
                Some(Err(e)) => return Err(e),
            },
            _ = tick.tick() => c.report(ctx, &endpoint_line(client)),
        }
        if ctx.cancel.is_cancelled() {
            return Err(StageError::cancelled());
        }
    }
}

/// What progress lines count.
struct Counters<'a> {
    tokens: &'a AtomicU64,
    answered: &'a AtomicU64,
    total: u64,
    started: Instant,
}

impl Counters<'_> {
    fn add(&self, a: &Answered) {
        self.tokens
            .fetch_add(a.completion_tokens, Ordering::Relaxed);
        self.answered.fetch_add(1, Ordering::Relaxed);
    }

    /// done/total, output tokens/s and ETA, then `extra`.
    fn report(&self, ctx: &StageContext<'_>, extra: &str) {
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        let done = self.answered.load(Ordering::Relaxed);
        let rate = done as f64 / secs;
        let eta = if rate > 0.0 {
            format!("{:.0} s", self.total.saturating_sub(done) as f64 / rate)
        } else {
            "?".into()
        };
        ctx.progress.set(
            done,
            Some(self.total),
            &format!(
                "{:.0} tokens/s, ETA {eta}{extra}",
                self.tokens.load(Ordering::Relaxed) as f64 / secs
            ),
        );
    }
}

/// Per-endpoint in-flight requests and errors.
fn endpoint_line(client: &Client) -> String {
    let per: Vec<String> = client
        .endpoints
        .iter()
        .map(|e| {
            format!(
                "{}{} in flight, {} errors",
                if e.is_drained() { "(drained) " } else { "" },
                e.in_flight.load(Ordering::Relaxed),
                e.errors.load(Ordering::Relaxed)
            )
        })
        .collect();
    format!("; {}", per.join(" | "))
}

/// Run `work` with a shard writer on its own thread; returns every shard's report.
fn with_writer(
    ctx: &StageContext<'_>,
    resumed: &shards::Resumed,
    shard_rows: i64,
    every: Duration,
    work: impl FnOnce(&mpsc::Sender<Answered>) -> Result<(), StageError>,
) -> Result<Vec<shards::ShardReport>, StageError> {
    let (tx, rx) = mpsc::channel::<Answered>();
    let (outcome, reports) = std::thread::scope(|scope| {
        let writer = scope.spawn(move || -> Result<Vec<shards::ShardReport>, StageError> {
            let mut w = ShardWriter::new(ctx, resumed, shard_rows.max(1) as usize, every);
            loop {
                match rx.recv_timeout(every.min(Duration::from_millis(500))) {
                    Ok(a) => w.push(a)?,
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
                w.tick()?;
            }
            // Everything answered is saved, even when the work failed or was cancelled.
            w.finish()?;
            Ok(w.reports)
        });
        let outcome = work(&tx);
        drop(tx);
        let reports = writer
            .join()
            .unwrap_or_else(|_| Err(StageError::new("the shard writer panicked")));
        (outcome, reports)
    });
    let reports = reports?;
    outcome?;
    Ok(reports)
}

/// What the in-process backend's waves decoded, and where their time went.
#[derive(Default)]
struct Waves {
    waves: u64,
    replies: u64,
    prompt_tokens: u64,
    padded_tokens: u64,
    steps: u64,
    prefill_s: f64,
    decode_s: f64,
}

impl Waves {
    fn mean(&self) -> f64 {
        self.replies as f64 / self.waves.max(1) as f64
    }

    fn add(&mut self, replies: usize, w: &local::WaveShape) {
        self.waves += 1;
        self.replies += replies as u64;
        self.prompt_tokens += w.prompt_tokens as u64;
        self.padded_tokens += w.padded_tokens as u64;
        self.steps += w.steps as u64;
        self.prefill_s += w.prefill_s;
        self.decode_s += w.decode_s;
    }

    /// The share of the prefills' positions that were padding.
    fn padding_share(&self) -> f64 {
        1.0 - self.prompt_tokens as f64 / self.padded_tokens.max(1) as f64
    }

    fn stats(&self, batch_size: i64) -> Json {
        let r = |x: f64| (x * 1000.0).round() / 1000.0;
        json!({"count": self.waves, "replies": self.replies, "batch_size": batch_size,
               "prompt_tokens": self.prompt_tokens, "padded_tokens": self.padded_tokens,
               "padding_share": r(self.padding_share()), "steps": self.steps,
               "prefill_s": r(self.prefill_s), "decode_s": r(self.decode_s)})
    }
}

/// How many waves' worth of conversations the in-process backend looks at to form a wave.
const LOOKAHEAD_WAVES: usize = 4;

/// A wave's members out of `pool`: the `size` with the largest keys (ties: the one that joined
/// first), the rest kept in their order. A wave's prompts are left-padded to its longest, and
/// every row computes every column of the prefill and attends over every column in each step,
/// so prompts of like length should decode together: the key is the context's length, longest
/// first. A later turn's context holds the turns before it, so conversations that go on are
/// among the longest and go early. (Putting every conversation with replies still to come
/// first, whatever its length, took 82.0 s where this took 46.4 and FIFO 110.8: 128 ShareGPT
/// rows, 16 tokens a reply, waves of 32, on a 2-core CPU; padding 72% and 51% of the prefills'
/// positions.)
fn pick_wave<K: Ord + Copy, T>(pool: &mut Vec<(K, T)>, size: usize) -> Vec<(K, T)> {
    if pool.len() <= size {
        return std::mem::take(pool);
    }
    let mut order: Vec<usize> = (0..pool.len()).collect();
    // Longest first; among equals, the one that joined the pool first.
    order.sort_by_key(|&i| std::cmp::Reverse(pool[i].0));
    let mut chosen = vec![false; pool.len()];
    for &i in &order[..size] {
        chosen[i] = true;
    }
    let (mut wave, mut rest) = (
        Vec::with_capacity(size),
        Vec::with_capacity(pool.len() - size),
    );
    for (item, keep) in std::mem::take(pool).into_iter().zip(chosen) {
        if keep {
            wave.push(item);
        } else {
            rest.push(item);
        }
    }
    *pool = rest;
    wave
}

/// Generate every task in-process, in waves of at most `batch_size` replies decoded together.
/// A wave takes conversations still going (their next reply) and new ones, so waves stay full
/// while tasks remain: multi-turn rows would otherwise leave a batch's later waves nearly
/// empty, each costing a full wave's steps. Out of the next `LOOKAHEAD_WAVES` waves' worth it
/// takes those of like length ([`pick_wave`]). Rows are sent as their conversations finish.
fn generate_locally(
    local: &mut Local,
    todo: &[&Task],
    p: &Params,
    ctx: &StageContext<'_>,
    tx: &mpsc::Sender<Answered>,
    c: &Counters<'_>,
    waves: &mut Waves,
) -> Result<(), StageError> {
    let sampling = local::Sampling {
        max_tokens: p.max_tokens as usize,
        temperature: p.temperature,
        top_p: p.top_p,
        stop: &p.stop,
    };
    let size = p.batch_size.max(1) as usize;
    let mut tasks = todo.iter();
    // Conversations waiting for their next reply, each with its key for `pick_wave`.
    let mut pool: Vec<(usize, Regeneration<'_>)> = Vec::new();
    // `false` once the writer has stopped (on an error of its own, which it reports).
    let send = |a: Answered| {
        c.add(&a);
        tx.send(a).is_ok()
    };
    loop {
        while pool.len() < size * LOOKAHEAD_WAVES {
            let Some(t) = tasks.next() else { break };
            let mut r = Regeneration::new(t, p);
            match wave_key(&mut r) {
                Some(key) => pool.push((key, r)),
                None => {
                    if !send(r.done()) {
                        return Ok(());
                    }
                }
            }
        }
        let members = pick_wave(&mut pool, size);
        if members.is_empty() {
            return Ok(());
        }
        let convos: Vec<&[Message]> = members.iter().map(|(_, r)| r.convo.as_slice()).collect();
        let seeds: Vec<u64> = members.iter().map(|(_, r)| r.seed.unwrap_or(0)).collect();
        let (replies, shape) = local.reply_batch(&convos, &sampling, &seeds, ctx.cancel)?;
        waves.add(convos.len(), &shape);
        drop(convos);
        for ((_, mut r), reply) in members.into_iter().zip(replies) {
            let finished = match reply {
                Ok(reply) => {
                    if r.reply(reply) {
                        match wave_key(&mut r) {
                            Some(key) => {
                                pool.push((key, r));
                                continue;
                            }
                            None => r.done(),
                        }
                    } else {
                        r.done()
                    }
                }
                Err(why) => r.refused(&why),
            };
            if !send(finished) {
                return Ok(());
            }
        }
        c.report(ctx, "");
    }
}

/// Move `r` to its next reply and give its key for [`pick_wave`]: the characters of its
/// context (how long its prompt is, near enough to group prompts of like length without
/// rendering the template); `None` when every reply is in.
fn wave_key(r: &mut Regeneration<'_>) -> Option<usize> {
    Some(r.context()?.0.iter().map(|m| m.content.len()).sum())
}

/// The messages sent for the conversation so far.
fn wire(messages: &[Message]) -> Vec<Json> {
    messages
        .iter()
        .map(|m| json!({"role": m.role, "content": m.content}))
        .collect()
}

/// One task's conversation being regenerated turn by turn; shared by the backends.
struct Regeneration<'a> {
    t: &'a Task,
    p: &'a Params,
    /// Where replies are generated (indices into the original messages).
    points: Vec<usize>,
    next: usize,
    cursor: usize,
    convo: Vec<Message>,
    finish: String,
    tokens: u64,
    /// The per-request seed.
    seed: Option<u64>,
}

impl<'a> Regeneration<'a> {
    fn new(t: &'a Task, p: &'a Params) -> Self {
        let original = &t.row.messages;
        // Replies are generated in place of every assistant turn that answers something, and
        // after a conversation that ends waiting for one.
        let mut points: Vec<usize> = original
            .iter()
            .enumerate()
            .filter(|(i, m)| *i > 0 && m.role == "assistant")
            .map(|(i, _)| i)
            .collect();
        if original.last().is_some_and(|m| m.role != "assistant") {
            points.push(original.len());
        }
        if p.turns == "last" {
            points = points.split_off(points.len().saturating_sub(1));
        }
        Self {
            t,
            p,
            points,
            next: 0,
            cursor: 0,
            convo: Vec::new(),
            finish: "stop".into(),
            tokens: 0,
            seed: p
                .seed
                .map(|s| xxh3_64(format!("{s}\u{1f}{}", t.key).as_bytes())),
        }
    }

    /// The conversation to generate the next reply from, and the request's key; `None` when
    /// every reply is in.
    fn context(&mut self) -> Option<(&[Message], String)> {
        let original = &self.t.row.messages;
        while self.next < self.points.len() {
            let point = self.points[self.next];
            // Original non-assistant turns (and, with `turns: last`, the original assistant
            // turns before the reply) make the context.
            for m in &original[self.cursor..point] {
                if m.role != "assistant" || self.p.turns == "last" {
                    self.convo.push(m.clone());
                }
            }
            self.cursor = (point + 1).min(original.len());
            self.next += 1;
            if self.convo.last().is_some_and(|m| m.role != "assistant") {
                let key = format!("{}#{}", self.t.key, self.next - 1);
                return Some((&self.convo, key));
            }
        }
        None
    }

    /// Add a reply; `false` when the conversation ends here (a cut-off reply).
    fn reply(&mut self, r: Reply) -> bool {
        self.tokens += r.completion_tokens;
        self.finish.clone_from(&r.finish_reason);
        self.convo.push(Message {
            role: "assistant".into(),
            content: r.content,
            reasoning: if self.p.keep_reasoning {
                r.reasoning
            } else {
                None
            },
            tool_calls: None,
        });
        // Later turns would answer a broken reply.
        self.finish != "length"
    }

    /// The request itself was refused: saved as an error row, so it is not retried forever
    /// and the count shows it.
    fn refused(self, why: &str) -> Answered {
        let mut row = self.t.row.clone();
        row.id = out_id(self.t, self.p);
        row.finish_reason = Some("error".into());
        row.metadata = Some(json!({"error": why}).to_string());
        Answered {
            key: self.t.key.clone(),
            split: self.t.split.clone(),
            row: Some(row),
            completion_tokens: self.tokens,
        }
    }

    fn done(mut self) -> Answered {
        let keep = !(self.finish == "length" && self.p.truncated == "drop");
        let t = self.t;
        let row = keep.then(|| Conversation {
            id: out_id(t, self.p),
            source: t.row.source.clone(),
            category: t.row.category.clone(),
            messages: std::mem::take(&mut self.convo),
            tools: t.row.tools.clone(),
            metadata: t.row.metadata.clone(),
            finish_reason: Some(self.finish.clone()),
        });
        Answered {
            key: t.key.clone(),
            split: t.split.clone(),
            row,
            completion_tokens: self.tokens,
        }
    }
}

/// Regenerate one task on the OpenAI-compatible servers.
async fn converse(client: &Client, t: &Task, p: &Params) -> Result<Answered, StageError> {
    let mut r = Regeneration::new(t, p);
    loop {
        let seed = r.seed;
        let Some((convo, key)) = r.context() else {
            return Ok(r.done());
        };
        match client.complete(&wire(convo), seed, &key).await {
            Ok(reply) => {
                if !r.reply(reply) {
                    return Ok(r.done());
                }
            }
            Err(Failure::Refused(why)) => return Ok(r.refused(&why)),
            Err(Failure::Exhausted(why)) => {
                return Err(StageError::new(format!("a request failed for good: {why}"))
                    .with_help("the rows saved so far are kept; run again to send the rest"));
            }
        }
    }
}

fn out_id(t: &Task, p: &Params) -> String {
    if p.n > 1 {
        format!("{}-s{}", t.row.id, t.sample)
    } else {
        t.row.id.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::pick_wave;

    #[test]
    fn a_wave_takes_the_longest_contexts_and_leaves_the_rest_in_order() {
        let mut pool: Vec<(usize, char)> =
            vec![(5, 'a'), (90, 'b'), (7, 'c'), (90, 'd'), (60, 'e')];
        let wave = pick_wave(&mut pool, 3);
        // The three longest, in the order they joined (a tie keeps that order too).
        assert_eq!(wave, vec![(90, 'b'), (90, 'd'), (60, 'e')]);
        assert_eq!(pool, vec![(5, 'a'), (7, 'c')]);
        // A pool no larger than a wave goes whole.
        let wave = pick_wave(&mut pool, 3);
        assert_eq!(wave, vec![(5, 'a'), (7, 'c')]);
        assert!(pool.is_empty());
        assert!(pick_wave(&mut pool, 3).is_empty());
    }
}
