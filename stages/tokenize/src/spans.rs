//! Where, in the rendered text, the model generated: the character spans of assistant turns.
//!
//! Spans come from the template itself, never from patterns over special strings:
//! - a turn starts where the template, asked for a generation prompt after the messages before
//!   it, stops agreeing with the full render (so the header and anything the generation prompt
//!   adds, such as Qwen3's empty `<think></think>` when thinking is off, stay prompt) — or where
//!   its content starts, if that is earlier: the agreement can run on into a reply that happens
//!   to begin like the rest of the generation prompt (a reply `<https://...>` against Qwen3's
//!   `<think>` with thinking off), and the content is always generated. The content's start is
//!   found as its end is, with a marker put before it;
//! - its content ends where a marker appended to the content (before any trailing whitespace)
//!   appears in a second render — a private-use character the text does not contain — which
//!   follows whatever the template does to the content (splitting off reasoning, trimming);
//! - it ends after the first end-of-turn token the template writes after the content (tool calls
//!   in between are generated text too), within the turn.
//!
//! Byte offsets of the full render; `tokens` maps them onto tokens.

use std::ops::Range;

use serde_json::Value as Json;

use crate::template::{ChatTemplate, Turn};

/// Which assistant turns are trained on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    /// Every assistant turn.
    All,
    /// Only the last one.
    Last,
}

/// A rendered conversation and the byte spans of the text the model generated.
#[derive(Debug)]
pub struct Rendered {
    /// The full render.
    pub text: String,
    /// Spans of generated text, in order, not overlapping.
    pub spans: Vec<Range<usize>>,
    /// Whether the conversation's final assistant turn, when chosen, does not follow the
    /// template's generation prompt: the data was written in another mode than the template
    /// serves (thinking on/off). Earlier turns are not counted: templates render history
    /// otherwise than what they serve (Qwen3 drops the think block from it), which is no
    /// mismatch.
    pub unlike_prompt: u32,
}

/// Why spans could not be found.
#[derive(Debug, PartialEq, Eq)]
pub enum SpanError {
    /// No assistant turn to train on (one that opens the conversation does not count).
    NoAssistantTurn,
    /// The template failed.
    Template(String),
    /// The template renders an assistant turn in a way the rules above cannot follow.
    Unlocatable(usize),
}

/// Render `turns` and find the generated spans. `end_tokens` are the strings that end a turn
/// (the tokenizer's end-of-sequence and end-of-turn tokens); `truncated_last` says the last
/// assistant turn was cut off by a length limit, so it has no end-of-turn token of its own.
pub fn render(
    template: &ChatTemplate,
    turns: &[Turn<'_>],
    tools: Option<&Json>,
    which: Which,
    end_tokens: &[String],
    truncated_last: bool,
) -> Result<Rendered, SpanError> {
    let t = |e: crate::template::TemplateError| SpanError::Template(e.0);
    let mut chosen: Vec<usize> = turns
        .iter()
        .enumerate()
        // An assistant turn that opens the conversation answered nothing: never trained on.
        .filter(|(i, m)| *i > 0 && m.role == "assistant")
        .map(|(i, _)| i)
        .collect();
    if which == Which::Last {
        chosen = chosen.split_off(chosen.len().saturating_sub(1));
    }
    let Some(&last_assistant) = chosen.last() else {
        return Err(SpanError::NoAssistantTurn);
    };
    let text = template.render(turns, tools, false).map_err(t)?;

    let mut starts = Vec::with_capacity(chosen.len());
    let mut unlike_prompt = 0;
    let final_turn = turns.iter().rposition(|m| m.role == "assistant");
    for &i in &chosen {
        let prompt = template.render(&turns[..i], tools, true).map_err(t)?;
        let start = common_prefix(&prompt, &text);
        unlike_prompt += u32::from(start < prompt.len() && Some(i) == final_turn);
        starts.push(start);
    }
    let content_starts = marked(template, turns, tools, &chosen, &text, Mark::Start)?;
    for (start, content) in starts.iter_mut().zip(content_starts) {
        if let Some(c) = content {
            *start = (*start).min(c);
        }
    }
    let ends: Vec<usize> = marked(template, turns, tools, &chosen, &text, Mark::End)?
        .into_iter()
        .zip(&starts)
        .map(|(e, &s)| e.unwrap_or(s))
        .collect();

    let mut spans: Vec<Range<usize>> = Vec::with_capacity(chosen.len());
    for (k, &i) in chosen.iter().enumerate() {
        let (start, content_end) = (starts[k], ends[k]);
        if content_end < start || spans.last().is_some_and(|p| p.end > start) {
            return Err(SpanError::Unlocatable(i));
        }
        // The end-of-turn token is generated too, unless generation was cut off.
        let limit = starts.get(k + 1).copied().unwrap_or(text.len());
        let cut_off = truncated_last && i == last_assistant && i == turns.len() - 1;
        let end = if cut_off {
            content_end
        } else {
            end_of_turn(&text[content_end..limit], end_tokens)
                .map_or(content_end, |e| content_end + e)
        };
        spans.push(start..end);
    }
    Ok(Rendered {
        text,
        spans,
        unlike_prompt,
    })
}

/// Where a marker goes in a turn's content.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mark {
    /// Before its first non-whitespace character (templates often strip leading newlines).
    Start,
    /// After its last non-whitespace character (templates often trim trailing whitespace).
    End,
}

