//! Declarative mapping of source records onto canonical conversations.
//!
//! The common shapes are recognised per record (`auto`) or forced (`format:`): ShareGPT
//! (`conversations: [{from, value}]`), OpenAI-style `messages: [{role, content}]`, Alpaca
//! (`instruction`, `input`, `output`), a list of user `turns` (MT-Bench), and a single prompt
//! column. `fields:` renames what each shape reads. A record that does not fit is returned as an
//! error with its reason, for the stage to count and report — never silently dropped.

use std::collections::BTreeMap;

use dflash_stage_api::dataset::{Conversation, Message};
use serde_json::Value;

/// The record shapes `download` understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Shape {
    /// Decide per record from the fields present.
    Auto,
    /// `conversations: [{from, value}]`.
    Sharegpt,
    /// `messages: [{role, content}]`.
    Messages,
    /// `instruction`, `input`, `output`.
    Alpaca,
    /// `turns: ["first user turn", "second user turn"]`.
    Turns,
    /// One prompt column (`prompt`, `question`, `problem`, ...), optionally a response column.
    Prompt,
}

impl Shape {
    /// The names `format:` accepts.
    pub const NAMES: &'static [&'static str] =
        &["auto", "sharegpt", "messages", "alpaca", "turns", "prompt"];

    /// The name as written in a pipeline.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Sharegpt => "sharegpt",
            Self::Messages => "messages",
            Self::Alpaca => "alpaca",
            Self::Turns => "turns",
            Self::Prompt => "prompt",
        }
    }
}

/// The field names `fields:` may override.
pub const FIELD_NAMES: &[&str] = &[
    "id",
    "category",
    "system",
    "conversations",
    "messages",
    "role",
    "content",
    "turns",
    "prompt",
    "response",
    "instruction",
    "input",
    "output",
    "tools",
];

const PROMPT_FIELDS: &[&str] = &["prompt", "question", "problem", "query", "text"];
const ID_FIELDS: &[&str] = &["id", "question_id", "task_id", "conversation_id", "uuid"];

/// How records become conversations.
#[derive(Debug, Clone)]
pub struct Mapping {
    /// The shape to read, or `Auto`.
    pub shape: Shape,
    /// Overrides of the field names each shape reads.
    pub fields: BTreeMap<String, String>,
    /// A category for every row, when the source has no category field; `auto`: judged from
    /// each row's text ([`crate::topic`]).
    pub category: Option<String>,
    /// The `source` column's value.
    pub source: String,
    /// Fields copied into `metadata`.
    pub keep: Vec<String>,
}

/// A mapped row, or why it could not be mapped.
pub type Mapped = Result<(Shape, Conversation), String>;

impl Mapping {
    fn field<'a>(&'a self, name: &'a str) -> &'a str {
        self.fields.get(name).map_or(name, String::as_str)
    }

    fn detect(&self, rec: &serde_json::Map<String, Value>) -> Option<Shape> {
        let has = |f: &str| rec.contains_key(self.field(f));
        if has("conversations") && rec[self.field("conversations")].is_array() {
            Some(Shape::Sharegpt)
        } else if has("messages") && rec[self.field("messages")].is_array() {
            Some(Shape::Messages)
        } else if has("instruction") {
            Some(Shape::Alpaca)
        } else if has("turns") && rec[self.field("turns")].is_array() {
            Some(Shape::Turns)
        } else if self.prompt_field(rec).is_some() {
            Some(Shape::Prompt)
        } else {
            None
        }
    }

