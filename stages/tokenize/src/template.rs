//! Chat templates rendered the way Hugging Face `transformers` renders them.
//!
//! `apply_chat_template` compiles the Jinja template in a sandbox with `trim_blocks` and
//! `lstrip_blocks`, the loop-controls extension, its own `tojson` (Python's `json.dumps`, no HTML
//! escaping), `raise_exception` and `strftime_now`, and passes `messages`, `tools`,
//! `add_generation_prompt`, the special tokens (`bos_token`, `eos_token`, ...) and the user's
//! template kwargs (`enable_thinking`, ...). Messages lose their `None` keys and carry their
//! reasoning both as `reasoning_content` and `thinking`. This module reproduces exactly that with
//! minijinja and its Python-compatible string methods, so the text here is byte-for-byte the text
//! `transformers` renders (tested against it in CI).

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Serde, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value as Json};

/// One conversation turn as the template sees it.
#[derive(Clone, Debug, Default)]
pub struct Turn<'a> {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: &'a str,
    /// The visible text.
    pub content: &'a str,
    /// Reasoning, when kept.
    pub reasoning: Option<&'a str>,
    /// Tool calls (parsed JSON).
    pub tool_calls: Option<Json>,
}

/// A compiled chat template with the values every render shares.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Special tokens and user kwargs, merged as `transformers` merges them (kwargs win).
    globals: Map<String, Json>,
}

/// Why a template could not be compiled or rendered.
#[derive(Debug)]
pub struct TemplateError(pub String);

impl std::fmt::Display for TemplateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn describe(e: &Error) -> String {
    // minijinja's Display names the template and line; the detail is in the chain.
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let _ = write!(msg, ": {s}");
        source = s.source();
    }
    msg
}

impl ChatTemplate {
    /// Compile `source`. `special` holds the special tokens (`bos_token`, `eos_token`, ...) and
    /// `kwargs` the template kwargs; both become template globals.
    pub fn new(
        source: &str,
        special: &Map<String, Json>,
        kwargs: &Map<String, Json>,
    ) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("the default delimiters are valid"),
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat_template", source.to_owned())
            .map_err(|e| {
                TemplateError(format!(
                    "the chat template does not compile: {}",
                    describe(&e)
                ))
            })?;
        let mut globals = special.clone();
        for (k, v) in kwargs {
            globals.insert(k.clone(), v.clone());
        }
        Ok(Self { env, globals })
    }

    /// Render `turns` (and `tools`, when given).
    pub fn render(
        &self,
        turns: &[Turn<'_>],
        tools: Option<&Json>,
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let messages: Vec<Json> = turns.iter().map(message_json).collect();
        let mut ctx = self.globals.clone();
        ctx.insert("messages".into(), Json::Array(messages));
        ctx.insert("tools".into(), tools.cloned().unwrap_or(Json::Null));
        ctx.insert("documents".into(), Json::Null);
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(add_generation_prompt),
        );
        let tmpl = self
            .env
            .get_template("chat_template")
            .map_err(|e| TemplateError(describe(&e)))?;
        tmpl.render(Value::from(Serde(&ctx)))
            .map_err(|e| TemplateError(format!("the chat template failed: {}", describe(&e))))
    }
}

/// A message as `transformers` hands it to the template: no `None` keys, reasoning under both
/// names templates read.
fn message_json(t: &Turn<'_>) -> Json {
    let mut m = Map::new();
    if let Some(r) = t.reasoning {
        m.insert("thinking".into(), Json::String(r.to_owned()));
    }
    m.insert("role".into(), Json::String(t.role.to_owned()));
    m.insert("content".into(), Json::String(t.content.to_owned()));
    if let Some(r) = t.reasoning {
        m.insert("reasoning_content".into(), Json::String(r.to_owned()));
    }
    if let Some(c) = &t.tool_calls {
        m.insert("tool_calls".into(), c.clone());
    }
    Json::Object(m)
}

