//! The `candle` backend: generation in-process with candle, for a local model (Llama or Qwen3
//! architecture), a GGUF file or a Hugging Face folder (config.json, safetensors, tokenizer.json;
//! the quickstart's SmolLM2-135M-Instruct GGUF on CPU). The prompt is rendered
//! with the model's own chat template and tokenized exactly as `tokenize` does (the same crate),
//! so what was generated is what will be trained on. Conversations are decoded in batches: each
//! batch's prompts are prefilled together, left-padded to the longest, then every step feeds
//! the batch's next tokens through one pass (`dflash_model::nn::batch::BatchDecoder`), so the
//! weights are read once per step for the whole batch and a GPU (`device: cuda`) runs one
//! launch per op for all of it. Greedy decoding picks the tokens on the device.

use std::path::Path;

use candle_core::{D, Device, Tensor};
use candle_transformers::generation::LogitsProcessor;
use dflash_model::nn::Target;
use dflash_model::nn::batch::BatchDecoder;
use dflash_stage_api::dataset::Message;
use dflash_stage_api::{Cancel, StageError};
use dflash_stage_tokenize::Chat;
use serde_json::{Map, Value as Json};

use crate::client::Reply;

/// A loaded model.
pub struct Local {
    target: Target,
    chat: Chat,
    context: usize,
}

/// Sampling settings.
pub struct Sampling<'a> {
    /// The most tokens per reply.
    pub max_tokens: usize,
    /// 0 for greedy decoding.
    pub temperature: f64,
    /// Nucleus sampling.
    pub top_p: f64,
    /// Stop strings.
    pub stop: &'a [String],
}

fn err(what: &str) -> impl Fn(candle_core::Error) -> StageError + '_ {
    move |e| StageError::new(format!("{what}: {e}"))
}

/// What one wave cost: its prefill's shape (real prompt tokens against the padded columns every
/// row computes) and where its time went. On a GPU the prefill's time ends at the first step's
/// token picks, which wait for the device.
#[derive(Clone, Copy, Debug, Default)]
pub struct WaveShape {
    /// Prompt tokens of the rows prefilled.
    pub prompt_tokens: usize,
    /// The positions the left-padded prefill computed (runs of like length apart).
    pub padded_tokens: usize,
    /// Decoding steps after the prefill.
    pub steps: usize,
    /// Seconds to the first tokens (rendering and tokenizing the prompts, then the prefill),
    /// and in the steps after it.
    pub prefill_s: f64,
    pub decode_s: f64,
}

/// One conversation being decoded.
struct Decoding {
    sampler: LogitsProcessor,
    budget: usize,
    out: Vec<u32>,
    /// The finished reply (or why there is none).
    result: Option<Result<Reply, String>>,
}

impl Local {
    /// Load the model at `path` (a GGUF file or a Hugging Face folder); `kwargs` go to its
    /// chat template.
    pub fn load(
        path: &Path,
        kwargs: &Map<String, Json>,
        device: &Device,
    ) -> Result<Self, StageError> {
        let shown = path.display().to_string();
        let target = Target::load(path, device).map_err(|e| {
            StageError::new(format!("cannot load `{shown}`: {e}")).with_help(
                "the candle backend runs Llama- and Qwen3-architecture models, GGUF or Hugging Face folders",
            )
        })?;
        let chat = Chat::load(path, kwargs)?;
        let context = target.config.context;
        Ok(Self {
            target,
            chat,
            context,
        })
    }

