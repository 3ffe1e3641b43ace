//! What `tokenize` reports: rows and tokens kept, the share of tokens trained on, a length
//! histogram, and rows dropped by reason with a few examples. Kept per file (so a resumed run
//! reads back the files it already did) and merged for the manifest and the terminal.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use serde_json::{Value as Json, json};

use crate::output::Row;

/// Examples of dropped rows kept per reason.
const EXAMPLES: usize = 5;

/// Why a row was dropped, and the detail for one example.
#[derive(Debug)]
pub struct Drop {
    reason: &'static str,
    detail: Option<String>,
}

impl Drop {
    /// A drop whose reason says it all.
    pub fn new(reason: &'static str) -> Self {
        Self {
            reason,
            detail: None,
        }
    }

    /// A drop with a detail for its example.
    pub fn detail(reason: &'static str, detail: impl std::fmt::Display) -> Self {
        Self {
            reason,
            detail: Some(detail.to_string()),
        }
    }
}

/// Counts for one file, or merged over all.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct FileStats {
    /// Rows written.
    pub rows: u64,
    /// Tokens written.
    pub tokens: u64,
    /// Tokens with `loss_mask = 1`.
    pub trained_tokens: u64,
    /// Rows cut at `max_length`.
    pub cut_rows: u64,
    /// The longest row.
    pub max_length: u64,
    /// Rows per length bucket, keyed by the bucket's upper bound (powers of two).
    pub lengths: BTreeMap<u64, u64>,
    /// Rows dropped, by reason.
    pub dropped: BTreeMap<String, u64>,
    /// A few dropped rows: `id: reason (detail)`.
    pub examples: Vec<String>,
    /// Trained turns whose text does not follow the template's generation prompt.
    pub unlike_prompt: u64,
    /// A few rows with such turns (a thinking-mode mismatch, most often).
    pub unlike_prompt_rows: Vec<String>,
}

impl FileStats {
    /// Count a kept row; `unlike_prompt` counts its trained turns that do not follow the
    /// generation prompt; `cut` says it was cut at `max_length`.
    pub fn add(&mut self, row: &Row, unlike_prompt: u32, cut: bool) {
        self.unlike_prompt += u64::from(unlike_prompt);
        if unlike_prompt > 0 && self.unlike_prompt_rows.len() < EXAMPLES {
            self.unlike_prompt_rows.push(row.id.clone());
        }
        let n = row.input_ids.len() as u64;
        self.rows += 1;
        self.tokens += n;
        self.trained_tokens += row
            .loss_mask
            .iter()
            .map(|&m| u64::from(m as u8))
            .sum::<u64>();
        self.cut_rows += u64::from(cut);
        self.max_length = self.max_length.max(n);
        *self
            .lengths
            .entry(n.next_power_of_two().max(1))
            .or_default() += 1;
    }

    /// Count a dropped row.
    pub fn drop(&mut self, id: &str, d: &Drop) {
        *self.dropped.entry(d.reason.to_owned()).or_default() += 1;
        if self.examples.len() < EXAMPLES {
            let detail = d
                .detail
                .as_ref()
                .map_or(String::new(), |x| format!(" ({x})"));
            self.examples.push(format!("`{id}`: {}{detail}", d.reason));
        }
    }

    /// The sum of several files' counts.
    pub fn merge(parts: &[Self]) -> Self {
        let mut all = Self::default();
        for p in parts {
            all.rows += p.rows;
            all.tokens += p.tokens;
            all.trained_tokens += p.trained_tokens;
            all.cut_rows += p.cut_rows;
            all.max_length = all.max_length.max(p.max_length);
            for (k, v) in &p.lengths {
                *all.lengths.entry(*k).or_default() += v;
            }
            for (k, v) in &p.dropped {
                *all.dropped.entry(k.clone()).or_default() += v;
            }
            for e in &p.examples {
                if all.examples.len() < EXAMPLES {
                    all.examples.push(e.clone());
                }
            }
            all.unlike_prompt += p.unlike_prompt;
            for e in &p.unlike_prompt_rows {
                if all.unlike_prompt_rows.len() < EXAMPLES {
                    all.unlike_prompt_rows.push(e.clone());
                }
            }
        }
        all
    }

    fn trained_share(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.trained_tokens as f64 / self.tokens as f64
        }
    }

    /// The manifest's stats.
    pub fn to_manifest(&self, how: &Json) -> serde_json::Map<String, Json> {
        let lengths: serde_json::Map<String, Json> = self
            .lengths
            .iter()
            .map(|(k, v)| (format!("<={k}"), json!(v)))
            .collect();
        let out = json!({
            "rows": self.rows,
            "tokens": self.tokens,
            "trained_tokens": self.trained_tokens,
            "trained_share": (self.trained_share() * 10_000.0).round() / 10_000.0,
            "mean_length": if self.rows == 0 { 0.0 } else { (self.tokens as f64 / self.rows as f64 * 10.0).round() / 10.0 },
            "max_length": self.max_length,
            "cut_at_max_length": self.cut_rows,
            "length_histogram": lengths,
            "dropped": self.dropped.values().sum::<u64>(),
            "dropped_reasons": self.dropped,
            "dropped_examples": self.examples,
            "turns_unlike_generation_prompt": self.unlike_prompt,
            "turns_unlike_generation_prompt_examples": self.unlike_prompt_rows,
            "tokenization": how,
        });
        match out {
            Json::Object(m) => m,
            _ => unreachable!("an object literal"),
        }
    }

    /// A few lines for the terminal.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "{} rows, {} tokens, {:.1}% trained on (mean {:.0} tokens, longest {})",
            self.rows,
            self.tokens,
            self.trained_share() * 100.0,
            if self.rows == 0 {
                0.0
            } else {
                self.tokens as f64 / self.rows as f64
            },
            self.max_length
        );
        if self.cut_rows > 0 {
            let _ = write!(s, "; {} cut at max_length", self.cut_rows);
        }
        if self.unlike_prompt > 0 {
            let _ = write!(
                s,
                "\nnote: {} trained turns do not follow the template's generation prompt (e.g. `{}`): \
                 check the thinking mode (`template_kwargs`)",
                self.unlike_prompt,
                self.unlike_prompt_rows.first().map_or("", String::as_str)
            );
        }
        for (reason, n) in &self.dropped {
            let _ = write!(s, "\ndropped {n}: {reason}");
        }
        s
    }
}
