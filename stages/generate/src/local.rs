//! The `candle` backend: generation in-process with candle, for a local model (Llama or Qwen3
//! architecture), a GGUF file or a Hugging Face folder (config.json, safetensors, tokenizer.json;
//! the quickstart's SmolLM2-135M-Instruct GGUF on CPU). The prompt is rendered
//! with the model's own chat template and tokenized exactly as `tokenize` does (the same crate),
//! so what was generated is what will be trained on. Conversations are decoded in batches: each
//! prompt is prefilled on its own, then every step feeds the batch's next tokens through one
//! pass (`dflash_model::nn::Target::extend_batch`), so the weights are read once per step for
//! the whole batch instead of once per sequence.

use std::path::Path;

use candle_core::Device;
use candle_transformers::generation::LogitsProcessor;
use dflash_model::nn::Target;
use dflash_model::nn::target::KvCache;
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

/// One conversation being decoded.
struct Decoding {
    cache: KvCache,
    sampler: LogitsProcessor,
    budget: usize,
    out: Vec<u32>,
    /// The finished reply (or why there is none).
    result: Option<Result<Reply, String>>,
}

impl Local {
    /// Load the model at `path` (a GGUF file or a Hugging Face folder); `kwargs` go to its
    /// chat template.
    pub fn load(path: &Path, kwargs: &Map<String, Json>) -> Result<Self, StageError> {
        let shown = path.display().to_string();
        let target = Target::load(path, &Device::Cpu).map_err(|e| {
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

    /// Generate the reply to each of `convos` (with `seeds[i]`), decoded together. A reply that
    /// cannot be generated (a prompt past the context) is an `Err` with the reason.
    pub fn reply_batch(
        &mut self,
        convos: &[&[Message]],
        s: &Sampling<'_>,
        seeds: &[u64],
        cancel: &Cancel,
    ) -> Result<Vec<Result<Reply, String>>, StageError> {
        let temperature = (s.temperature > 0.0).then_some(s.temperature);
        let top_p = (s.top_p < 1.0).then_some(s.top_p);
        let mut seqs = Vec::with_capacity(convos.len());
        let mut logits = Vec::with_capacity(convos.len());
        for (convo, &seed) in convos.iter().zip(seeds) {
            let prompt = self.chat.prompt(convo)?;
            let mut d = Decoding {
                cache: KvCache::default(),
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
                logits.push(None);
            } else {
                let (l, _) = self
                    .target
                    .extend(&prompt, &mut d.cache, &[])
                    .map_err(err("prefill"))?;
                logits.push(Some(
                    l.narrow(0, prompt.len() - 1, 1).map_err(err("prefill"))?,
                ));
            }
            seqs.push(d);
        }
        loop {
            if cancel.is_cancelled() {
                return Err(StageError::cancelled());
            }
            // Sample each live sequence's next token; finish those that end here.
            let mut step: Vec<(usize, u32)> = Vec::new();
            for (i, d) in seqs.iter_mut().enumerate() {
                if d.result.is_some() {
                    continue;
                }
                let Some(l) = logits[i].take() else { continue };
                if d.out.len() >= d.budget {
                    d.result = Some(Ok(self.finish(&d.out, "length")?));
                    continue;
                }
                let next = l
                    .squeeze(0)
                    .and_then(|l| d.sampler.sample(&l))
                    .map_err(err("sampling"))?;
                if self.chat.stop.contains(&next) {
                    d.result = Some(Ok(self.finish(&d.out, "stop")?));
                    continue;
                }
                d.out.push(next);
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
                step.push((i, next));
            }
            if step.is_empty() {
                break;
            }
            let tokens: Vec<[u32; 1]> = step.iter().map(|&(_, t)| [t]).collect();
            // `step` lists live sequences in ascending order: pair each with its cache.
            let mut live = step.iter().map(|&(i, _)| i).peekable();
            let mut batch: Vec<(&[u32], &mut KvCache)> = Vec::with_capacity(step.len());
            for (i, d) in seqs.iter_mut().enumerate() {
                if live.next_if_eq(&i).is_some() {
                    batch.push((tokens[batch.len()].as_slice(), &mut d.cache));
                }
            }
            let out = self
                .target
                .extend_batch(&mut batch)
                .map_err(err("decode"))?;
            for (row, &(i, _)) in step.iter().enumerate() {
                logits[i] = Some(out.narrow(0, row, 1).map_err(err("decode"))?);
            }
        }
        Ok(seqs
            .into_iter()
            .map(|d| d.result.unwrap_or_else(|| Err("no reply".into())))
            .collect())
    }

    fn finish(&self, out: &[u32], reason: &str) -> Result<Reply, StageError> {
        Ok(split_reasoning(&self.decode(out)?, reason, out.len()))
    }

    fn decode(&self, ids: &[u32]) -> Result<String, StageError> {
        self.chat.decode(ids)
    }
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
