//! The composition report of a mix: counts and shares per source and category before and
//! after, what was removed and why, quota shortfalls and the prompt length distribution.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{Map, Value, json};

/// Counts per source and per category.
#[derive(Default)]
pub struct Composition {
    /// Rows per source.
    pub sources: BTreeMap<String, u64>,
    /// Rows per category (`(none)` when a row has none).
    pub categories: BTreeMap<String, u64>,
    /// Prompt lengths in characters (pass 1 only).
    pub chars: Vec<u32>,
}

impl Composition {
    /// Count one row.
    pub fn add(&mut self, source: &str, category: Option<&str>, chars: usize) {
        *self.sources.entry(source.to_owned()).or_default() += 1;
        *self
            .categories
            .entry(category.unwrap_or("(none)").to_owned())
            .or_default() += 1;
        if chars > 0 {
            self.chars.push(chars as u32);
        }
    }

    fn total(&self) -> u64 {
        self.sources.values().sum()
    }
}

/// Everything the report says.
#[derive(Default)]
pub struct Report {
    /// The inputs.
    pub before: Composition,
    /// The output.
    pub after: Composition,
    /// Prompt lengths of the rows taken.
    pub after_chars: Vec<u32>,
    /// Rows filtered out, by reason.
    pub filtered: BTreeMap<String, u64>,
    /// Exact duplicates removed.
    pub exact_dups: u64,
    /// Near duplicates removed.
    pub near_dups: u64,
    /// Rows of groups not listed in `weights`/`quotas`.
    pub not_listed: u64,
    /// Rows left out because their group's quota was full.
    pub over_quota: u64,
    /// Rows of the held-out inputs (`exclude`).
    pub held_out_rows: u64,
    /// Rows dropped because their prompt copies or nearly copies a held-out one.
    pub held_out_copies: u64,
    /// Quotas that could not be met.
    pub shortfalls: Vec<Value>,
    /// Groups named in `weights`/`quotas` that no input has.
    pub unknown_groups: Vec<String>,
}

fn quantiles(v: &mut [u32]) -> Value {
    if v.is_empty() {
        return json!(null);
    }
    v.sort_unstable();
    let q = |f: f64| v[((v.len() - 1) as f64 * f).round() as usize];
    json!({"p10": q(0.1), "p50": q(0.5), "p90": q(0.9), "max": v[v.len() - 1]})
}

impl Report {
    /// One line per shortfall.
    pub fn shortfall_text(&self) -> String {
        self.shortfalls
            .iter()
            .map(|s| {
                format!(
                    "`{}` wants {} but has {} after dedup and filters",
                    s["group"].as_str().unwrap_or("?"),
                    s["quota"],
                    s["taken"]
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The manifest's stats.
    pub fn stats(&mut self, counts: &BTreeMap<&str, u64>) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("rows".into(), json!(counts.values().sum::<u64>()));
        m.insert("splits".into(), json!(counts));
        m.insert("sources".into(), json!(self.after.sources));
        m.insert("categories".into(), json!(self.after.categories));
        m.insert("before".into(), json!({"rows": self.before.total(), "sources": self.before.sources, "categories": self.before.categories, "prompt_chars": quantiles(&mut self.before.chars)}));
        m.insert("removed".into(), json!({"exact_duplicates": self.exact_dups, "near_duplicates": self.near_dups, "filtered": self.filtered, "not_listed": self.not_listed, "over_quota": self.over_quota, "held_out_copies": self.held_out_copies}));
        m.insert("held_out_rows".into(), json!(self.held_out_rows));
        m.insert("prompt_chars".into(), quantiles(&mut self.after_chars));
        m.insert("shortfalls".into(), json!(self.shortfalls));
        m.insert("unknown_groups".into(), json!(self.unknown_groups));
        m
    }

    /// The report as a table for the log and the terminal.
    pub fn render(&self, by: &str, counts: &BTreeMap<&str, u64>) -> String {
        let mut s = String::new();
        for (title, b, a) in [
            ("source", &self.before.sources, &self.after.sources),
            ("category", &self.before.categories, &self.after.categories),
        ] {
            let (tb, ta) = (
                self.before.total().max(1) as f64,
                self.after.total().max(1) as f64,
            );
            let _ = writeln!(
                s,
                "{title:<24} {:>10} {:>7}   {:>10} {:>7}",
                "before", "share", "after", "share"
            );
            let names: std::collections::BTreeSet<&String> = b.keys().chain(a.keys()).collect();
            for n in names {
                let (x, y) = (
                    b.get(n).copied().unwrap_or(0),
                    a.get(n).copied().unwrap_or(0),
                );
                let _ = writeln!(
                    s,
                    "{n:<24} {x:>10} {:>6.1}%   {y:>10} {:>6.1}%",
                    100.0 * x as f64 / tb,
                    100.0 * y as f64 / ta
                );
            }
            let _ = writeln!(s);
        }
        let _ = writeln!(
            s,
            "removed: {} exact duplicates, {} near duplicates, {} filtered {:?}, {} not in the {by} weights, {} over quota",
            self.exact_dups,
            self.near_dups,
            self.filtered.values().sum::<u64>(),
            self.filtered,
            self.not_listed,
            self.over_quota
        );
        if self.held_out_rows > 0 {
            let _ = writeln!(
                s,
                "held out: {} rows of the excluded inputs; {} rows copying or nearly copying one of their prompts dropped",
                self.held_out_rows, self.held_out_copies
            );
        }
        let _ = writeln!(s, "splits: {counts:?}");
        if !self.shortfalls.is_empty() {
            let _ = writeln!(s, "quota not met: {}", self.shortfall_text());
        }
        if !self.unknown_groups.is_empty() {
            let _ = writeln!(
                s,
                "named but absent from the inputs: {}",
                self.unknown_groups.join(", ")
            );
        }
        s
    }
}