    fn prompt_field<'a>(&'a self, rec: &serde_json::Map<String, Value>) -> Option<&'a str> {
        if let Some(f) = self.fields.get("prompt") {
            return Some(f);
        }
        PROMPT_FIELDS
            .iter()
            .copied()
            .find(|f| rec.get(*f).is_some_and(Value::is_string))
    }

    /// Map one record; `ordinal` names it when it has no id field.
    pub fn map(&self, record: &Value, ordinal: u64) -> Mapped {
        let rec = record
            .as_object()
            .ok_or_else(|| format!("a record is {}, not an object", kind_of(record)))?;
        let shape = match self.shape {
            Shape::Auto => self.detect(rec).ok_or_else(|| {
                let fields: Vec<&str> = rec.keys().map(String::as_str).take(8).collect();
                format!(
                    "no known shape (fields: {}); set `format:` and `fields:`",
                    fields.join(", ")
                )
            })?,
            s => s,
        };
        let mut messages = Vec::new();
        if let Some(system) = self.fields.get("system").and_then(|f| rec.get(f)) {
            let text = string(system, "system")?;
            if !text.is_empty() {
                messages.push(message("system", text));
            }
        }
        match shape {
            Shape::Sharegpt | Shape::Messages => {
                let (list, role_f, content_f) = if shape == Shape::Sharegpt {
                    (
                        "conversations",
                        self.field_or("role", "from"),
                        self.field_or("content", "value"),
                    )
                } else {
                    (
                        "messages",
                        self.field_or("role", "role"),
                        self.field_or("content", "content"),
                    )
                };
                let items = rec
                    .get(self.field(list))
                    .and_then(Value::as_array)
                    .ok_or_else(|| format!("no list `{}`", self.field(list)))?;
                for (i, item) in items.iter().enumerate() {
                    let role = item
                        .get(role_f)
                        .and_then(Value::as_str)
                        .ok_or_else(|| format!("turn {i} has no string `{role_f}`"))?;
                    let role = canonical_role(role)
                        .ok_or_else(|| format!("turn {i} has the unknown role `{role}`"))?;
                    let content =
                        content_text(item.get(content_f)).map_err(|e| format!("turn {i}: {e}"))?;
                    let reasoning = ["reasoning_content", "reasoning"]
                        .iter()
                        .find_map(|k| item.get(*k).and_then(Value::as_str))
                        .filter(|r| !r.is_empty())
                        .map(str::to_owned);
                    // Tool calls stay as the JSON the record holds; templates render them.
                    let tool_calls = item
                        .get("tool_calls")
                        .filter(|v| v.as_array().is_some_and(|a| !a.is_empty()))
                        .map(Value::to_string);
                    messages.push(Message {
                        role: role.to_owned(),
                        content,
                        reasoning,
                        tool_calls,
                    });
                }
            }
            Shape::Alpaca => {
                let instruction = string(req(rec, self.field("instruction"))?, "instruction")?;
                let input = rec
                    .get(self.field("input"))
                    .map(|v| string(v, "input"))
                    .transpose()?
                    .unwrap_or_default();
                let prompt = if input.trim().is_empty() {
                    instruction
                } else {
                    format!("{instruction}\n\n{input}")
                };
                messages.push(message("user", prompt));
                if let Some(out) = rec.get(self.field("output")) {
                    messages.push(message("assistant", string(out, "output")?));
                }
            }
            Shape::Turns => {
                let turns = rec
                    .get(self.field("turns"))
                    .and_then(Value::as_array)
                    .ok_or_else(|| format!("no list `{}`", self.field("turns")))?;
                for (i, t) in turns.iter().enumerate() {
                    messages.push(message("user", string(t, &format!("turns[{i}]"))?));
                }
            }
            Shape::Prompt => {
                let f = self
                    .prompt_field(rec)
                    .ok_or("no prompt field; name it with `fields: {prompt: ...}`")?;
                messages.push(message("user", string(req(rec, f)?, f)?));
                if let Some(f) = self.fields.get("response") {
                    messages.push(message("assistant", string(req(rec, f)?, f)?));
                }
            }
            Shape::Auto => unreachable!("resolved above"),
        }
        if !messages.iter().any(|m| m.role == "user") {
            return Err("no user turn".into());
        }
        let id = match self.fields.get("id") {
            Some(f) => scalar_text(req(rec, f)?),
            None => ID_FIELDS
                .iter()
                .find_map(|f| rec.get(*f).filter(|v| !v.is_null()).map(scalar_text))
                .unwrap_or_else(|| format!("{}-{ordinal}", self.source)),
        };
        let category = match self.fields.get("category") {
            Some(f) => rec.get(f).filter(|v| !v.is_null()).map(scalar_text),
            None => rec
                .get("category")
                .filter(|v| v.is_string())
                .map(scalar_text),
        }
        .or_else(|| match self.category.as_deref() {
            // Judged from the text: the first user turn and the reply after it.
            Some("auto") => {
                let user = messages.iter().position(|m| m.role == "user");
                let text = |i: Option<usize>| i.map_or("", |i| messages[i].content.as_str());
                let reply = user.and_then(|u| {
                    (u + 1..messages.len()).find(|&i| messages[i].role == "assistant")
                });
                Some(crate::topic::classify(text(user), text(reply)).to_owned())
            }
            other => other.map(str::to_owned),
        });
        let metadata = if self.keep.is_empty() {
            None
        } else {
            let kept: serde_json::Map<String, Value> = self
                .keep
                .iter()
                .filter_map(|k| rec.get(k).map(|v| (k.clone(), v.clone())))
                .collect();
            Some(Value::Object(kept).to_string())
        };
        // Tool definitions at the record level (OpenAI function-calling datasets).
        let tools = rec
            .get(self.field("tools"))
            .filter(|v| v.as_array().is_some_and(|a| !a.is_empty()))
            .map(Value::to_string);
        Ok((
            shape,
            Conversation {
                id,
                source: self.source.clone(),
                category,
                messages,
                tools,
                metadata,
                finish_reason: None,
            },
        ))
    }

    fn field_or<'a>(&'a self, name: &str, default: &'a str) -> &'a str {
        self.fields.get(name).map_or(default, String::as_str)
    }
}

