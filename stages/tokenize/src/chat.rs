//! [`Chat`]: a model's conversation front end for the stages that decode with it (`generate`'s
//! candle backend, `bench`): its chat template, tokenizer and end-of-turn tokens, loaded once;
//! conversations rendered with the generation prompt and tokenized exactly as `tokenize` does.

use std::path::Path;

use dflash_stage_api::StageError;
use dflash_stage_api::dataset::Message;
use serde_json::{Map, Value as Json};

use crate::{Cache, ChatTemplate, Encoder, Turn};

/// A loaded chat front end.
pub struct Chat {
    template: ChatTemplate,
    encoder: Encoder,
    cache: Cache,
    /// End-of-turn and end-of-sequence token ids: decoding stops at them.
    pub stop: Vec<u32>,
}

impl Chat {
    /// The template and tokenizer of the model at `path` (a GGUF file or a model folder);
    /// `kwargs` go to the template (e.g. `enable_thinking`).
    pub fn load(path: &Path, kwargs: &Map<String, Json>) -> Result<Self, StageError> {
        let model = crate::load_model(path, None)?;
        let template = ChatTemplate::new(&model.template, &model.special, kwargs)
            .map_err(|e| StageError::new(e.0))?;
        let stop = model
            .end_tokens
            .iter()
            .filter_map(|t| model.tokenizer.token_to_id(t))
            .collect();
        let encoder = Encoder::from_parts(model.tokenizer, model.fast);
        let cache = encoder.take_cache();
        Ok(Self {
            template,
            encoder,
            cache,
            stop,
        })
    }

    /// The tokens of `messages` rendered with the generation prompt.
    pub fn prompt(&mut self, messages: &[Message]) -> Result<Vec<u32>, StageError> {
        let turns: Vec<Turn<'_>> = messages
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
        let (ids, _) = self
            .encoder
            .encode(&text, &mut self.cache)
            .map_err(StageError::new)?;
        Ok(ids)
    }

    /// The text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String, StageError> {
        self.encoder
            .tokenizer()
            .decode(ids, true)
            .map_err(|e| StageError::new(format!("cannot decode: {e}")))
    }
}