    /// Generate the reply to each of `convos` (with `seeds[i]`), decoded together, and what the
    /// wave cost. A reply that cannot be generated (a prompt past the context) is an `Err` with
    /// the reason.
    pub fn reply_batch(
        &mut self,
        convos: &[&[Message]],
        s: &Sampling<'_>,
        seeds: &[u64],
        cancel: &Cancel,
    ) -> Result<(Vec<Result<Reply, String>>, WaveShape), StageError> {
        let started = std::time::Instant::now();
        let mut shape = WaveShape::default();
        let temperature = (s.temperature > 0.0).then_some(s.temperature);
        let top_p = (s.top_p < 1.0).then_some(s.top_p);
        let mut seqs = Vec::with_capacity(convos.len());
        let mut prompts = Vec::new();
        for (convo, &seed) in convos.iter().zip(seeds) {
            let prompt = self.chat.prompt(convo)?;
            let mut d = Decoding {
                sampler: LogitsProcessor::new(seed, temperature, top_p),
                budget: s.max_tokens.min(self.context.saturating_sub(prompt.len())),
                out: Vec::new(),
                result: None,
            };
            if prompt.len() >= self.context {
                d.result = Some(Err(format!(
                    "the prompt has {} tokens; the model's context is {}",
                    prompt.len(),
                    self.context
                )));
            } else {
                prompts.push((seqs.len(), prompt));
            }
            seqs.push(d);
        }
        if prompts.is_empty() {
            return Ok((finished(seqs), shape));
        }
        // The sequences that fit decode together; `rows[j]` is the sequence at batch row j,
        // longest prompt first, so the prefill's runs of like length are few
        // (`BatchDecoder::prefill`).
        prompts.sort_by_key(|(_, p)| std::cmp::Reverse(p.len()));
        let rows: Vec<usize> = prompts.iter().map(|(i, _)| *i).collect();
        let extra = rows.iter().map(|&i| seqs[i].budget).max().unwrap_or(0) + 1;
        let slices: Vec<&[u32]> = prompts.iter().map(|(_, p)| p.as_slice()).collect();
        shape.prompt_tokens = slices.iter().map(|p| p.len()).sum();
        let (mut batch, mut logits) =
            BatchDecoder::prefill(&self.target, &slices, extra).map_err(err("prefill"))?;
        shape.padded_tokens = batch.prefilled();
        let mut decoding = None;
        loop {
            if cancel.is_cancelled() {
                return Err(StageError::cancelled());
            }
            let picked = pick(&logits, temperature.is_none(), &rows, &mut seqs)?;
            if decoding.is_none() {
                shape.prefill_s = started.elapsed().as_secs_f64();
                decoding = Some(std::time::Instant::now());
            }
            // Sample each live sequence's next token; finish those that end here.
            let mut next = vec![0u32; rows.len()];
            let mut live = false;
            for (j, &i) in rows.iter().enumerate() {
                let d = &mut seqs[i];
                if d.result.is_some() {
                    continue;
                }
                if d.out.len() >= d.budget {
                    d.result = Some(Ok(self.finish(&d.out, "length")?));
                    continue;
                }
                let token = picked[j];
                if self.chat.stop.contains(&token) {
                    d.result = Some(Ok(self.finish(&d.out, "stop")?));
                    continue;
                }
                d.out.push(token);
                if !s.stop.is_empty() {
                    let so_far = self.decode(&d.out)?;
                    if let Some(at) = s
                        .stop
                        .iter()
                        .filter_map(|st| so_far.find(st.as_str()))
                        .min()
                    {
                        d.result = Some(Ok(split_reasoning(&so_far[..at], "stop", d.out.len())));
                        continue;
                    }
                }
                if d.out.len() >= d.budget {
                    d.result = Some(Ok(self.finish(&d.out, "length")?));
                    continue;
                }
                next[j] = token;
                live = true;
            }
            if !live {
                break;
            }
            logits = batch.step(&next).map_err(err("decode"))?;
            shape.steps += 1;
        }
        shape.decode_s = decoding.map_or(0.0, |t| t.elapsed().as_secs_f64());
        Ok((finished(seqs), shape))
    }

    fn finish(&self, out: &[u32], reason: &str) -> Result<Reply, StageError> {
        Ok(split_reasoning(&self.decode(out)?, reason, out.len()))
    }

    fn decode(&self, ids: &[u32]) -> Result<String, StageError> {
        self.chat.decode(ids)
    }
}

/// Each batch row's next token: the argmax on the device when greedy (only the ids cross
/// to the host), else each live sequence's own sampler over its row.
fn pick(
    logits: &Tensor,
    greedy: bool,
    rows: &[usize],
    seqs: &mut [Decoding],
) -> Result<Vec<u32>, StageError> {
    if greedy {
        return logits
            .argmax(D::Minus1)
            .and_then(|t| t.to_vec1::<u32>())
            .map_err(err("sampling"));
    }
    let host = logits.to_device(&Device::Cpu).map_err(err("sampling"))?;
    let mut out = vec![0u32; rows.len()];
    for (j, &i) in rows.iter().enumerate() {
        let d = &mut seqs[i];
        if d.result.is_none() {
            out[j] = host
                .get(j)
                .and_then(|l| d.sampler.sample(&l))
                .map_err(err("sampling"))?;
        }
    }
    Ok(out)
}

/// The replies of finished sequences, in order.
fn finished(seqs: Vec<Decoding>) -> Vec<Result<Reply, String>> {
    seqs.into_iter()
        .map(|d| d.result.unwrap_or_else(|| Err("no reply".into())))
        .collect()
}

/// Reasoning a model writes inline (`<think>...</think>`) is kept apart, as servers' reasoning
/// parsers do.
fn split_reasoning(text: &str, finish: &str, tokens: usize) -> Reply {
    let (reasoning, content) = match text.split_once("</think>") {
        Some((r, c)) => (
            Some(
                r.trim_start()
                    .trim_start_matches("<think>")
                    .trim()
                    .to_owned(),
            ),
            c.trim_start().to_owned(),
        ),
        None => (None, text.to_owned()),
    };
    Reply {
        content,
        reasoning: reasoning.filter(|r| !r.is_empty()),
        finish_reason: finish.to_owned(),
        completion_tokens: tokens as u64,
    }
}