fn req<'a>(rec: &'a serde_json::Map<String, Value>, f: &str) -> Result<&'a Value, String> {
    rec.get(f).ok_or_else(|| format!("no field `{f}`"))
}

fn message(role: &str, content: String) -> Message {
    Message {
        role: role.into(),
        content,
        reasoning: None,
        tool_calls: None,
    }
}

fn string(v: &Value, what: &str) -> Result<String, String> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("`{what}` is {}, not a string", kind_of(v)))
}

fn scalar_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Message content: a string, or OpenAI-style parts of which only text parts are allowed.
fn content_text(v: Option<&Value>) -> Result<String, String> {
    match v {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Null) | None => Ok(String::new()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text") | None, Some(Value::String(t))) => out.push_str(t),
                    (Some(t), _) => {
                        return Err(format!("a `{t}` content part (only text is kept)"));
                    }
                    _ => return Err("a content part without text".into()),
                }
            }
            Ok(out)
        }
        Some(other) => Err(format!("content is {}", kind_of(other))),
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// The canonical name of a role as datasets spell it.
pub fn canonical_role(role: &str) -> Option<&'static str> {
    Some(match role.to_ascii_lowercase().as_str() {
        "user" | "human" | "prompter" => "user",
        "assistant" | "gpt" | "bot" | "model" | "chatgpt" | "bing" | "bard" => "assistant",
        "system" => "system",
        "tool" | "function" | "observation" | "ipython" => "tool",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn mapping() -> Mapping {
        Mapping {
            shape: Shape::Auto,
            fields: BTreeMap::new(),
            category: None,
            source: "src".into(),
            keep: vec![],
        }
    }

    #[test]
    fn sharegpt_roles_are_canonical() {
        let (shape, c) = mapping()
            .map(&json!({"id": "x", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}), 0)
            .unwrap();
        assert_eq!(shape, Shape::Sharegpt);
        assert_eq!(c.messages[0].role, "user");
        assert_eq!(c.messages[1].role, "assistant");
        assert_eq!(c.id, "x");
    }

    #[test]
    fn alpaca_joins_instruction_and_input() {
        let (_, c) = mapping()
            .map(
                &json!({"instruction": "Sum", "input": "1 2", "output": "3"}),
                7,
            )
            .unwrap();
        assert_eq!(c.messages[0].content, "Sum\n\n1 2");
        assert_eq!(c.messages[1].content, "3");
        assert_eq!(c.id, "src-7");
    }

    #[test]
    fn turns_and_prompt_and_category() {
        let (s, c) = mapping()
            .map(
                &json!({"question_id": 81, "category": "writing", "turns": ["a", "b"]}),
                0,
            )
            .unwrap();
        assert_eq!(
            (s, c.id.as_str(), c.category.as_deref()),
            (Shape::Turns, "81", Some("writing"))
        );
        assert_eq!(c.messages.len(), 2);
        let (s, c) = mapping()
            .map(&json!({"task_id": "HumanEval/0", "prompt": "def f():"}), 0)
            .unwrap();
        assert_eq!((s, c.id.as_str()), (Shape::Prompt, "HumanEval/0"));
    }

    #[test]
    fn unmappable_records_say_why() {
        let m = mapping();
        assert!(
            m.map(&json!({"foo": 1}), 0)
                .unwrap_err()
                .contains("no known shape")
        );
        let e = m
            .map(
                &json!({"conversations": [{"from": "alien", "value": "x"}]}),
                0,
            )
            .unwrap_err();
        assert!(e.contains("unknown role `alien`"), "{e}");
        let e = m
            .map(
                &json!({"conversations": [{"from": "gpt", "value": "x"}]}),
                0,
            )
            .unwrap_err();
        assert_eq!(e, "no user turn");
    }
}
