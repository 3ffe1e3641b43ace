//! The artifact store: create-only writes over `object_store`.
//!
//! Layout under the store root:
//! - `blobs/<hh>/<digest>`: file contents, content-addressed, so a retried upload is harmless;
//!   a file larger than a part (1 GiB, [`Store::with_part_bytes`]) is its parts' blobs and
//!   `blobs/<hh>/<digest>.parts` listing them in order (one S3 PUT takes at most 5 GiB, and a
//!   retry re-sends one part, not the file);
//! - `shards/<key>/<name>.json`: a finished shard of a partial artifact ([`ShardRecord`]);
//! - `manifests/<key>.json`: the commit of an artifact ([`Manifest`]), written last;
//! - `runs/<run-id>/begin.json` and `runs/<run-id>/end.json`: run records;
//! - `copies/<id>.json`: a record of each `dflash copy` into this store ([`copy`]).
//!
//! Every write is `PutMode::Create`; nothing is ever replaced or deleted. At start the store
//! is probed: a second create of `begin.json` must be refused, or dflash will not run on it.

pub mod copy;
pub mod manifest;

use std::sync::Arc;

use bytes::{BufMut, Bytes};
use dflash_stage_api::Digest;
use futures::TryStreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

use crate::key::Key;
pub use manifest::{FileEntry, Manifest, RunRecord, ShardRecord, StageResult, Status};

/// An error talking to the store.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum StoreError {
    /// The store URL could not be understood or opened.
    #[error("cannot open store `{url}`: {reason}")]
    #[diagnostic(
        code(dflash::store::open),
        help(
            "use a local path (`./cache`) or a URL like `s3://bucket/prefix`; set credentials through the standard environment variables (AWS_ACCESS_KEY_ID, ...)"
        )
    )]
    Open {
        /// The URL, with any credentials removed.
        url: String,
        /// Why.
        reason: String,
    },
    /// The store silently replaced an object on a create-only write.
    #[error(
        "store `{url}` overwrote an existing object on a create-only write; dflash will not run on it"
    )]
    #[diagnostic(
        code(dflash::store::overwrites),
        help(
            "use a store that honours conditional puts (If-None-Match), or pass `--allow-overwriting-store` if you accept that a race may replace artifacts"
        )
    )]
    Overwrites {
        /// The URL.
        url: String,
    },
    /// A request failed.
    #[error("store `{url}`: {op} `{path}` failed: {reason}")]
    #[diagnostic(code(dflash::store::io))]
    Io {
        /// The URL.
        url: String,
        /// What was being done.
        op: &'static str,
        /// The object.
        path: String,
        /// Why.
        reason: String,
        /// What to do about it, when the cause is recognisable.
        #[help]
        hint: Option<String>,
    },
    /// A local file being stored, or a blob being written out, failed on this machine.
    #[error("{op} `{path}` failed: {reason}")]
    #[diagnostic(code(dflash::store::local_file))]
    Local {
        /// What was being done.
        op: &'static str,
        /// The local file (or the blob, when written to a stream).
        path: String,
        /// Why.
        reason: String,
    },
    /// An object's bytes do not match its digest.
    #[error(
        "store `{url}`: object `{path}` is corrupt: its bytes hash to {actual}, not {expected}"
    )]
    #[diagnostic(
        code(dflash::store::corrupt),
        help("run `dflash verify` to find every corrupt object")
    )]
    Corrupt {
        /// The URL.
        url: String,
        /// The object.
        path: String,
        /// The digest it should have.
        expected: String,
        /// The digest it has.
        actual: String,
    },
    /// A manifest names a blob the store does not hold (a partial copy of a store, say).
    #[error("store `{url}`: object `{path}` is missing")]
    #[diagnostic(
        code(dflash::store::missing),
        help(
            "the artifact's manifest names a blob the store does not hold; run `dflash verify` to list every such file"
        )
    )]
    Missing {
        /// The URL.
        url: String,
        /// The object.
        path: String,
    },
    /// A stored record could not be decoded.
    #[error("store `{url}`: `{path}` is not a valid record: {reason}")]
    #[diagnostic(code(dflash::store::decode))]
    Decode {
        /// The URL.
        url: String,
        /// The object.
        path: String,
        /// Why.
        reason: String,
    },
}

