//! The `candle` backend: generation in-process with candle, for a local GGUF model (the
//! quickstart's SmolLM2-135M-Instruct on CPU). The prompt is rendered with the model's own chat
//! template and tokenized exactly as `tokenize` does (the same crate), so what was generated is
//! what will be trained on. One sequence at a time: candle's quantized Llama has no padding mask
//! for batches of prompts of different lengths; each forward is parallel over the cores.

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::generation::LogitsProcessor;
use candle_transformers::models::quantized_llama::ModelWeights;
use dflash_stage_api::dataset::Message;
use dflash_stage_api::{Cancel, StageError};
use dflash_stage_tokenize::{Cache, ChatTemplate, Encoder, Turn};
use serde_json::{Map, Value as Json};

use crate::client::Reply;

/// A loaded model.
pub struct Local {
    weights: ModelWeights,
    template: ChatTemplate,
    encoder: Encoder,
    cache: Cache,
    end_ids: Vec<u32>,
    context: usize,
    device: Device,
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

impl Local {
    /// Load the GGUF model at `path`; `kwargs` go to its chat template.
    pub fn load(path: &Path, kwargs: &Map<String, Json>) -> Result<Self, StageError> {
        let shown = path.display().to_string();
        let mut file = std::fs::File::open(path)
            .map_err(|e| StageError::new(format!("cannot open `{shown}`: {e}")))?;
        let gguf = gguf_file::Content::read(&mut file)
            .map_err(|e| StageError::new(format!("`{shown}` is not a GGUF model: {e}")))?;
        let context = gguf
            .metadata
            .iter()
            .find(|(k, _)| k.ends_with(".context_length"))
            .and_then(|(_, v)| v.to_u32().ok())
            .unwrap_or(2048) as usize;
        let device = Device::Cpu;
        let weights = ModelWeights::from_gguf(gguf, &mut file, &device).map_err(|e| {
            StageError::new(format!("cannot load `{shown}`: {e}"))
                .with_help("the candle backend runs Llama-architecture GGUF models")
        })?;
        let model = dflash_stage_tokenize::load_model(path, None)?;
        let template = ChatTemplate::new(&model.template, &model.special, kwargs)
            .map_err(|e| StageError::new(e.0))?;
        let end_ids = model
            .end_tokens
            .iter()
            .filter_map(|t| model.tokenizer.token_to_id(t))
            .collect();
        let encoder = Encoder::from_parts(model.tokenizer, model.fast);
        let cache = encoder.take_cache();
        Ok(Self {
            weights,
            template,
            encoder,
            cache,
            end_ids,
            context,
            device,
        })
    }

    /// Generate the reply to `convo`.
    pub fn reply(
        &mut self,
        convo: &[Message],
        s: &Sampling<'_>,
        seed: u64,
        cancel: &Cancel,
    ) -> Result<Result<Reply, String>, StageError> {
        let turns: Vec<Turn<'_>> = convo
            .iter()
            .map(|m| Turn {
                role: &m.role,
                content: &m.content,
                reasoning: None,
                tool_calls: None,
            })
            .collect();
        let text = self
            .template
            .render(&turns, None, true)
            .map_err(|e| StageError::new(e.0))?;
        let (prompt, _) = self
            .encoder
            .encode(&text, &mut self.cache)
            .map_err(StageError::new)?;
        if prompt.len() >= self.context {
            return Ok(Err(format!(
                "the prompt has {} tokens; the model's context is {}",
                prompt.len(),
                self.context
            )));
        }
        let budget = s.max_tokens.min(self.context - prompt.len());
        let temperature = (s.temperature > 0.0).then_some(s.temperature);
        let top_p = (s.top_p < 1.0).then_some(s.top_p);
        let mut sampler = LogitsProcessor::new(seed, temperature, top_p);
        self.weights.clear_kv_cache();
        let input = Tensor::new(prompt.as_slice(), &self.device)
            .and_then(|t| t.unsqueeze(0))
            .map_err(err("prefill"))?;
        let mut logits = self.weights.forward(&input, 0).map_err(err("prefill"))?;
        let mut out: Vec<u32> = Vec::new();
        let mut finish = "length";
        while out.len() < budget {
            if cancel.is_cancelled() {
                return Err(StageError::cancelled());
            }
            let next = logits
                .squeeze(0)
                .and_then(|l| sampler.sample(&l))
                .map_err(err("sampling"))?;
            if self.end_ids.contains(&next) {
                finish = "stop";
                break;
            }
            out.push(next);
            if !s.stop.is_empty() {
                let so_far = self.decode(&out)?;
                if let Some(at) = s
                    .stop
                    .iter()
                    .filter_map(|st| so_far.find(st.as_str()))
                    .min()
                {
                    return Ok(Ok(split_reasoning(&so_far[..at], "stop", out.len())));
                }
            }
            let input = Tensor::new(&[next], &self.device)
                .and_then(|t| t.unsqueeze(0))
                .map_err(err("decode"))?;
            logits = self
                .weights
                .forward(&input, prompt.len() + out.len() - 1)
                .map_err(err("decode"))?;
        }
        let text = self.decode(&out)?;
        Ok(Ok(split_reasoning(&text, finish, out.len())))
    }

    fn decode(&self, ids: &[u32]) -> Result<String, StageError> {
        self.encoder
            .tokenizer()
            .decode(ids, true)
            .map_err(|e| StageError::new(format!("cannot decode: {e}")))
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
