//! The bench's inputs: drafters (`train` artifacts) and prompt sets. A conversation set is
//! rendered with the target's chat template with the generation prompt and tokenized as
//! `tokenize` does (the same crate). Its user turns before the first assistant turn are asked in
//! order, as z-lab's `benchmark.py` asks MT-Bench's two: the first is rendered here, each later
//! one after the method's reply to the one before is appended (`Prompt::later`). A set's
//! `prompt_format` wraps each user turn in the reference harness's instruction (HumanEval's
//! "Write a solution...", GSM8K's "Please reason step by step..."). A token set's prompt is each
//! row's tokens before the first trained one, as they were rendered for training.

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
    /// Its first turn's tokens.
    pub ids: Vec<u32>,
    /// Conversation sets: the messages the first turn was rendered from.
    pub messages: Vec<dataset::Message>,
    /// The later user turns (already formatted), each asked after the reply to the one before.
    pub later: Vec<String>,
}

/// The reference harness's instruction for maths problems (GSM8K, MATH-500).
const REASON_STEP_BY_STEP: &str =
    "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}.";

/// The reference harness's instruction wrappers (z-lab's `benchmark.py`), by preset name;
/// `{prompt}` stands for the row's user turn.
pub const PRESETS: &[(&str, &str)] = &[
    (
        "humaneval",
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```",
    ),
    ("gsm8k", REASON_STEP_BY_STEP),
    ("math", REASON_STEP_BY_STEP),
];

/// The presets' names, for messages.
pub fn preset_names() -> String {
    PRESETS
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}

/// How a set's user turns are put to the model: as they are, or inside an instruction.
#[derive(Clone, Debug, Default)]
pub struct Format(Option<String>);

impl Format {
    /// A preset's name or a template holding `{prompt}`; `None` when it is neither.
    pub fn parse(value: &str) -> Option<Self> {
        if let Some((_, t)) = PRESETS.iter().find(|(name, _)| *name == value) {
            return Some(Self(Some((*t).to_owned())));
        }
        value
            .contains("{prompt}")
            .then(|| Self(Some(value.to_owned())))
    }

    /// `turn` as the model is asked it.
    pub fn apply(&self, turn: &str) -> String {
        match &self.0 {
            Some(t) => t.replace("{prompt}", turn),
            None => turn.to_owned(),
        }
    }
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

    /// The tokens of `messages` rendered with the generation prompt.
    pub fn render(&mut self, messages: &[dataset::Message]) -> Result<Vec<u32>, StageError> {
        self.0.prompt(messages)
    }

    /// Row `id`'s prompt: its first turn (its turns up to the first user turn, formatted),
    /// rendered, and its later user turns; `None` when it holds no user turn.
    fn prompt(
        &mut self,
        id: String,
        messages: &[dataset::Message],
        format: &Format,
    ) -> Result<Option<Prompt>, StageError> {
        let Some((first, later)) = user_turns(messages, format) else {
            return Ok(None);
        };
        Ok(Some(Prompt {
            id,
            ids: self.0.prompt(&first)?,
            messages: first,
            later,
        }))
    }
}

/// A conversation's leading turns split into the first question (system turns and the first
/// user turn, formatted) and the later user turns (formatted); `None` without a user turn.
fn user_turns(
    messages: &[dataset::Message],
    format: &Format,
) -> Option<(Vec<dataset::Message>, Vec<String>)> {
    let leading = leading_turns(messages);
    let at = leading.iter().position(|m| m.role == "user")?;
    let mut first = leading[..=at].to_vec();
    first[at].content = format.apply(&first[at].content);
    let later = leading[at + 1..]
        .iter()
        .filter(|m| m.role == "user")
        .map(|m| format.apply(&m.content))
        .collect();
    Some((first, later))
}

/// A user turn.
pub fn user(content: String) -> dataset::Message {
    dataset::Message {
        role: "user".into(),
        content,
        ..dataset::Message::default()
    }
}

/// An assistant reply.
pub fn assistant(content: String) -> dataset::Message {
    dataset::Message {
        role: "assistant".into(),
        content,
        ..dataset::Message::default()
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
    format: &Format,
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
                set.prompts.push(Prompt {
                    id: row.id,
                    ids,
                    messages: Vec::new(),
                    later: Vec::new(),
                });
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
            match rendering.prompt(row.id, &row.messages, format)? {
                Some(prompt) => set.prompts.push(prompt),
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
    format: &Format,
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
            let Some((first, later)) = user_turns(&row.messages, format) else {
                set.skipped += 1;
                continue;
            };
            conversations.push(
                first
                    .iter()
                    .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
                    .collect(),
            );
            set.prompts.push(Prompt {
                id: row.id,
                ids: Vec::new(),
                messages: first,
                later,
            });
        }
    }
    Ok((set, conversations))
}
