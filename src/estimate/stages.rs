//! Sizing each stage kind: rows and tokens in and out, the work, the storage, and the time on the
//! chosen hardware. One function per kind; anything dflash cannot size says so in its notes.

use dflash_model::{DrafterShape, ModelShape};
use serde_json::Value;

use super::hardware::{Assumptions, DECODE_ANCHOR_PARAMS};
use super::render::{bytes, count, hours};
use super::{Alternative, Basis, Choice, Data, Figure, Options, Resource, StageEstimate};
use crate::pipeline::StageSpec;
use crate::plan::State;
use crate::store::manifest::Manifest;

/// SmolLM2-135M, the model the CPU decode rate was measured with.
const CPU_ANCHOR_PARAMS: f64 = 135e6;
/// Bytes a tokenized token takes (int32 id + int8 mask).
const TOKENIZED_BYTES: f64 = 5.0;
/// The most bytes of local files `estimate` reads to count a download's rows and turns.
const LOCAL_COUNT_BYTES: u64 = 64 << 20;
/// Prompt tokens per row when nothing better is known.
const DEFAULT_PROMPT_TOKENS: f64 = 250.0;
/// A PCIe 5 x16 link's usable bandwidth, bytes/s, and NVLink 4's per GPU.
const PCIE_BYTES_PER_S: f64 = 50e9;
const NVLINK_BYTES_PER_S: f64 = 450e9;

pub(super) struct Sizer<'a> {
    pub opts: &'a Options,
    pub assumptions: &'a mut Assumptions,
    /// Every committed `generate` artifact in the store.
    pub generated: &'a [Manifest],
    pub warnings: Vec<String>,
    pub alternatives: Vec<Alternative>,
}

/// A stage's estimate, being filled in.
fn blank(spec: &StageSpec, state: State) -> StageEstimate {
    StageEstimate {
        id: spec.id.clone(),
        kind: spec.kind.clone(),
        state: match state {
            State::Done => "done",
            State::Partial => "partial",
            State::Pending => "pending",
        }
        .into(),
        rows: None,
        tokens: None,
        tokens_are: "",
        flops: None,
        storage_bytes: None,
        resource: Resource::Unknown,
        gpus: 0,
        gpu_hours: 0.0,
        wall_hours: None,
        cost: 0.0,
        notes: Vec::new(),
        data: Data::default(),
    }
}

fn stat(m: Option<&Manifest>, key: &str) -> Option<f64> {
    m.and_then(|m| m.stats.get(key)).and_then(Value::as_f64)
}

fn declared(spec: &StageSpec, key: &str) -> Option<Figure> {
    spec.expect
        .get(key)
        .and_then(Value::as_f64)
        .map(|v| Figure::new(v, Basis::Declared))
}

fn param(spec: &StageSpec, key: &str) -> Option<f64> {
    spec.params.get(key).and_then(Value::as_f64)
}

/// The first upstream figure the accessor finds (most stages have one input).
fn upstream(ups: &[&Data], get: impl Fn(&Data) -> Option<Figure>) -> Option<Figure> {
    ups.iter().find_map(|d| get(d)).map(|f| Figure {
        basis: f.basis.weaker(Basis::Upstream),
        ..f
    })
}

fn upstream_rows(ups: &[&Data]) -> Option<Figure> {
    let rows: Vec<Figure> = ups.iter().filter_map(|d| d.rows).collect();
    if rows.is_empty() || rows.len() < ups.len() {
        return None;
    }
    let basis = rows.iter().fold(Basis::Upstream, |b, f| b.weaker(f.basis));
    Some(Figure::new(rows.iter().map(|f| f.value).sum(), basis))
}

fn stored_bytes(m: Option<&Manifest>) -> Option<Figure> {
    m.map(|m| Figure::new(m.files.iter().map(|f| f.size as f64).sum(), Basis::Measured))
}

