//! The bench's inputs: drafters (`train` artifacts) and prompt sets. A conversation set is
//! rendered with the target's chat template up to its first assistant turn, with the
//! generation prompt, and tokenized as `tokenize` does (the same crate); a token set's prompt is
//! each row's tokens before the first trained one, as they were rendered for training.

use std::path::{Path, PathBuf};

use dflash_stage_api::dataset;
use dflash_stage_api::tokens;
use dflash_stage_api::{Input, StageError};
use dflash_stage_tokenize::Chat;
use serde_json::{Map, Value};

/// One prompt, tokenized.
pub struct Prompt {
    /// The row's id.
    pub id: String,
    /// Its tokens.
    pub ids: Vec<u32>,
}

/// One prompt set.
pub struct PromptSet {
    /// The input's name.
    pub name: String,
    /// The prompts, at most the `prompts` param.
    pub prompts: Vec<Prompt>,
    /// The template kwargs the prompts were rendered with.
    pub template_kwargs: Value,
    /// Rows without a user turn to prompt with.
    pub skipped: u64,
}

/// The target's tokenizer and chat template, for conversation sets.
pub struct Rendering(Chat);

impl Rendering {
    /// The tokenizer and template of the GGUF model at `path`.
    pub fn load(path: &Path, kwargs: &Map<String, Value>) -> Result<Self, StageError> {
        Chat::load(path, kwargs).map(Self)
    }

    /// End-of-turn token ids: decoding stops at them.
    pub fn stop(&self) -> &[u32] {
        &self.0.stop
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.0.decode(ids).unwrap_or_default()
    }

    /// The prompt for a conversation: its turns before the first assistant turn; `None` when
    /// they hold no user turn.
    fn prompt(&mut self, messages: &[dataset::Message]) -> Result<Option<Vec<u32>>, StageError> {
        let leading = leading_turns(messages);
        if !leading.iter().any(|m| m.role == "user") {
            return Ok(None);
        }
        self.0.prompt(leading).map(Some)
    }
}

/// The turns before the first assistant turn: what a benchmark prompts with.
fn leading_turns(messages: &[dataset::Message]) -> &[dataset::Message] {
    let end = messages
        .iter()
        .position(|m| m.role == "assistant")
        .unwrap_or(messages.len());
    &messages[..end]
}

/// Whether `input` is a `train` artifact.
pub fn is_drafter(input: &Input) -> bool {
    input.dir.join("drafter/config.json").is_file()
}

/// Read one prompt set: its first `limit` usable rows, splits in name order (`eval` first).
pub fn read_set(
    input: &Input,
    limit: usize,
    rendering: Option<&mut Rendering>,
    kwargs: &Map<String, Value>,
) -> Result<PromptSet, StageError> {
    let mut set = PromptSet {
        name: input.name.clone(),
        prompts: Vec::new(),
        template_kwargs: Value::Object(kwargs.clone()),
        skipped: 0,
    };
    let files: Vec<PathBuf> = dataset::files(&input.dir)?
        .into_values()
        .flatten()
        .collect();
    let Some(first) = files.first() else {
        return Err(StageError::new(format!(
            "input `{}` holds neither a drafter nor prompts",
            input.name
        ))
        .with_help("bench takes `train` stages (drafters) and `download`, `mix` or `tokenize` stages (prompts)"));
    };
    if tokens::is_token_file(first)? {
        // Rendered when they were tokenized: their kwargs are the tokenize stage's.
        if let Ok(bytes) = std::fs::read(input.dir.join(tokens::RENDERING_FILE)) {
            let r: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            set.template_kwargs = r["template_kwargs"].clone();
        }
        'files: for f in &files {
            for row in tokens::read(f, usize::MAX)? {
                if set.prompts.len() >= limit {
                    break 'files;
                }
                let ids = row.prompt().to_vec();
                if ids.is_empty() {
                    set.skipped += 1;
                    continue;
                }
                set.prompts.push(Prompt { id: row.id, ids });
            }
        }
        return Ok(set);
    }
    let Some(rendering) = rendering else {
        return Err(StageError::new(format!(
            "prompt set `{}` holds conversations, and the target has no tokenizer or chat template to render them",
            input.name
        )));
    };
    'files: for f in &files {
        for row in dataset::read_rows(f)? {
            if set.prompts.len() >= limit {
                break 'files;
            }
            match rendering.prompt(&row.messages)? {
                Some(ids) => set.prompts.push(Prompt { id: row.id, ids }),
                None => set.skipped += 1,
            }
        }
    }
    Ok(set)
}

/// Read one conversation set for endpoint mode: the first `limit` usable rows' leading turns
/// (up to the first assistant turn) as OpenAI chat messages; the servers render them.
pub fn read_messages(
    input: &Input,
    limit: usize,
    kwargs: &Map<String, Value>,
) -> Result<(PromptSet, Vec<Vec<Value>>), StageError> {
    let mut set = PromptSet {
        name: input.name.clone(),
        prompts: Vec::new(),
        template_kwargs: Value::Object(kwargs.clone()),
        skipped: 0,
    };
    let mut conversations = Vec::new();
    let files: Vec<PathBuf> = dataset::files(&input.dir)?
        .into_values()
        .flatten()
        .collect();
    'files: for f in &files {
        if tokens::is_token_file(f)? {
            return Err(StageError::new(format!(
                "prompt set `{}` holds token files; endpoint mode sends text",
                input.name
            ))
            .with_help("give endpoint mode `download` or `mix` stages as prompt sets"));
        }
        for row in dataset::read_rows(f)? {
            if set.prompts.len() >= limit {
                break 'files;
            }
            let messages: Vec<Value> = leading_turns(&row.messages)
                .iter()
                .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
                .collect();
            if !messages.iter().any(|m| m["role"] == "user") {
                set.skipped += 1;
                continue;
            }
            set.prompts.push(Prompt {
                id: row.id,
                ids: Vec::new(),
            });
            conversations.push(messages);
        }
    }
    Ok((set, conversations))
}