/// Whether a create-only write created the object or found it there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Put {
    /// This call created it.
    Created,
    /// It existed already (left untouched).
    Existed,
}

/// A create-only artifact store.
#[derive(Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    root: ObjPath,
    url: String,
    /// The largest blob stored as one object (1 GiB, or `DFLASH_BLOB_PART_BYTES`).
    part_bytes: usize,
}

impl Store {
    /// Open a store from a local path or a URL (`s3://`, `gs://`, `az://`, `file://`,
    /// `memory://`). Credentials come from the standard environment variables.
    pub fn open(location: &str) -> Result<Self, StoreError> {
        Self::open_with(location, &[])
    }

    /// [`Store::open`] with S3 settings given explicitly (`aws_endpoint`, `aws_allow_http`, ...)
    /// on top of the environment's.
    pub fn open_with(location: &str, s3_options: &[(&str, &str)]) -> Result<Self, StoreError> {
        let shown = redact(location);
        let err = |reason: String| StoreError::Open {
            url: shown.clone(),
            reason,
        };
        if location.starts_with("memory://") {
            return Ok(Self {
                inner: Arc::new(object_store::memory::InMemory::new()),
                root: ObjPath::default(),
                url: shown,
                part_bytes: part_bytes(),
            });
        }
        if let Some(rest) = location.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(err("no bucket in the URL".into()));
            }
            let mut builder = object_store::aws::AmazonS3Builder::from_env();
            for (k, v) in s3_options {
                let key = k
                    .parse()
                    .map_err(|e: object_store::Error| err(e.to_string()))?;
                builder = builder.with_config(key, *v);
            }
            let s3 = builder
                .with_bucket_name(bucket)
                .with_retry(retry_config())
                .build()
                .map_err(|e| err(e.to_string()))?;
            return Ok(Self {
                inner: Arc::new(s3),
                root: ObjPath::from(prefix),
                url: shown,
                part_bytes: part_bytes(),
            });
        }
        if location.contains("://") && !location.starts_with("file://") {
            let url = url::Url::parse(location).map_err(|e| err(e.to_string()))?;
            let env: Vec<(String, String)> = std::env::vars().collect();
            let opts = env.iter().map(|(k, v)| (k.to_ascii_lowercase(), v.clone()));
            let (store, root) =
                object_store::parse_url_opts(&url, opts).map_err(|e| err(e.to_string()))?;
            return Ok(Self {
                inner: Arc::from(store),
                root,
                url: shown,
                part_bytes: part_bytes(),
            });
        }
        let dir = location.strip_prefix("file://").unwrap_or(location);
        std::fs::create_dir_all(dir)
            .map_err(|e| err(format!("cannot create folder `{dir}`: {e}")))?;
        let fs = object_store::local::LocalFileSystem::new_with_prefix(dir)
            .map_err(|e| err(e.to_string()))?;
        Ok(Self {
            inner: Arc::new(fs),
            root: ObjPath::default(),
            url: shown,
            part_bytes: part_bytes(),
        })
    }

    /// This store with blobs over `bytes` stored in parts of that size (at least 1).
    #[must_use]
    pub fn with_part_bytes(mut self, bytes: usize) -> Self {
        self.part_bytes = bytes.max(1);
        self
    }

    /// The store's URL for messages (credentials removed).
    pub fn url(&self) -> &str {
        &self.url
    }

    fn path(&self, rel: &str) -> ObjPath {
        let mut p = self.root.clone();
        for part in rel.split('/') {
            p = p.clone().join(part);
        }
        p
    }

    fn io(&self, op: &'static str, path: &str, e: &object_store::Error) -> StoreError {
        let reason = e.to_string();
        let hint = hint_for(&reason);
        StoreError::Io {
            url: self.url.clone(),
            op,
            path: path.to_owned(),
            reason,
            hint,
        }
    }

    /// Create `rel` with `bytes` unless it exists; never replaces.
    ///
    /// object_store does not retry a conditional PUT whose connection broke (it is not
    /// idempotent in general), so this retries transient faults itself, bounded, with backoff
    /// and jitter. A retry that finds the object already there reads it back: the same bytes
    /// mean an earlier attempt of ours landed (`Created`); other bytes mean someone else's
    /// (`Existed`). Either way nothing is replaced.
    pub async fn put_create(&self, rel: &str, bytes: Bytes) -> Result<Put, StoreError> {
        let path = self.path(rel);
        let mut delay = std::time::Duration::from_millis(100);
        for attempt in 0..=CREATE_RETRIES {
            let opts = PutOptions {
                mode: PutMode::Create,
                ..Default::default()
            };
            let err = match self
                .inner
                .put_opts(&path, PutPayload::from_bytes(bytes.clone()), opts)
                .await
            {
                Ok(_) => return Ok(Put::Created),
                Err(object_store::Error::AlreadyExists { .. }) if attempt == 0 => {
                    return Ok(Put::Existed);
                }
                Err(object_store::Error::AlreadyExists { .. }) => {
                    let stored = self.get(rel).await?;
                    return Ok(if stored.as_ref() == Some(&bytes) {
                        Put::Created
                    } else {
                        Put::Existed
                    });
                }
                Err(e) => e,
            };
            if !is_transient(&err) || attempt == CREATE_RETRIES {
                return Err(self.io("create", rel, &err));
            }
            let jitter = std::time::Duration::from_millis(
                u64::from(std::process::id() % 7) * 13 + u64::from(attempt) * 7,
            );
            tokio::time::sleep(delay + jitter).await;
            delay = (delay * 2).min(std::time::Duration::from_secs(5));
        }
        unreachable!("the loop returns on its last attempt")
    }

    /// Whether `rel` exists (a HEAD request: nothing is read).
    pub async fn exists(&self, rel: &str) -> Result<bool, StoreError> {
        match self.inner.head(&self.path(rel)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.io("check", rel, &e)),
        }
    }

    /// Read `rel`, or `None` when it does not exist.
    pub async fn get(&self, rel: &str) -> Result<Option<Bytes>, StoreError> {
        match self.inner.get(&self.path(rel)).await {
            Ok(r) => r
                .bytes()
                .await
                .map(Some)
                .map_err(|e| self.io("read", rel, &e)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.io("read", rel, &e)),
        }
    }

    /// Paths (relative to the root) under `prefix`.
    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        let base = self.path(prefix);
        let root_parts = self.root.parts().count();
        let metas: Vec<_> = self
            .inner
            .list(Some(&base))
            .try_collect()
            .await
            .map_err(|e| self.io("list", prefix, &e))?;
        Ok(metas
            .into_iter()
            .map(|m| {
                m.location
                    .parts()
                    .skip(root_parts)
                    .map(|p| p.as_ref().to_owned())
                    .collect::<Vec<_>>()
                    .join("/")
            })
            .collect())
    }

    /// Store bytes as a content-addressed blob.
    pub async fn put_blob(&self, bytes: Bytes) -> Result<FileEntry, StoreError> {
        let digest = Digest::of(&bytes);
        let size = bytes.len() as u64;
        self.put_blob_as(&digest, bytes).await?;
        Ok(FileEntry {
            path: String::new(),
            digest,
            size,
        })
    }

    /// Store `bytes`, whose digest the caller has checked to be `digest`, as that blob: in one
    /// object up to the store's part size, else as parts and their list, each create-only.
    /// `Existed` when the blob was there already (whole, or its parts' list).
    pub async fn put_blob_as(&self, digest: &Digest, bytes: Bytes) -> Result<Put, StoreError> {
        let part = self.part_bytes;
        if bytes.len() <= part {
            return self.put_create(&blob_path(digest), bytes).await;
        }
        if self.has_blob(digest).await? {
            return Ok(Put::Existed);
        }
        let mut parts = Vec::new();
        for start in (0..bytes.len()).step_by(part) {
            parts.push(
                self.put_part(bytes.slice(start..(start + part).min(bytes.len())))
                    .await?,
            );
        }
        // Written last: a blob is there once its list is, every part before it.
        let list = BlobParts {
            size: bytes.len() as u64,
            parts,
        };
        self.put_json(&parts_path(digest), &list).await
    }

    /// Store the file at `path` as a blob, reading it a part at a time, so a file of any size
    /// holds at most one part in memory: whole up to the part size, else its parts as they are
    /// read and their list once the whole digest is known.
    pub async fn put_file(&self, path: &std::path::Path) -> Result<FileEntry, StoreError> {
        use tokio::io::AsyncReadExt;
        let io = |e: std::io::Error| StoreError::Local {
            op: "reading",
            path: path.display().to_string(),
            reason: e.to_string(),
        };
        let mut file = tokio::fs::File::open(path).await.map_err(io)?;
        let size = file.metadata().await.map_err(io)?.len();
        if size <= self.part_bytes as u64 {
            let mut bytes = Vec::with_capacity(size as usize);
            file.read_to_end(&mut bytes).await.map_err(io)?;
            return self.put_blob(Bytes::from(bytes)).await;
        }
        let mut whole = blake3::Hasher::new();
        let mut parts = Vec::new();
        loop {
            let mut piece = Vec::with_capacity(self.part_bytes);
            (&mut file)
                .take(self.part_bytes as u64)
                .read_to_end(&mut piece)
                .await
                .map_err(io)?;
            if piece.is_empty() {
                break;
            }
            whole.update(&piece);
            parts.push(self.put_part(Bytes::from(piece)).await?);
        }
        let digest = Digest::from(whole.finalize());
        let size = parts.iter().map(|p| p.size).sum();
        if !self.exists(&blob_path(&digest)).await? {
            self.put_json(&parts_path(&digest), &BlobParts { size, parts })
                .await?;
        }
        Ok(FileEntry {
            path: String::new(),
            digest,
            size,
        })
    }

    /// One part of a parted blob, stored create-only under its own digest.
    async fn put_part(&self, piece: Bytes) -> Result<BlobPart, StoreError> {
        let part = BlobPart {
            digest: Digest::of(&piece),
            size: piece.len() as u64,
        };
        self.put_create(&blob_path(&part.digest), piece).await?;
        Ok(part)
    }

    /// How a blob is stored: its one object, read and checked, or its parts' list.
    async fn stored(&self, digest: &Digest) -> Result<Stored, StoreError> {
        let missing = match self.get_whole_blob(digest).await {
            Ok(bytes) => return Ok(Stored::Whole(bytes)),
            Err(e @ StoreError::Missing { .. }) => e,
            Err(e) => return Err(e),
        };
        let rel = parts_path(digest);
        match self.get_json::<BlobParts>(&rel).await? {
            Some(list) => Ok(Stored::Parted(rel, list)),
            None => Err(missing),
        }
    }

    /// Read a blob (whole, or its parts in order) and check its bytes against its digest.
    pub async fn get_blob(&self, digest: &Digest) -> Result<Bytes, StoreError> {
        match self.stored(digest).await? {
            Stored::Whole(bytes) => Ok(bytes),
            Stored::Parted(rel, list) => {
                let mut whole = bytes::BytesMut::with_capacity(list.size as usize).writer();
                self.read_parts(digest, &rel, &list, &mut whole).await?;
                Ok(whole.into_inner().freeze())
            }
        }
    }

    /// Write a blob into `out` a part at a time, each part checked against its digest as it
    /// is read and the whole against the blob's at the end (an error then: `out` holds bytes
    /// that are not the blob's, and the caller removes them); its size.
    pub async fn get_blob_into(
        &self,
        digest: &Digest,
        out: &mut (impl std::io::Write + Send),
    ) -> Result<u64, StoreError> {
        match self.stored(digest).await? {
            Stored::Whole(bytes) => {
                out.write_all(&bytes).map_err(|e| written(digest, &e))?;
                Ok(bytes.len() as u64)
            }
            Stored::Parted(rel, list) => {
                self.read_parts(digest, &rel, &list, out).await?;
                Ok(list.size)
            }
        }
    }

    /// A parted blob's parts, in order, into `out`: each checked as it is read, the whole at
    /// the end (`rel`, its list, named if the whole is not `digest`).
    async fn read_parts(
        &self,
        digest: &Digest,
        rel: &str,
        list: &BlobParts,
        out: &mut (impl std::io::Write + Send),
    ) -> Result<(), StoreError> {
        let mut whole = blake3::Hasher::new();
        for p in &list.parts {
            let piece = self.get_whole_blob(&p.digest).await?;
            whole.update(&piece);
            out.write_all(&piece).map_err(|e| written(digest, &e))?;
        }
        self.check(digest, rel, Digest::from(whole.finalize()))
    }

    /// Copy a blob of this store into `to` as it is stored here: a whole one whole (parted
    /// there if it is over `to`'s part size), a parted one part by part and then its list, so
    /// at most one part (or one whole blob) is in memory. Each part is checked on the way.
    /// `Created` when the blob was written, with its size.
    pub async fn copy_blob_to(
        &self,
        digest: &Digest,
        to: &Store,
    ) -> Result<(Put, u64), StoreError> {
        match self.stored(digest).await? {
            Stored::Whole(bytes) => {
                let n = bytes.len() as u64;
                Ok((to.put_blob_as(digest, bytes).await?, n))
            }
            Stored::Parted(rel, list) => {
                for p in &list.parts {
                    if !to.exists(&blob_path(&p.digest)).await? {
                        let piece = self.get_whole_blob(&p.digest).await?;
                        to.put_create(&blob_path(&p.digest), piece).await?;
                    }
                }
                Ok((to.put_json(&rel, &list).await?, list.size))
            }
        }
    }

    /// The log of the stage that made `m` (its lineage names it; stored as a blob, not part of
    /// the artifact): `None` where the lineage names none or the store lacks it (an artifact
    /// made before logs were kept, or copied by an earlier `dflash copy`).
    pub async fn stage_log(&self, m: &Manifest) -> Result<Option<Bytes>, StoreError> {
        let Some(log) = &m.lineage.log else {
            return Ok(None);
        };
        match self.get_blob(&log.digest).await {
            Ok(bytes) => Ok(Some(bytes)),
            Err(StoreError::Missing { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Whether the blob is stored, whole or in parts (two HEAD requests at once: nothing is
    /// read, and a blob that is not there costs one round trip, as before parts).
    pub async fn has_blob(&self, digest: &Digest) -> Result<bool, StoreError> {
        let (whole, parted) = (blob_path(digest), parts_path(digest));
        let (whole, parted) = tokio::try_join!(self.exists(&whole), self.exists(&parted))?;
        Ok(whole || parted)
    }

    /// A blob stored as one object, checked against its digest.
    async fn get_whole_blob(&self, digest: &Digest) -> Result<Bytes, StoreError> {
        let rel = blob_path(digest);
        let bytes = self.get(&rel).await?.ok_or_else(|| StoreError::Missing {
            url: self.url.clone(),
            path: rel.clone(),
        })?;
        self.check(digest, &rel, Digest::of(&bytes))?;
        Ok(bytes)
    }

    /// An error naming `rel` unless what was read from it hashes to `digest`.
    fn check(&self, digest: &Digest, rel: &str, actual: Digest) -> Result<(), StoreError> {
        if actual != *digest {
            return Err(StoreError::Corrupt {
                url: self.url.clone(),
                path: rel.to_owned(),
                expected: digest.to_hex(),
                actual: actual.to_hex(),
            });
        }
        Ok(())
    }

    async fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        rel: &str,
    ) -> Result<Option<T>, StoreError> {
        let Some(bytes) = self.get(rel).await? else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| StoreError::Decode {
                url: self.url.clone(),
                path: rel.to_owned(),
                reason: e.to_string(),
            })
    }

    async fn put_json<T: serde::Serialize>(&self, rel: &str, value: &T) -> Result<Put, StoreError> {
        let bytes = serde_json::to_vec_pretty(value).expect("records serialize");
        self.put_create(rel, Bytes::from(bytes)).await
    }

    /// The manifest committed under `key`, if any.
    pub async fn manifest(&self, key: &Key) -> Result<Option<Manifest>, StoreError> {
        self.get_json(&format!("manifests/{key}.json")).await
    }

    /// Commit an artifact. If another run committed the key first, its manifest wins and is
    /// returned; ours is dropped.
    pub async fn commit(&self, manifest: &Manifest) -> Result<Manifest, StoreError> {
        let rel = format!("manifests/{}.json", manifest.key);
        match self.put_json(&rel, manifest).await? {
            Put::Created => Ok(manifest.clone()),
            Put::Existed => Ok(self
                .get_json(&rel)
                .await?
                .unwrap_or_else(|| manifest.clone())),
        }
    }

    /// Every committed key.
    pub async fn keys(&self) -> Result<Vec<Key>, StoreError> {
        Ok(self
            .list("manifests")
            .await?
            .iter()
            .filter_map(|p| {
                p.strip_prefix("manifests/")?
                    .strip_suffix(".json")?
                    .parse()
                    .ok()
                    .map(Key)
            })
            .collect())
    }

    /// Shards committed under `key`.
    pub async fn shards(&self, key: &Key) -> Result<Vec<ShardRecord>, StoreError> {
        let mut out = Vec::new();
        for p in self.list(&format!("shards/{key}")).await? {
            if let Some(rec) = self.get_json::<ShardRecord>(&p).await? {
                out.push(rec);
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Record a finished shard; an existing record of that name is an error.
    pub async fn put_shard(&self, key: &Key, shard: &ShardRecord) -> Result<Put, StoreError> {
        self.put_json(&format!("shards/{key}/{}.json", shard.name), shard)
            .await
    }

    /// Write the run's begin record and prove the store refuses a second create of it.
    pub async fn begin_run(
        &self,
        run_id: &str,
        record: &serde_json::Value,
        allow_overwrite: bool,
    ) -> Result<(), StoreError> {
        self.create_probed(
            &format!("runs/{run_id}/begin.json"),
            record,
            allow_overwrite,
        )
        .await
    }

    /// Create the record `rel` (an error if it exists), then prove the store refuses a second
    /// create of it: a store that lets the probe replace the record would let a run or a copy
    /// replace artifacts, so it is refused unless `allow_overwrite`.
    pub async fn create_probed(
        &self,
        rel: &str,
        record: &serde_json::Value,
        allow_overwrite: bool,
    ) -> Result<(), StoreError> {
        if self.put_json(rel, record).await? == Put::Existed {
            return Err(StoreError::Io {
                url: self.url.clone(),
                op: "create",
                path: rel.to_owned(),
                reason: "the record exists already (its id is taken)".into(),
                hint: None,
            });
        }
        let probe = Bytes::from_static(b"{\"probe\": \"this must never replace the record\"}\n");
        if self.put_create(rel, probe).await? == Put::Created && !allow_overwrite {
            return Err(StoreError::Overwrites {
                url: self.url.clone(),
            });
        }
        Ok(())
    }

    /// Write the run's end record.
    pub async fn end_run(&self, record: &RunRecord) -> Result<(), StoreError> {
        self.put_json(&format!("runs/{}/end.json", record.run_id), record)
            .await
            .map(|_| ())
    }

    /// Every finished run, oldest first.
    pub async fn runs(&self) -> Result<Vec<RunRecord>, StoreError> {
        let mut paths: Vec<String> = self
            .list("runs")
            .await?
            .into_iter()
            .filter(|p| p.ends_with("/end.json"))
            .collect();
        paths.sort();
        let mut out = Vec::new();
        for p in paths {
            if let Some(r) = self.get_json(&p).await? {
                out.push(r);
            }
        }
        Ok(out)
    }
}

/// A hint for store errors whose cause can be read off the message.
fn hint_for(reason: &str) -> Option<String> {
    let hint = if reason.contains("169.254.169.254") {
        "no AWS credentials were found in the environment (dflash fell back to the instance metadata service): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
    } else if reason.contains("NoSuchBucket") || reason.contains("bucket does not exist") {
        "the bucket does not exist: create it, or fix its name in the store URL"
    } else if reason.contains("403")
        || reason.contains("AccessDenied")
        || reason.contains("SignatureDoesNotMatch")
        || reason.contains("InvalidAccessKeyId")
    {
        "the store refused the credentials: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's permissions"
    } else if reason.contains("error sending request")
        || reason.contains("Connection refused")
        || reason.contains("dns error")
    {
        "the store could not be reached: check the endpoint (AWS_ENDPOINT) and the network"
    } else {
        return None;
    };
    Some(hint.to_owned())
}

/// Attempts after the first for a create-only write that failed transiently.
const CREATE_RETRIES: u32 = 5;

/// Faults worth retrying: anything but a definite answer from the store.
fn is_transient(e: &object_store::Error) -> bool {
    !matches!(
        e,
        object_store::Error::NotFound { .. }
            | object_store::Error::AlreadyExists { .. }
            | object_store::Error::Precondition { .. }
            | object_store::Error::NotImplemented { .. }
            | object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. }
            | object_store::Error::NotSupported { .. }
            | object_store::Error::InvalidPath { .. }
            | object_store::Error::UnknownConfigurationKey { .. }
    )
}

/// Where a blob lives.
pub fn blob_path(digest: &Digest) -> String {
    let hex = digest.to_hex();
    format!("blobs/{}/{hex}", &hex[..2])
}

/// Where the list of a parted blob's parts lives.
fn parts_path(digest: &Digest) -> String {
    format!("{}.parts", blob_path(digest))
}

/// The largest blob stored as one object: 1 GiB (one S3 PUT takes at most 5 GiB; a part is
/// what a broken upload re-sends). `DFLASH_BLOB_PART_BYTES` sets another (tests use small
/// parts to run the parted path on small files).
fn part_bytes() -> usize {
    std::env::var("DFLASH_BLOB_PART_BYTES")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1 << 30)
}

/// A blob as the store holds it ([`Store::stored`]).
enum Stored {
    /// One object, its bytes read and checked.
    Whole(Bytes),
    /// Parts: the list's path and the list.
    Parted(String, BlobParts),
}

/// A failed write of a blob's bytes to a local stream.
fn written(digest: &Digest, e: &std::io::Error) -> StoreError {
    StoreError::Local {
        op: "writing blob",
        path: digest.short(12),
        reason: e.to_string(),
    }
}

/// The parts of a blob stored in pieces, in order (`blobs/<hh>/<digest>.parts`).
#[derive(serde::Serialize, serde::Deserialize)]
struct BlobParts {
    size: u64,
    parts: Vec<BlobPart>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct BlobPart {
    digest: Digest,
    size: u64,
}

/// Bounded retries with backoff for transient store faults (timeouts, 5xx, resets).
fn retry_config() -> object_store::RetryConfig {
    object_store::RetryConfig {
        max_retries: 5,
        retry_timeout: std::time::Duration::from_secs(120),
        backoff: object_store::BackoffConfig::default(),
    }
}

/// Remove credentials and query strings from a store location before it is shown anywhere.
pub fn redact(location: &str) -> String {
    match url::Url::parse(location) {
        Ok(mut u) if location.contains("://") => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.set_query(None);
            u.to_string()
        }
        _ => location.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_name_the_cause() {
        assert!(
            hint_for("NoSuchBucket: The specified bucket does not exist")
                .unwrap()
                .contains("bucket does not exist")
        );
        assert!(
            hint_for("PUT http://169.254.169.254/latest/api/token: 403")
                .unwrap()
                .contains("no AWS credentials")
        );
        assert!(
            hint_for("InvalidAccessKeyId")
                .unwrap()
                .contains("refused the credentials")
        );
        assert!(hint_for("something else").is_none());
    }

    #[test]
    fn redacts_credentials() {
        assert_eq!(redact("s3://AKIA:secret@bucket/p?token=x"), "s3://bucket/p");
        assert_eq!(redact("./cache"), "./cache");
    }
}
