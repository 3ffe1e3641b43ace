//! Where each value of a YAML document sits in its text, so errors found after parsing (an
//! unknown kind, a mistyped param) can point at the offending bytes.
//!
//! serde_yaml gives the values but no positions; this walks saphyr's event stream once and
//! records, for every path (`stages.gen.params.max_tokens`), the byte range of its key and value.
//! Aliases are not followed: a path below an alias resolves to the alias itself.

use std::collections::HashMap;
use std::ops::Range;

use saphyr_parser::{Event, Parser};

/// Byte ranges of keys and values by path.
#[derive(Default, Debug)]
pub struct Spans {
    by_path: HashMap<String, Entry>,
    /// Stages a `matrix:` made (`stages.ID@...`), and where their text is: the declaring stage's,
    /// a param the matrix sets at its value in the list.
    variants: HashMap<String, Variant>,
}

/// Where a matrix variant's paths point in the text.
#[derive(Clone, Debug)]
struct Variant {
    /// The declaring stage's id.
    base: String,
    /// Each param the matrix sets and the index of its value in the param's list.
    set: Vec<(String, usize)>,
}

#[derive(Clone, Debug)]
struct Entry {
    key: Option<Range<usize>>,
    value: Range<usize>,
}

/// Join path segments the way [`Spans`] stores them.
pub fn path_of(segs: &[&str]) -> String {
    segs.join("\u{0}")
}

enum Frame {
    Map {
        path: String,
        pending_key: Option<(String, Range<usize>)>,
    },
    Seq {
        path: String,
        next: usize,
    },
}

impl Spans {
    /// Index `text`. A document saphyr can't parse gives an empty index (serde_yaml reports the
    /// syntax error itself).
    pub fn index(text: &str) -> Self {
        let bytes = CharToByte::new(text);
        let mut spans = Self::default();
        let mut stack: Vec<Frame> = Vec::new();
        let mut open: Vec<(String, usize)> = Vec::new();
        for item in Parser::new_from_str(text) {
            let Ok((event, span)) = item else { break };
            let range = bytes.at(span.start.index())..bytes.at(span.end.index());
            match event {
                Event::Scalar(value, ..) => {
                    if let Some(Frame::Map {
                        pending_key: pending @ None,
                        ..
                    }) = stack.last_mut()
                    {
                        *pending = Some((value.into_owned(), range));
                        continue;
                    }
                    if let Some((path, key)) = next_path(&mut stack) {
                        spans.by_path.insert(path, Entry { key, value: range });
                    }
                }
                Event::Alias(_) => {
                    if let Some((path, key)) = next_path(&mut stack) {
                        spans.by_path.insert(path, Entry { key, value: range });
                    }
                }
                Event::MappingStart(..) | Event::SequenceStart(..) => {
                    let is_map = matches!(event, Event::MappingStart(..));
                    let (path, key) = if stack.is_empty() {
                        (String::new(), None)
                    } else {
                        next_path(&mut stack).unwrap_or_else(|| ("\u{1}complex".into(), None))
                    };
                    spans.by_path.insert(
                        path.clone(),
                        Entry {
                            key,
                            value: range.clone(),
                        },
                    );
                    open.push((path.clone(), range.start));
                    stack.push(if is_map {
                        Frame::Map {
                            path,
                            pending_key: None,
                        }
                    } else {
                        Frame::Seq { path, next: 0 }
                    });
                }
                Event::MappingEnd | Event::SequenceEnd => {
                    stack.pop();
                    if let Some((path, start)) = open.pop()
                        && let Some(entry) = spans.by_path.get_mut(&path)
                    {
                        entry.value = start..range.end.max(start);
                    }
                }
                _ => {}
            }
        }
        spans
    }

    /// The byte range of the value at `path`, or of its nearest ancestor that has one.
    pub fn value(&self, path: &[&str]) -> Range<usize> {
        self.find(path, |e| Some(e.value.clone()))
    }