#[allow(clippy::needless_pass_by_value)] // minijinja passes owned arguments
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)` is refused: a render that depends on the day would make the same
/// inputs produce different tokens, which breaks content addressing. Templates that call it
/// (Llama 3's "Today Date") take a `date_string` kwarg instead.
#[allow(clippy::needless_pass_by_value)] // minijinja passes owned arguments
fn strftime_now(format: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "the template calls `strftime_now({format:?})`: its output would change every day, so \
             dflash refuses it; pass the date as a template kwarg (e.g. `date_string`) instead"
        ),
    ))
}

/// Python's `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
/// sort_keys=sort_keys)`, which `transformers` installs as `tojson`.
#[allow(clippy::needless_pass_by_value)] // minijinja passes owned arguments
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.kind() {
            ValueKind::Number => Some(" ".repeat(usize::try_from(v).unwrap_or(0))),
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: bad indent",
                ));
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if !s.is_none() => {
            let a = s.get_item_by_index(0)?;
            let b = s.get_item_by_index(1)?;
            (
                a.as_str().unwrap_or(",").to_owned(),
                b.as_str().unwrap_or(":").to_owned(),
            )
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let json: Json = serde_json::to_value(value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let style = Style {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

struct Style {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl Style {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn write(&self, v: &Json, level: usize, out: &mut String) {
        match v {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => write_number(n, out),
            Json::String(s) => write_string(s, self.ensure_ascii, out),
            Json::Array(items) if items.is_empty() => out.push_str("[]"),
            Json::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push(']');
            }
            Json::Object(map) if map.is_empty() => out.push_str("{}"),
            Json::Object(map) => {
                let mut entries: Vec<(&String, &Json)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    write_string(k, self.ensure_ascii, out);
                    out.push_str(&self.key_sep);
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push('}');
            }
        }
    }
}

/// Numbers as Python prints them: integers as they are, floats by `repr` (`1.0`, `1e-05`).
fn write_number(n: &serde_json::Number, out: &mut String) {
    if n.is_i64() || n.is_u64() {
        out.push_str(&n.to_string());
        return;
    }
    let f = n.as_f64().unwrap_or(0.0);
    #[allow(clippy::float_cmp)] // an exact test for a whole number
    let whole = f == f.trunc();
    if f.is_finite() && whole && f.abs() < 1e16 {
        let _ = write!(out, "{f:.1}");
        return;
    }
    let abs = f.abs();
    if (1e-4..1e16).contains(&abs) {
        let _ = write!(out, "{f}");
    } else {
        // Rust prints `1e-5`, Python `1e-05`: exponents have at least two digits and a sign.
        let s = format!("{f:e}");
        let (mant, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
        let _ = write!(out, "{mant}e{sign}{digits:0>2}");
    }
}

fn write_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, ctx: &Json) -> String {
        let t = ChatTemplate::new(src, &Map::new(), ctx.as_object().unwrap()).unwrap();
        t.render(&[], None, false).unwrap()
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let ctx =
            serde_json::json!({"x": {"b": [1, 2.5, "é<>&\n", null, true], "a": {}, "c": 1e-5}});
        // json.dumps({"b": [1, 2.5, "é<>&\n", None, True], "a": {}, "c": 1e-5}, ensure_ascii=False)
        assert_eq!(
            render("{{ x | tojson }}", &ctx),
            r#"{"b": [1, 2.5, "é<>&\n", null, true], "a": {}, "c": 1e-05}"#
        );
        // json.dumps(..., indent=2)
        assert_eq!(
            render("{{ x.b | tojson(indent=2) }}", &ctx),
            "[\n  1,\n  2.5,\n  \"é<>&\\n\",\n  null,\n  true\n]"
        );
    }

    #[test]
    fn python_string_methods_and_raise_exception() {
        let ctx = serde_json::json!({"s": "\n<think>x</think>\n\nhi"});
        assert_eq!(
            render(
                "{{ s.split('</think>')[-1].lstrip('\\n') }}|{{ s.strip('\\n').startswith('<think>') }}",
                &ctx
            ),
            "hi|True"
        );
        let t = ChatTemplate::new(
            "{{ raise_exception('no system role') }}",
            &Map::new(),
            &Map::new(),
        )
        .unwrap();
        let err = t.render(&[], None, false).unwrap_err();
        assert!(err.0.contains("no system role"), "{}", err.0);
    }
}