/// Byte offset in `text` where each chosen turn's content starts or ends (`mark`): `None` for
/// empty content, and, for a start, where the template does not render the marked content as
/// it is (the marker moved into reasoning it drops, say). An end that cannot be found is an
/// error: it bounds the turn.
fn marked(
    template: &ChatTemplate,
    turns: &[Turn<'_>],
    tools: Option<&Json>,
    chosen: &[usize],
    text: &str,
    mark: Mark,
) -> Result<Vec<Option<usize>>, SpanError> {
    let t = |e: crate::template::TemplateError| SpanError::Template(e.0);
    let marker = (0xE000..=0xF8FF)
        .filter_map(char::from_u32)
        .find(|c| !text.contains(*c) && turns.iter().all(|m| !m.content.contains(*c)))
        .ok_or(SpanError::Unlocatable(chosen[0]))?;
    // Empty content stays unmarked: a marker would make it truthy and change what the template
    // renders; its end is the turn's start (reasoning and tool calls follow as generated text).
    let to_mark: Vec<usize> = chosen
        .iter()
        .copied()
        .filter(|&i| !turns[i].content.is_empty())
        .collect();
    let with_marker = |only: &[usize]| -> Vec<String> {
        turns
            .iter()
            .enumerate()
            .map(|(i, m)| {
                if !only.contains(&i) {
                    return m.content.to_owned();
                }
                if mark == Mark::Start {
                    let body = m.content.trim_start();
                    let lead = &m.content[..m.content.len() - body.len()];
                    return format!("{lead}{marker}{body}");
                }
                // Before trailing whitespace, which templates often trim (Llama 3's `| trim`).
                let body = m.content.trim_end();
                format!("{body}{marker}{}", &m.content[body.len()..])
            })
            .collect()
    };
    let marked_render = |only: &[usize]| -> Result<Option<Vec<usize>>, SpanError> {
        let contents = with_marker(only);
        let with_markers: Vec<Turn<'_>> = turns
            .iter()
            .zip(&contents)
            .map(|(m, c)| Turn {
                content: c,
                ..m.clone()
            })
            .collect();
        let out = template.render(&with_markers, tools, false).map_err(t)?;
        // Trust the positions only if the markers were all the render changed.
        if out.replace(marker, "") != text {
            return Ok(None);
        }
        let positions: Vec<usize> = out.match_indices(marker).map(|(p, _)| p).collect();
        if positions.len() != only.len() {
            return Ok(None);
        }
        let w = marker.len_utf8();
        Ok(Some(
            positions
                .iter()
                .enumerate()
                .map(|(k, p)| p - k * w)
                .collect(),
        ))
    };

    let mut found: Vec<Option<usize>> = vec![None; chosen.len()];
    let index_of = |i: usize| chosen.iter().position(|&c| c == i).expect("chosen");
    if !to_mark.is_empty() {
        if let Some(all) = marked_render(&to_mark)? {
            for (&i, e) in to_mark.iter().zip(all) {
                found[index_of(i)] = Some(e);
            }
        } else {
            // One marker at a time, for templates whose output depends on the content in ways a
            // marker in every turn disturbs.
            for &i in &to_mark {
                match (marked_render(&[i])?, mark) {
                    (Some(e), _) => found[index_of(i)] = Some(e[0]),
                    (None, Mark::Start) => {}
                    (None, Mark::End) => return Err(SpanError::Unlocatable(i)),
                }
            }
        }
    }
    Ok(found)
}

/// Bytes up to the end of the first end-of-turn token in `rest`.
fn end_of_turn(rest: &str, end_tokens: &[String]) -> Option<usize> {
    end_tokens
        .iter()
        .filter(|t| !t.is_empty())
        .filter_map(|t| rest.find(t.as_str()).map(|p| p + t.len()))
        .min()
}

/// Length in bytes of the common prefix of `a` and `b`, on a character boundary.
fn common_prefix(a: &str, b: &str) -> usize {
    let mut n = a
        .as_bytes()
        .iter()
        .zip(b.as_bytes())
        .take_while(|(x, y)| x == y)
        .count();
    while !a.is_char_boundary(n) {
        n -= 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Map;

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    fn turn<'a>(role: &'a str, content: &'a str) -> Turn<'a> {
        Turn {
            role,
            content,
            ..Turn::default()
        }
    }

    fn spans_text(r: &Rendered) -> Vec<&str> {
        r.spans.iter().map(|s| &r.text[s.clone()]).collect()
    }

    #[test]
    fn chatml_turns_cover_content_and_end_token() {
        let tpl = ChatTemplate::new(CHATML, &Map::new(), &Map::new()).unwrap();
        let turns = [
            turn("user", "hi"),
            turn("assistant", "héllo"),
            turn("user", "more"),
            turn("assistant", "ok"),
        ];
        let end = vec!["<|im_end|>".to_owned()];
        let all = render(&tpl, &turns, None, Which::All, &end, false).unwrap();
        assert_eq!(spans_text(&all), ["héllo<|im_end|>", "ok<|im_end|>"]);
        let last = render(&tpl, &turns, None, Which::Last, &end, false).unwrap();
        assert_eq!(spans_text(&last), ["ok<|im_end|>"]);
        let cut = render(&tpl, &turns, None, Which::Last, &end, true).unwrap();
        assert_eq!(
            spans_text(&cut),
            ["ok"],
            "a cut-off turn never generated its end token"
        );
    }

    /// A generation prompt that adds an empty think block (Qwen3 with thinking off) to a header
    /// that earlier turns render without one: a reply that begins like that block keeps its
    /// first characters trained.
    #[test]
    fn a_reply_that_begins_like_the_generation_prompt_is_trained_whole() {
        let tpl = ChatTemplate::new(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
             {% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}",
            &Map::new(),
            &Map::new(),
        )
        .unwrap();
        let end = vec!["<|im_end|>".to_owned()];
        for reply in [
            "<https://example.com>",
            "<think",
            "<",
            "</",
            "<t",
            "<think>\n",
            "plain",
        ] {
            let turns = [
                turn("user", "q"),
                turn("assistant", reply),
                turn("user", "again"),
                turn("assistant", "<x"),
            ];
            let r = render(&tpl, &turns, None, Which::All, &end, false).unwrap();
            assert_eq!(
                spans_text(&r),
                [format!("{reply}<|im_end|>"), "<x<|im_end|>".to_owned()],
                "{reply:?}"
            );
        }
    }

    #[test]
    fn a_conversation_without_an_answer_has_nothing_to_train() {
        let tpl = ChatTemplate::new(CHATML, &Map::new(), &Map::new()).unwrap();
        let err = render(&tpl, &[turn("user", "hi")], None, Which::All, &[], false).unwrap_err();
        assert_eq!(err, SpanError::NoAssistantTurn);
    }

    #[test]
    fn content_the_template_rewrites_is_followed() {
        // A template that drops everything up to `</think>` and upper-cases nothing else.
        let src = "{% for m in messages %}[{{ m.role }}]{{ m.content.split('</think>')[-1] | trim }}[end]{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}";
        let tpl = ChatTemplate::new(src, &Map::new(), &Map::new()).unwrap();
        let turns = [
            turn("user", "q"),
            turn("assistant", "<think>r</think>  answer "),
        ];
        let r = render(&tpl, &turns, None, Which::All, &["[end]".into()], false).unwrap();
        assert_eq!(spans_text(&r), ["answer[end]"]);
    }
}