    /// The byte range of the key at `path` (falling back to its value, then to ancestors).
    pub fn key(&self, path: &[&str]) -> Range<usize> {
        self.find(path, |e| {
            Some(e.key.clone().unwrap_or_else(|| e.value.clone()))
        })
    }

    /// Let `stages.ID` resolve to the text of `base`, which declared it with a `matrix:`
    /// setting each `(param, index)` of `set`.
    pub fn add_variant(&mut self, id: &str, base: &str, set: Vec<(String, usize)>) {
        self.variants.insert(
            id.to_owned(),
            Variant {
                base: base.to_owned(),
                set,
            },
        );
    }

    fn find(&self, path: &[&str], pick: impl Fn(&Entry) -> Option<Range<usize>>) -> Range<usize> {
        // A variant's path: its param the matrix sets, at that value in the list; else the
        // declaring stage's own.
        if let ["stages", id, rest @ ..] = path
            && let Some(v) = self.variants.get(*id)
        {
            let mut to: Vec<String> = vec!["stages".into(), v.base.clone()];
            let set = match rest {
                ["params", param, below @ ..] => v
                    .set
                    .iter()
                    .find(|(p, _)| p == param)
                    .map(|(p, i)| (p, i, below)),
                _ => None,
            };
            match set {
                Some((param, i, below)) => {
                    to.extend(["matrix".into(), param.clone(), i.to_string()]);
                    to.extend(below.iter().map(|s| (*s).to_owned()));
                }
                None => to.extend(rest.iter().map(|s| (*s).to_owned())),
            }
            let to: Vec<&str> = to.iter().map(String::as_str).collect();
            return self.find(&to, pick);
        }
        (0..=path.len())
            .rev()
            .find_map(|n| self.by_path.get(&path_of(&path[..n])).and_then(&pick))
            .unwrap_or(0..0)
    }
}

fn next_path(stack: &mut [Frame]) -> Option<(String, Option<Range<usize>>)> {
    match stack.last_mut()? {
        Frame::Map { path, pending_key } => {
            let (key, key_range) = pending_key.take()?;
            Some((join(path, &key), Some(key_range)))
        }
        Frame::Seq { path, next } => {
            let p = join(path, &next.to_string());
            *next += 1;
            Some((p, None))
        }
    }
}

fn join(parent: &str, seg: &str) -> String {
    if parent.is_empty() {
        seg.to_owned()
    } else {
        format!("{parent}\u{0}{seg}")
    }
}

/// saphyr counts characters; miette wants bytes. ASCII text maps one to one; otherwise a table
/// of each character's byte offset, built once, keeps the lookups O(1).
struct CharToByte {
    len: usize,
    offsets: Option<Vec<usize>>,
}

impl CharToByte {
    fn new(text: &str) -> Self {
        let offsets = (!text.is_ascii()).then(|| text.char_indices().map(|(b, _)| b).collect());
        Self {
            len: text.len(),
            offsets,
        }
    }

    fn at(&self, chars: usize) -> usize {
        match &self.offsets {
            None => chars.min(self.len),
            Some(offsets) => offsets.get(chars).copied().unwrap_or(self.len),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nested_keys_and_values() {
        let text = "stages:\n  a:\n    kind: comand\n    inputs: [b, c]\n";
        let s = Spans::index(text);
        assert_eq!(&text[s.value(&["stages", "a", "kind"])], "comand");
        assert_eq!(&text[s.key(&["stages", "a", "kind"])], "kind");
        assert_eq!(&text[s.value(&["stages", "a", "inputs", "1"])], "c");
        // Unknown paths fall back to the nearest ancestor.
        assert_eq!(&text[s.key(&["stages", "a", "nope"])], "a");
    }

    #[test]
    fn non_ascii_offsets_are_bytes() {
        let text = "name: é\nstages:\n  ü: {kind: x}\n";
        let s = Spans::index(text);
        assert_eq!(&text[s.value(&["stages", "ü", "kind"])], "x");
    }
}
