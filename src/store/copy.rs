//! Copying artifacts between stores (`dflash copy`): from a GPU box's local store to S3 and
//! back, or a small seed for a machine that can carry only so much.
//!
//! Only whole artifacts travel, and in an order that never leaves a half one: an artifact's
//! blobs first (each read back against its digest), its manifest last, so the destination
//! never holds a manifest whose files are missing. Finished shards of stages still in progress
//! go the same way (blobs, then the record), so a run on the destination resumes them; run
//! records go as they are. Every write is create-only: what the destination already holds is
//! left as it is and counted, never replaced. A copy writes its own record under
//! `copies/<id>.json` through [`Store::create_probed`], the destination's create-only probe,
//! as a run's begin record is.

use std::collections::{BTreeSet, HashMap};

use serde::Serialize;

use super::{Manifest, Put, ShardRecord, Store, StoreError};
use crate::key::Key;

/// Which artifacts to copy.
#[derive(Debug, Default, Clone)]
pub struct Filter {
    /// Only artifacts of these stage ids (every stage when empty).
    pub stages: Vec<String>,
    /// Leave out an artifact with any file of this many bytes or more.
    pub max_file_bytes: Option<u64>,
}

/// What a copy did.
#[derive(Debug, Default, Serialize)]
pub struct CopyReport {
    /// Artifacts written to the destination (their manifests created).
    pub copied: Vec<String>,
    /// Artifacts the destination held already.
    pub already_there: usize,
    /// Artifacts left out by `max_file_bytes`, by stage id.
    pub too_large: Vec<String>,
    /// Artifacts left out because the source lacks one of their blobs (`dflash verify` there).
    pub incomplete: Vec<String>,
    /// Finished shards of stages in progress, copied.
    pub shards: usize,
    /// Run records copied.
    pub run_records: usize,
    /// Blobs written (the rest were there already).
    pub blobs: usize,
    /// Bytes of the blobs written.
    pub bytes: u64,
}

/// Copy what `filter` selects from `from` to `to`; see the module docs. `copied` is told each
/// artifact's stage id as its manifest lands. `allow_overwrite` copies into a store that failed
/// the create-only probe, as `run --allow-overwriting-store` runs on one.
pub async fn copy(
    from: &Store,
    to: &Store,
    filter: &Filter,
    allow_overwrite: bool,
    copied: &dyn Fn(&str),
) -> Result<CopyReport, StoreError> {
    let record = serde_json::json!({"from": from.url()});
    to.create_probed(
        &format!("copies/{}.json", crate::run::new_run_id()),
        &record,
        allow_overwrite,
    )
    .await?;
    let mut report = CopyReport::default();
    let wanted = |stage: &str| filter.stages.is_empty() || filter.stages.iter().any(|s| s == stage);
    let fits = |size: u64| filter.max_file_bytes.is_none_or(|max| size < max);
    let keys: BTreeSet<Key> = from.keys().await?.into_iter().collect();
    for key in &keys {
        let rel = format!("manifests/{key}.json");
        let Some(raw) = from.get(&rel).await? else {
            continue;
        };
        let m: Manifest = serde_json::from_slice(&raw).map_err(|e| StoreError::Decode {
            url: from.url().to_owned(),
            path: rel.clone(),
            reason: e.to_string(),
        })?;
        if !wanted(&m.lineage.stage_id) {
            continue;
        }
        if to.exists(&rel).await? {
            report.already_there += 1;
            continue;
        }
        if !m.files.iter().all(|f| fits(f.size)) {
            report.too_large.push(m.lineage.stage_id.clone());
            continue;
        }
        let digests: Vec<_> = m.files.iter().map(|f| f.digest).collect();
        if !copy_blobs(from, to, &digests, &mut report).await? {
            report.incomplete.push(m.lineage.stage_id.clone());
            continue;
        }
        // The stage's log, which its lineage names (not part of the artifact: a source without
        // it, as a store copied before logs travelled, still gives the artifact).
        if let Some(log) = &m.lineage.log
            && fits(log.size)
        {
            copy_blobs(from, to, &[log.digest], &mut report).await?;
        }
        // Last: the manifest's own bytes, so the destination's commit is the source's (a
        // copy or run that committed the key meanwhile keeps its own).
        if to.put_create(&rel, raw).await? == Put::Existed {
            report.already_there += 1;
            continue;
        }
        copied(&m.lineage.stage_id);
        report.copied.push(m.lineage.stage_id.clone());
    }
    // Finished shards of keys not committed in the source. Every one when no stage is named
    // (a run killed before its end record still left them); else those the run records say
    // are of the stages named.
    let stage_of: HashMap<Key, String> = if filter.stages.is_empty() {
        HashMap::new()
    } else {
        from.runs()
            .await?
            .into_iter()
            .flat_map(|r| r.stages)
            .filter_map(|s| Some((s.key?, s.id)))
            .collect()
    };
    for rel in from.list("shards").await? {
        let Some(key) = rel
            .split('/')
            .nth(1)
            .and_then(|k| k.parse::<dflash_stage_api::Digest>().ok())
            .map(Key)
        else {
            continue;
        };
        let asked = filter.stages.is_empty() || stage_of.get(&key).is_some_and(|s| wanted(s));
        if keys.contains(&key) || !asked || to.exists(&rel).await? {
            continue;
        }
        let Some(raw) = from.get(&rel).await? else {
            continue;
        };
        let Ok(shard) = serde_json::from_slice::<ShardRecord>(&raw) else {
            continue;
        };
        if !shard.files.iter().all(|f| fits(f.size)) {
            continue;
        }
        let digests: Vec<_> = shard.files.iter().map(|f| f.digest).collect();
        if copy_blobs(from, to, &digests, &mut report).await? {
            to.put_create(&rel, raw).await?;
            report.shards += 1;
        }
    }
    for rel in from.list("runs").await? {
        if to.exists(&rel).await? {
            continue;
        }
        if let Some(raw) = from.get(&rel).await?
            && to.put_create(&rel, raw).await? == Put::Created
        {
            report.run_records += 1;
        }
    }
    Ok(report)
}

/// Blobs copied at once: a remote store's requests are bound by latency, not bandwidth.
const IN_FLIGHT: usize = 16;

/// Copy the blobs the destination lacks, each checked against its digest on the way,
/// [`IN_FLIGHT`] at a time; false when the source lacks one (nothing that depends on them is
/// then written; the blobs copied stay, unreferenced and harmless, as a retried upload's would).
async fn copy_blobs(
    from: &Store,
    to: &Store,
    digests: &[dflash_stage_api::Digest],
    report: &mut CopyReport,
) -> Result<bool, StoreError> {
    use futures::{StreamExt, TryStreamExt};
    // Per blob: None when the source lacks it, else whether it was written and its bytes.
    let done: Vec<Option<(bool, u64)>> = futures::stream::iter(digests)
        .map(|d| async move {
            if to.has_blob(d).await? {
                return Ok(Some((false, 0)));
            }
            // Checked against `d` on the way (a parted blob part by part): written under it as
            // it is, not hashed again (another writer may have created it meanwhile).
            match from.copy_blob_to(d, to).await {
                Ok((put, n)) => Ok(Some((put == Put::Created, n))),
                Err(StoreError::Missing { .. }) => Ok(None),
                Err(e) => Err(e),
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .try_collect()
        .await?;
    for (written, n) in done.iter().flatten() {
        if *written {
            report.blobs += 1;
            report.bytes += n;
        }
    }
    Ok(done.iter().all(Option::is_some))
}