impl Sizer<'_> {
    pub fn size(
        &mut self,
        spec: &StageSpec,
        ups: &[&Data],
        up_kinds: &[&str],
        state: State,
        done: Option<&Manifest>,
    ) -> StageEstimate {
        let mut s = blank(spec, state);
        match spec.kind.as_str() {
            "download" | "mix" => self.dataset(spec, ups, done, &mut s),
            "generate" => self.generate(spec, ups, done, &mut s),
            "tokenize" => self.tokenize(spec, ups, done, &mut s),
            "train" => self.train(spec, ups, done, &mut s),
            "bench" => self.bench(spec, ups, up_kinds, &mut s),
            _ => {
                s.data.rows = declared(spec, "rows");
                s.rows = s.data.rows;
                s.notes.push(format!(
                    "dflash cannot size a `{}` stage; declare its output under `expect:`",
                    spec.kind
                ));
            }
        }
        if let Some(m) = done {
            s.gpu_hours = 0.0;
            s.cost = 0.0;
            s.wall_hours = Some(0.0);
            s.notes.insert(
                0,
                format!(
                    "done: took {} on {}",
                    hours(m.lineage.seconds / 3600.0),
                    m.lineage.host
                ),
            );
        } else {
            s.cost = s.gpu_hours * self.opts.price;
            if let (Some(b), Some(w)) = (self.opts.budget_hours, s.wall_hours)
                && w > b
            {
                self.warnings.push(format!(
                    "`{}` takes {} of wall-clock, over the budget of {} (--budget)",
                    s.id,
                    hours(w),
                    hours(b)
                ));
            }
        }
        s
    }

    fn text_bytes(&self, rows: f64, tokens_per_row: f64) -> f64 {
        rows * (tokens_per_row * self.assumptions.get("bytes_per_text_token") + 64.0)
    }

    /// `download` and `mix`: rows and prompt sizes; their bytes; no GPU. A download of local
    /// files up to [`LOCAL_COUNT_BYTES`] is counted in them.
    fn dataset(
        &mut self,
        spec: &StageSpec,
        ups: &[&Data],
        done: Option<&Manifest>,
        s: &mut StageEstimate,
    ) {
        s.resource = if spec.kind == "download" {
            Resource::Network
        } else {
            Resource::Cpu
        };
        let from_params = if spec.kind == "download" {
            param(spec, "limit").map(|v| Figure::new(v, Basis::Param))
        } else {
            let up = upstream_rows(ups);
            match (param(spec, "total"), up) {
                (Some(t), Some(u)) if u.value < t => Some(u),
                (Some(t), _) => Some(Figure::new(t, Basis::Param)),
                (None, u) => u,
            }
        };
        // A done download's manifest has its user turns (what a multi-turn set asks: MT-Bench's
        // 80 rows are 160 turns to decode); otherwise local files are counted as the stage
        // will map them (small ones: a benchmark set, not a corpus).
        let recorded = stat(done, "rows").zip(stat(done, "user_turns"));
        let counted = (spec.kind == "download" && recorded.is_none())
            .then(|| {
                dflash_stage_download::local_counts(
                    &spec.params,
                    &self.opts.base,
                    LOCAL_COUNT_BYTES,
                )
            })
            .flatten();
        let rows = stat(done, "rows")
            .map(|v| Figure::new(v, Basis::Measured))
            .or_else(|| declared(spec, "rows"))
            .or(from_params)
            .or_else(|| counted.map(|c| Figure::new(c.rows as f64, Basis::Measured)));
        s.data.user_turns = recorded
            .or_else(|| counted.map(|c| (c.rows as f64, c.user_turns as f64)))
            .map(|(all_rows, turns)| {
                let kept = rows.map_or(1.0, |r| (r.value / all_rows.max(1.0)).min(1.0));
                Figure::new(turns * kept, Basis::Measured)
            });
        // mix measures prompt lengths in characters; ~4 per token.
        let measured_prompt = done
            .and_then(|m| m.stats.get("before"))
            .and_then(|b| b.pointer("/prompt_chars/p50"))
            .and_then(Value::as_f64)
            .map(|c| Figure::new(c / 4.0, Basis::Measured));
        let prompt = measured_prompt
            .or_else(|| declared(spec, "prompt_tokens"))
            .or_else(|| upstream(ups, |d| d.prompt_tokens))
            .unwrap_or(Figure::new(DEFAULT_PROMPT_TOKENS, Basis::Assumed));
        s.rows = rows;
        s.data.rows = rows;
        s.data.prompt_tokens = Some(prompt);
        s.data.output_tokens = declared(spec, "output_tokens");
        s.storage_bytes = stored_bytes(done).or_else(|| {
            rows.map(|r| {
                Figure::new(
                    self.text_bytes(r.value, prompt.value),
                    r.basis.weaker(prompt.basis),
                )
            })
        });
        if rows.is_none() {
            s.notes
                .push("rows unknown: declare `expect: {rows: N}` (or set `limit`)".into());
        }
        if spec.kind == "download" {
            s.notes.push("network-bound; not timed".into());
        } else {
            s.wall_hours = Some(0.0);
        }
    }

    fn shape(&mut self, id: &str, reference: &str) -> Option<ModelShape> {
        match ModelShape::locate(reference, &self.opts.base) {
            Ok(m) => Some(m),
            Err(e) => {
                let help = e.help.map(|h| format!(" ({h})")).unwrap_or_default();
                self.warnings.push(format!(
                    "`{id}`: cannot size the model: {}{help}",
                    e.message
                ));
                None
            }
        }
    }

    /// Output tokens per row of the latest earlier `generate` artifact asked the same way as
    /// `spec` (model, `max_tokens`, `turns`, `n`, temperature): an expansion answered with the
    /// first batch's settings is sized by the first batch's replies (a 135M model's greedy
    /// replies run to `max_tokens` far more often than the half assumed otherwise).
    fn measured_output(&self, spec: &StageSpec) -> Option<(f64, String)> {
        // The model by name as the stats record it (a model file enters the key by its bytes,
        // not in the params); the rest as the key has them.
        let asked = |p: &Value| ["max_tokens", "turns", "n", "temperature"].map(|k| p[k].clone());
        let (model, want) = (spec.params["model"].as_str(), asked(&spec.params));
        self.generated
            .iter()
            .filter(|m| m.stats.get("model").and_then(Value::as_str) == model)
            .filter(|m| asked(&m.fingerprint.params) == want)
            .max_by(|a, b| a.lineage.started.cmp(&b.lineage.started))
            .and_then(|m| {
                let tokens = m.stats.get("completion_tokens")?.as_f64()?;
                let rows = m.stats.get("rows")?.as_f64()?;
                (rows > 0.0).then(|| {
                    (
                        tokens / rows,
                        format!(
                            "measured: generate artifact {} asked the same way ({} tokens over {} rows)",
                            m.key.0.short(12),
                            count(tokens),
                            count(rows)
                        ),
                    )
                })
            })
    }

    /// Output tokens/s of one server (or the in-process backend) for `model`, measured by the
    /// latest earlier `generate` artifact of the same model and backend.
    /// `device` tells the in-process backend's runs apart (`cpu`, `cuda`; artifacts from before
    /// it was recorded count as `cpu`).
    fn measured_decode(
        &self,
        model: &str,
        backend: &str,
        device: Option<&str>,
    ) -> Option<(f64, String)> {
        self.generated
            .iter()
            .filter(|m| m.stats.get("model").and_then(Value::as_str) == Some(model))
            .filter(|m| m.stats["throughput"]["backend"].as_str() == Some(backend))
            .filter(|m| {
                device.is_none()
                    || m.stats["throughput"]["device"].as_str().unwrap_or("cpu") == device.unwrap_or_default()
            })
            .max_by(|a, b| a.lineage.started.cmp(&b.lineage.started))
            .and_then(|m| {
                let t = &m.stats["throughput"];
                let tokens = t["tokens"].as_f64()?;
                let seconds = t["seconds"].as_f64()?;
                let servers = t["servers"].as_f64().unwrap_or(1.0).max(1.0);
                let rate = tokens / seconds / servers;
                (rate.is_finite() && rate > 0.0).then(|| {
                    (
                        rate,
                        format!(
                            "measured: generate artifact {} ({} tokens in {:.0} s on {servers} server(s), {})",
                            m.key.0.short(12),
                            count(tokens),
                            seconds,
                            m.lineage.host
                        ),
                    )
                })
            })
    }

    fn generate(
        &mut self,
        spec: &StageSpec,
        ups: &[&Data],
        done: Option<&Manifest>,
        s: &mut StageEstimate,
    ) {
        let n = param(spec, "n").unwrap_or(1.0).max(1.0);
        let rows = stat(done, "rows")
            .map(|v| Figure::new(v, Basis::Measured))
            .or_else(|| declared(spec, "rows"))
            .or_else(|| upstream_rows(ups).map(|r| Figure::new(r.value * n, r.basis)));
        let prompt = declared(spec, "prompt_tokens")
            .or_else(|| upstream(ups, |d| d.prompt_tokens))
            .unwrap_or(Figure::new(DEFAULT_PROMPT_TOKENS, Basis::Assumed));
        let max_tokens = param(spec, "max_tokens").unwrap_or(4096.0);
        let output = match (stat(done, "completion_tokens"), rows) {
            (Some(t), Some(r)) if r.value > 0.0 => Figure::new(t / r.value, Basis::Measured),
            _ => declared(spec, "output_tokens")
                .or_else(|| upstream(ups, |d| d.output_tokens))
                .or_else(|| {
                    let (per_row, source) = self.measured_output(spec)?;
                    s.notes.push(format!("output tokens per row {per_row:.0}, {source}"));
                    Some(Figure::new(per_row, Basis::Measured))
                })
                .unwrap_or_else(|| {
                    s.notes.push(format!(
                        "output length assumed to be half of max_tokens ({max_tokens}); declare `expect: {{output_tokens: N}}`"
                    ));
                    Figure::new(max_tokens / 2.0, Basis::Assumed)
                }),
        };
        s.rows = rows;
        s.data = Data {
            rows,
            user_turns: None,
            prompt_tokens: Some(prompt),
            output_tokens: Some(output),
            tokens: None,
            trained_share: None,
        };
        s.tokens_are = "output tokens";
        let Some(rows) = rows else {
            s.notes
                .push("rows unknown: declare `expect: {rows: N}` upstream".into());
            return;
        };
        let total_out = rows.times(output);
        s.tokens = Some(total_out);
        s.storage_bytes = stored_bytes(done).or_else(|| {
            Some(Figure::new(
                self.text_bytes(rows.value, prompt.value + output.value),
                total_out.basis,
            ))
        });
        let model_ref = spec.params["model"].as_str().unwrap_or_default().to_owned();
        let Some(model) = self.shape(&s.id, &model_ref) else {
            return;
        };
        let p = model.parameters() as f64;
        let backend = spec.params["backend"].as_str().unwrap_or("openai");
        // `auto` takes GPU 0 where there is one, and an estimate is for `--gpus`.
        let on_gpu = backend == "candle" && spec.params["device"].as_str() != Some("cpu");
        if on_gpu {
            if let Some((rate, source)) = self.measured_decode(&model_ref, backend, Some("cuda")) {
                let at_anchor = rate * p / CPU_ANCHOR_PARAMS;
                let _ = self.assumptions.set(
                    "gpu_candle_decode_tokens_per_s",
                    at_anchor.round(),
                    source,
                );
            }
            let rate =
                self.assumptions.get("gpu_candle_decode_tokens_per_s") * CPU_ANCHOR_PARAMS / p;
            s.resource = Resource::Gpu;
            s.gpus = 1;
            s.gpu_hours = total_out.value / rate / 3600.0;
            s.wall_hours = Some(s.gpu_hours);
            s.notes.push(format!(
                "in-process on one GPU at {} tokens/s ({} parameters; the candle backend uses GPU 0 only)",
                count(rate),
                count(p)
            ));
            return;
        }
        let measured =
            self.measured_decode(&model_ref, backend, (backend == "candle").then_some("cpu"));
        if backend == "candle" {
            s.resource = Resource::Cpu;
            if let Some((rate, source)) = measured {
                let at_anchor = rate * p / CPU_ANCHOR_PARAMS;
                let _ = self.assumptions.set(
                    "cpu_decode_tokens_per_s",
                    (at_anchor * 10.0).round() / 10.0,
                    source,
                );
            }
            let rate = self.assumptions.get("cpu_decode_tokens_per_s") * CPU_ANCHOR_PARAMS / p;
            s.wall_hours = Some(total_out.value / rate / 3600.0);
            s.notes.push(format!(
                "in-process on CPU at {} tokens/s ({} parameters)",
                count(rate),
                count(p)
            ));
            return;
        }
        let launched = spec.params["launch"]
            .get("gpus")
            .and_then(Value::as_array)
            .map(Vec::len);
        let servers = launched
            .or_else(|| spec.params["endpoints"].as_array().map(Vec::len))
            .unwrap_or(1)
            .max(1) as f64;
        let hw = &self.opts.hardware;
        if let Some(l) = launched
            && l as u32 > hw.count
        {
            self.warnings.push(format!(
                "`{}` launches {l} servers but --gpus gives {hw}",
                s.id
            ));
        }
        let (rate_8b, source) = match measured {
            // A measured rate is for this model already; express it at 8B for the table.
            Some((rate, source)) => (rate * p / DECODE_ANCHOR_PARAMS, source),
            None => (self.assumptions.get("decode_tokens_per_s"), String::new()),
        };
        if !source.is_empty() {
            let _ = self
                .assumptions
                .set("decode_tokens_per_s", rate_8b.round(), source);
        }
        let decode = rate_8b * DECODE_ANCHOR_PARAMS / p;
        let peak = hw.gpu.tflops * 1e12;
        let prefill_s = rows.value * model.forward_flops(prompt.value)
            / (peak * self.assumptions.get("prefill_mfu"));
        let decode_s = total_out.value / decode;
        let gpu_s = prefill_s + decode_s;
        s.resource = Resource::Gpu;
        s.gpus = servers as u32;
        s.flops = Some(rows.value * model.forward_flops(prompt.value + output.value));
        s.gpu_hours = gpu_s / 3600.0;
        s.wall_hours = Some(gpu_s / servers / 3600.0);
        s.notes.push(format!(
            "{servers} server(s) of {} at {} output tokens/s each ({} parameters, bf16)",
            hw.gpu.name,
            count(decode),
            count(p)
        ));
        let weights = 2.0 * p;
        let memory = hw.gpu.memory_gb * 1e9;
        // What one sequence keeps while it decodes, and how many fit beside the weights: the
        // servers' batch. A hybrid's Gated DeltaNet state is per layer, not per token.
        let context = (prompt.value + output.value).ceil() as u64;
        let per_seq = model.decode_state_bytes(context) as f64;
        if per_seq > 0.0 {
            let fixed = model
                .linear
                .as_ref()
                .map(|l| {
                    format!(
                        ", {} of it the Gated DeltaNet layers' state, the same at any length",
                        bytes((l.count * l.state_bytes()) as f64)
                    )
                })
                .unwrap_or_default();
            let room = (0.9 * memory - weights).max(0.0);
            s.notes.push(format!(
                "a sequence of {context} tokens keeps {} while decoding (bf16 keys and values{fixed}): {} fit beside the weights on one {}",
                bytes(per_seq),
                count((room / per_seq).floor()),
                hw.gpu.name
            ));
        }
        let min_tp = (1..=8u32)
            .map(|t| 1u32 << t.trailing_zeros().min(3))
            .find(|&t| weights <= 0.9 * memory * f64::from(t))
            .unwrap_or(16);
        if weights > 0.9 * memory {
            self.warnings.push(format!(
                "`{}`: the model's bf16 weights ({}) do not fit one {} ({:.0} GB) with room for the KV cache; each server needs tensor parallelism over at least {min_tp} GPUs",
                s.id,
                bytes(weights),
                hw.gpu.name,
                hw.gpu.memory_gb
            ));
        }
        if hw.count >= 2 {
            let eff = self.assumptions.get("tp_efficiency");
            let link = if hw.gpu.nvlink { "NVLink" } else { "PCIe" };
            let mut choices = Vec::new();
            let mut tp = 1u32;
            while tp <= hw.count {
                if weights <= 0.9 * memory * f64::from(tp) {
                    let kept = eff.powf(f64::from(tp).log2());
                    let wall = gpu_s / (f64::from(hw.count) * kept);
                    let n = hw.count / tp;
                    choices.push(Choice {
                        label: if tp == 1 {
                            format!("{n} single-GPU servers (data parallel)")
                        } else {
                            format!("{n} server{} x TP{tp}", if n == 1 { "" } else { "s" })
                        },
                        storage_bytes: 0.0,
                        gpu_hours: wall * f64::from(hw.count) / 3600.0,
                        wall_hours: wall / 3600.0,
                        chosen: tp == 1 && servers as u32 == hw.count,
                        note: if tp == 1 {
                            "no cross-GPU traffic; a dead server costs 1/N".into()
                        } else {
                            format!("{:.0}% per-GPU throughput kept over {link}", kept * 100.0)
                        },
                    });
                }
                tp *= 2;
            }
            if choices.len() > 1 {
                self.alternatives.push(Alternative {
                    stage: s.id.clone(),
                    question: format!("generation on {hw}: single-GPU servers or tensor parallel"),
                    choices,
                });
            }
        }
    }

    fn tokenize(
        &mut self,
        spec: &StageSpec,
        ups: &[&Data],
        done: Option<&Manifest>,
        s: &mut StageEstimate,
    ) {
        s.resource = Resource::Cpu;
        let rows = stat(done, "rows")
            .map(|v| Figure::new(v, Basis::Measured))
            .or_else(|| declared(spec, "rows"))
            .or_else(|| upstream_rows(ups));
        let prompt = upstream(ups, |d| d.prompt_tokens);
        let output = upstream(ups, |d| d.output_tokens);
        let max_len = param(spec, "max_length");
        let derived = match (prompt, output) {
            (Some(p), Some(o)) => Some(Figure::new(
                (p.value + o.value).min(max_len.unwrap_or(f64::INFINITY)),
                p.basis.weaker(o.basis),
            )),
            (Some(p), None) => Some(p),
            _ => None,
        };
        let tokens = stat(done, "mean_length")
            .map(|v| Figure::new(v, Basis::Measured))
            .or_else(|| declared(spec, "tokens"))
            .or(derived);
        let share = stat(done, "trained_share")
            .map(|v| Figure::new(v, Basis::Measured))
            .or_else(|| match (prompt, output) {
                (Some(p), Some(o)) if p.value + o.value > 0.0 => Some(Figure::new(
                    o.value / (p.value + o.value),
                    p.basis.weaker(o.basis),
                )),
                _ => None,
            });
        s.rows = rows;
        s.data = Data {
            rows,
            user_turns: None,
            prompt_tokens: prompt,
            output_tokens: output,
            tokens,
            trained_share: share,
        };
        s.tokens_are = "tokens";
        if let (Some(r), Some(t)) = (rows, tokens) {
            let total = r.times(t);
            s.tokens = Some(total);
            s.storage_bytes = stored_bytes(done)
                .or_else(|| Some(Figure::new(total.value * TOKENIZED_BYTES, total.basis)));
            let rate =
                self.assumptions.get("tokenize_tokens_per_s") * self.assumptions.get("cpu_cores");
            s.wall_hours = Some(total.value / rate / 3600.0);
        } else {
            s.notes.push("sizes unknown upstream".into());
        }
    }

    /// In-process bench: every prompt set's turns decoded by every method to `max_new_tokens`
    /// (answers that stop sooner make it shorter), one token per target step for
    /// autoregressive decoding and tau tokens per round for the speculative methods, at the
    /// taus the story's trained drafter measured and the share of `max_new_tokens` its answers
    /// took (`--assume bench_tau_...=1` and `bench_answer_fraction=1` bound it from above, as
    /// for a drafter not yet trained). A round costs a multiple of a step, measured
    /// on an H100.
    fn bench(&mut self, spec: &StageSpec, ups: &[&Data], up_kinds: &[&str], s: &mut StageEstimate) {
        if spec.params["endpoints"]
            .as_object()
            .is_some_and(|e| !e.is_empty())
        {
            s.notes
                .push("endpoint mode: the servers' speed decides; not sized".into());
            return;
        }
        if spec.params["device"].as_str() == Some("cpu") {
            s.notes.push("on CPU: not sized".into());
            return;
        }
        let Some(target) = spec.params["target"]
            .as_str()
            .and_then(|t| self.shape(&s.id, t))
        else {
            return;
        };
        let prompts = param(spec, "prompts").unwrap_or(80.0);
        let max_new = param(spec, "max_new_tokens").unwrap_or(256.0);
        // Drafters come from `train`, or a `command` stage that copies an exported one in
        // (pipelines/smollm2-bench.yaml); prompt sets from the data stages.
        let is_drafter = |kind: &str| matches!(kind, "train" | "command");
        let drafters = up_kinds.iter().filter(|k| is_drafter(k)).count() as f64;
        let mut turns = 0.0;
        let mut known = true;
        let mut counted = false;
        for (d, kind) in ups.iter().zip(up_kinds) {
            if is_drafter(kind) {
                continue;
            }
            match (d.rows, d.user_turns) {
                // The first `prompts` rows, each with its turns.
                (Some(r), Some(t)) => {
                    counted = true;
                    turns += t.value * (prompts / r.value.max(1.0)).min(1.0);
                }
                (Some(r), None) => turns += r.value.min(prompts),
                _ => {
                    known = false;
                    turns += prompts;
                }
            }
        }
        let ngram = spec.params["baselines"]
            .as_array()
            .is_some_and(|b| b.iter().any(|m| m == "ngram"));
        let a = |name: &str| self.assumptions.get(name);
        let step = a("decode_step_s_per_layer") * target.layers as f64;
        let (verify, draft, tree) = (
            a("bench_verify_step_ratio"),
            a("bench_drafter_round_ratio"),
            a("bench_tree_round_ratio"),
        );
        // A method's time per token, in target steps: its round over the tokens a round commits.
        let (tau_ngram, tau_chain, tau_tree, tau_graft) = (
            a("bench_tau_ngram").max(1.0),
            a("bench_tau_chain").max(1.0),
            a("bench_tau_tree").max(1.0),
            a("bench_tau_tree_lookup").max(1.0),
        );
        // The tree with prompt lookup's paths: a round as dear as the tree's, more per round.
        let (chain, tree_round, graft) = (draft / tau_chain, tree / tau_tree, tree / tau_graft);
        // Each drafter decodes once per way of verifying it (`both`: chain, then tree; `all`:
        // then the tree with prompt lookup's paths).
        let per_drafter = match spec.params["verify"].as_str() {
            Some("tree") => tree_round,
            Some("tree+lookup") => graft,
            Some("both") => chain + tree_round,
            Some("all") => chain + tree_round + graft,
            _ => chain,
        };
        let factor = 1.0 + if ngram { verify / tau_ngram } else { 0.0 } + drafters * per_drafter;
        // Answers stop before `max_new_tokens` (end of turn), most of all short code.
        let answer = a("bench_answer_fraction").clamp(0.0, 1.0);
        let seconds = turns * max_new * answer * step * factor;
        s.resource = Resource::Gpu;
        s.gpus = 1;
        s.gpu_hours = seconds / 3600.0;
        s.wall_hours = Some(s.gpu_hours);
        s.notes.push(format!(
            "{} turns ({} prompts per set{}{}) x {} tokens x {answer:.2} (answers stop sooner): a target step of {:.1} ms, rounds of {verify:.1}x (prompt lookup), {draft:.1}x (a drafter's chain) and {tree:.1}x (its tree) a step, at tau {tau_ngram:.1} / {tau_chain:.1} / {tau_tree:.1} / {tau_graft:.1} with prompt lookup's paths (the story's trained drafter)",
            count(turns),
            count(prompts),
            if known { "" } else { ", sets of unknown size taken as full" },
            if counted {
                "; user turns counted: a done download's record, else its local files"
            } else {
                "; a multi-turn set asks more"
            },
            count(max_new),
            step * 1e3
        ));
    }

    fn train(
        &mut self,
        spec: &StageSpec,
        ups: &[&Data],
        done: Option<&Manifest>,
        s: &mut StageEstimate,
    ) {
        let Ok(p) = dflash_stage_train::Params::parse(&spec.params) else {
            s.notes.push("params unreadable".into());
            return;
        };
        let rows = declared(spec, "rows").or_else(|| upstream_rows(ups));
        let len = declared(spec, "tokens")
            .or_else(|| upstream(ups, |d| d.tokens))
            .map(|t| Figure::new(t.value.min(p.max_length as f64), t.basis));
        let share = upstream(ups, |d| d.trained_share).unwrap_or(Figure::new(0.5, Basis::Assumed));
        s.rows = rows;
        s.data.rows = rows;
        s.tokens_are = "training tokens x epochs";
        let (Some(rows), Some(len)) = (rows, len) else {
            s.notes
                .push("sizes unknown upstream: declare `expect: {rows, tokens}`".into());
            return;
        };
        let Some(target) = self.shape(&s.id, &p.target) else {
            return;
        };
        let hw = self.opts.hardware.clone();
        let taps = (!p.target_layers.is_empty()).then(|| p.target_layers.clone());
        let dflash2 =
            dflash_stage_train::dflash2_settings(&spec.params, target.hidden, target.vocab)
                .ok()
                .flatten();
        let drafter = DrafterShape::new(target.clone(), p.draft_layers, p.block_size, taps, p.taps)
            .with_dflash2(dflash2);
        let seq = len.value;
        let anchors = (p.anchors as f64).min(seq * share.value).max(1.0);
        let mut sequences = rows.value * p.epochs as f64;
        if let Some(max_steps) = spec.params["max_steps"].as_f64() {
            sequences = sequences.min(max_steps * p.sequences_per_step() as f64);
        }
        // Each data-parallel replica takes its own batch per optimizer step.
        let steps = (sequences / (p.sequences_per_step() as f64 * f64::from(hw.count))).ceil();
        let f_target = target.forward_flops(seq);
        let f_drafter = drafter.train_flops(seq, anchors);
        let peak = hw.gpu.tflops * 1e12;
        let mfu = self.assumptions.get("train_mfu");
        let prefill_mfu = self.assumptions.get("prefill_mfu");
        // A step is bound by its FLOPs or, for small models, by its kernel launches and small
        // ops, whichever is longer: per sequence and layer pass (the target's layers forward,
        // the drafter's forward and backward) and per block row (the LM head and its loss, and
        // each drafter layer: blocks of 8 train faster than 16 where the launches are the same).
        let flops_s = (f_target + f_drafter) / (peak * mfu);
        let block_rows = anchors * p.block_size as f64;
        let row_s = self.assumptions.get("train_head_s_per_row")
            + p.draft_layers as f64 * self.assumptions.get("train_layer_s_per_row");
        let launch_s = self.assumptions.get("train_launch_s_per_layer")
            * (target.layers + 3 * p.draft_layers) as f64
            + block_rows * row_s;
        // DFlash 2's convolutions, top-k and selector: measured as a whole-step ratio, since
        // its extra cost is small ops and lookups rather than FLOPs.
        let head_ratio = if drafter.dflash2.is_some() {
            self.assumptions.get("train_dflash2_step_ratio")
        } else {
            1.0
        };
        let gpu_s = sequences * flops_s.max(launch_s) * head_ratio;
        if launch_s > flops_s {
            s.notes.push(format!(
                "launch-bound: {:.1} ms of kernel launches and small ops per sequence ({:.1} ms of them over its {} block rows) against {:.1} ms of FLOPs (a small target)",
                launch_s * 1e3,
                block_rows * row_s * 1e3,
                count(block_rows),
                flops_s * 1e3
            ));
        }
        let basis = rows.basis.weaker(len.basis);
        s.resource = Resource::Gpu;
        s.gpus = hw.count;
        s.tokens = Some(Figure::new(sequences * seq, basis));
        s.flops = Some(sequences * (f_target + f_drafter));
        s.gpu_hours = gpu_s / 3600.0;
        s.wall_hours = Some(gpu_s / f64::from(hw.count) / 3600.0);
        let pd = drafter.trainable_parameters() as f64;
        let checkpoints = (steps / p.checkpoint_every.max(1) as f64).floor();
        // What the train stage writes: every checkpoint holds f32 weights and both Adam moments
        // (f32 or bf16: `optimizer_moments`; exact resume; immutable, so all of them stay), and
        // the export holds bf16 weights.
        let checkpoint_bytes = (4.0 + p.moment_bytes()) * pd;
        s.storage_bytes = Some(Figure::new(
            checkpoints * checkpoint_bytes + 2.0 * pd,
            basis,
        ));
        s.notes.push(format!(
            "drafter {} trainable ({} layers, B={}, taps {:?}); {:.0} anchors of {:.0} tokens; {} steps, data parallel over {hw}",
            count(pd),
            p.draft_layers,
            p.block_size,
            drafter.target_layers,
            anchors,
            seq,
            count(steps)
        ));
        if drafter.dflash2.is_some() {
            s.notes.push(format!(
                "head dflash2: {} of it the convolutions and the candidate selector (its codebooks are vocabulary x rank, twice); a step {head_ratio}x a DFlash one's (`train_dflash2_step_ratio`)",
                count(drafter.dflash2_parameters() as f64)
            ));
        }
        s.notes.push(format!(
            "{} checkpoints of {} (every {} steps; raise `checkpoint_every` to store fewer)",
            count(checkpoints),
            bytes(checkpoint_bytes),
            p.checkpoint_every
        ));
        if done.is_some() {
            return;
        }
        let target_bytes = match &target.source {
            dflash_model::ShapeSource::Gguf(path) => {
                std::fs::metadata(path).map_or(2.0 * target.parameters() as f64, |m| m.len() as f64)
            }
            _ => 2.0 * target.parameters() as f64,
        };
        let memory = drafter.train_memory_bytes(target_bytes, seq, anchors, p.moment_bytes());
        if memory > hw.gpu.memory_gb * 1e9 {
            self.warnings.push(format!(
                "`{}`: one replica (target {} + drafter, optimizer and activations) needs {} per GPU; a {} has {:.0} GB: lower `anchors` or `max_length`, or split target and drafter over GPUs",
                s.id,
                bytes(target_bytes),
                bytes(memory),
                hw.gpu.name,
                hw.gpu.memory_gb
            ));
        } else {
            s.notes.push(format!(
                "peak memory per GPU ~{} of {:.0} GB",
                bytes(memory),
                hw.gpu.memory_gb
            ));
        }

        // Offline hidden states: one target pass, then the drafter reads them every epoch.
        let once = rows.value * f_target / (peak * prefill_mfu);
        let offline_bytes = rows.value * seq * drafter.offline_bytes_per_token() as f64;
        let drafter_s = sequences * f_drafter / (peak * mfu);
        let n = f64::from(hw.count);
        let over = if offline_bytes > self.opts.max_storage {
            format!(
                "; over the --max-storage limit of {}",
                bytes(self.opts.max_storage)
            )
        } else {
            String::new()
        };
        self.alternatives.push(Alternative {
            stage: s.id.clone(),
            question: "hidden states: stored offline, or computed online".into(),
            choices: vec![
                Choice {
                    label: "online: the target runs beside the drafter".into(),
                    storage_bytes: 0.0,
                    gpu_hours: gpu_s / 3600.0,
                    wall_hours: gpu_s / n / 3600.0,
                    chosen: true,
                    note: format!(
                        "the target's forward is repeated every epoch ({} epochs)",
                        p.epochs
                    ),
                },
                Choice {
                    label: "offline: store the tapped hidden states once".into(),
                    storage_bytes: offline_bytes,
                    gpu_hours: (once + drafter_s) / 3600.0,
                    wall_hours: (once + drafter_s) / n / 3600.0,
                    chosen: false,
                    note: format!(
                        "{} taps x {} x 2 bytes = {} per token x {} tokens{over}",
                        drafter.taps(),
                        target.hidden,
                        bytes(drafter.offline_bytes_per_token() as f64),
                        count(rows.value * seq)
                    ),
                },
            ],
        });

        // Target and drafter on separate GPUs: hidden states cross the interconnect.
        if hw.count >= 2 {
            let t_target = f_target / (peak * prefill_mfu);
            let t_drafter = f_drafter / (peak * mfu);
            let dp_rate = n / ((f_target + f_drafter) / (peak * mfu));
            let link = if hw.gpu.nvlink {
                NVLINK_BYTES_PER_S
            } else {
                PCIE_BYTES_PER_S
            };
            let per_seq = seq * drafter.offline_bytes_per_token() as f64;
            let mut choices = vec![Choice {
                label: format!(
                    "data parallel: target + drafter on each of {} GPUs",
                    hw.count
                ),
                storage_bytes: 0.0,
                gpu_hours: gpu_s / 3600.0,
                wall_hours: sequences / dp_rate / 3600.0,
                chosen: true,
                note: "gradients all-reduced each step".into(),
            }];
            for k in 1..hw.count {
                let rate = (f64::from(k) / t_target).min(f64::from(hw.count - k) / t_drafter);
                let traffic = rate * per_seq / f64::from(hw.count - k);
                let wall = sequences / rate;
                let bound = if f64::from(k) / t_target < f64::from(hw.count - k) / t_drafter {
                    "target-bound"
                } else {
                    "drafter-bound"
                };
                choices.push(Choice {
                    label: format!("split: target on {k}, drafter on {}", hw.count - k),
                    storage_bytes: 0.0,
                    gpu_hours: wall * n / 3600.0,
                    wall_hours: wall / 3600.0,
                    chosen: false,
                    note: format!(
                        "{bound}; {}/s of hidden states into each drafter GPU ({:.1}% of {})",
                        bytes(traffic),
                        traffic / link * 100.0,
                        if hw.gpu.nvlink { "NVLink" } else { "PCIe" }
                    ),
                });
            }
            // Every split is costed; the table shows the two fastest beside data parallel.
            let mut splits = choices.split_off(1);
            splits.sort_by(|a, b| a.wall_hours.total_cmp(&b.wall_hours));
            choices.extend(splits.into_iter().take(2));
            self.alternatives.push(Alternative {
                stage: s.id.clone(),
                question: format!("online training on {hw}: how to place target and drafter"),
                choices,
            });
        }
    }
}
