//! Generated rows saved as they come: create-only shards of the conversation dataset, each
//! `<split>-<nnnnn>.arrow` plus a report `_generate/<split>-<nnnnn>.json` naming the requests it
//! answers. A shard is committed every `shard_rows` rows or `shard_seconds` seconds, whichever
//! comes first; a rerun reads the reports of committed shards and sends only what they lack.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use dflash_stage_api::dataset::{self, Conversation, Writer};
use dflash_stage_api::{StageContext, StageError};
use serde::{Deserialize, Serialize};

/// What one shard holds.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct ShardReport {
    /// The split its rows belong to.
    pub split: String,
    /// Its number within the split.
    pub index: usize,
    /// The requests it answers (see `Task::key`), including rows dropped by policy.
    pub keys: Vec<String>,
    /// Rows written.
    pub rows: u64,
    /// Rows by `finish_reason`.
    pub finish: BTreeMap<String, u64>,
    /// Rows answered but not written (truncated, with `truncated: drop`).
    pub dropped: u64,
    /// Tokens generated.
    pub completion_tokens: u64,
}

/// The shards committed by earlier attempts.
pub struct Resumed {
    /// Their reports.
    pub reports: Vec<ShardReport>,
    /// Every request already answered.
    pub keys: HashSet<String>,
}

/// Read the reports of the shards already committed.
pub fn resume(ctx: &StageContext<'_>) -> Result<Resumed, StageError> {
    let mut reports = Vec::new();
    let mut keys = HashSet::new();
    for name in ctx.shards.done() {
        let bytes = ctx.shards.read(&name, &report_path(&name))?;
        let r: ShardReport = serde_json::from_slice(&bytes)
            .map_err(|e| StageError::new(format!("shard {name}'s report is unreadable: {e}")))?;
        keys.extend(r.keys.iter().cloned());
        reports.push(r);
    }
    Ok(Resumed { reports, keys })
}

fn report_path(name: &str) -> String {
    format!("_generate/{name}.json")
}

/// One answered request, ready to be saved.
pub struct Answered {
    /// The request's key.
    pub key: String,
    /// The split of its prompt.
    pub split: String,
    /// The row, or `None` when policy drops it.
    pub row: Option<Conversation>,
    /// Tokens generated.
    pub completion_tokens: u64,
}

/// Buffers answered rows per split and commits them as shards.
pub struct ShardWriter<'a> {
    ctx: &'a StageContext<'a>,
    rows: usize,
    every: Duration,
    pending: BTreeMap<String, (Vec<Answered>, Instant)>,
    next: BTreeMap<String, usize>,
    /// Reports of every shard, earlier attempts' included.
    pub reports: Vec<ShardReport>,
}

impl<'a> ShardWriter<'a> {
    /// A writer continuing after `resumed`'s shards.
    pub fn new(ctx: &'a StageContext<'a>, resumed: &Resumed, rows: usize, every: Duration) -> Self {
        let mut next: BTreeMap<String, usize> = BTreeMap::new();
        for r in &resumed.reports {
            let n = next.entry(r.split.clone()).or_default();
            *n = (*n).max(r.index + 1);
        }
        Self {
            ctx,
            rows: rows.max(1),
            every,
            pending: BTreeMap::new(),
            next,
            reports: resumed.reports.clone(),
        }
    }

    /// Add one answered request; commits its split's shard when full.
    pub fn push(&mut self, a: Answered) -> Result<(), StageError> {
        let split = a.split.clone();
        let entry = self
            .pending
            .entry(split.clone())
            .or_insert_with(|| (Vec::new(), Instant::now()));
        entry.0.push(a);
        if entry.0.len() >= self.rows {
            self.flush(&split)?;
        }
        Ok(())
    }

    /// Commit every split whose oldest pending row waited longer than `shard_seconds`.
    pub fn tick(&mut self) -> Result<(), StageError> {
        let due: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, (rows, since))| !rows.is_empty() && since.elapsed() >= self.every)
            .map(|(s, _)| s.clone())
            .collect();
        for s in due {
            self.flush(&s)?;
        }
        Ok(())
    }

    /// Commit everything pending.
    pub fn finish(&mut self) -> Result<(), StageError> {
        let splits: Vec<String> = self.pending.keys().cloned().collect();
        for s in splits {
            self.flush(&s)?;
        }
        Ok(())
    }

    fn flush(&mut self, split: &str) -> Result<(), StageError> {
        let Some((answered, _)) = self.pending.remove(split) else {
            return Ok(());
        };
        if answered.is_empty() {
            return Ok(());
        }
        let index = {
            let n = self.next.entry(split.to_owned()).or_default();
            *n += 1;
            *n - 1
        };
        let name = format!("{split}-{index:05}");
        let dir = self.ctx.scratch_dir.join(format!("shard-{name}"));
        std::fs::create_dir_all(dir.join("_generate"))?;
        let mut report = ShardReport {
            split: split.to_owned(),
            index,
            ..ShardReport::default()
        };
        let mut writer = Writer::create(&dir.join(dataset::file_name(split, index)))?;
        for a in answered {
            report.keys.push(a.key);
            report.completion_tokens += a.completion_tokens;
            match a.row {
                Some(row) => {
                    *report
                        .finish
                        .entry(row.finish_reason.clone().unwrap_or_default())
                        .or_default() += 1;
                    report.rows += 1;
                    writer.push(row)?;
                }
                None => report.dropped += 1,
            }
        }
        writer.finish()?;
        std::fs::write(
            dir.join(report_path(&name)),
            serde_json::to_vec_pretty(&report).expect("json"),
        )?;
        self.ctx.shards.commit(&name, &dir)?;
        let _ = std::fs::remove_dir_all(&dir);
        self.reports.push(report);
        Ok(())
    }
}
