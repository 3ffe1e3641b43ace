//! Reading objects from an object store (`s3://`, `gs://`, `az://`, configured from the
//! standard environment variables) for stages that take remote inputs: `download`'s `object:`
//! and `tokenize`'s remote model folders. Read-only: stages never write to a store themselves.

use std::path::Path;

use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};

use crate::StageError;

/// A URL as it may be shown: no user, password or query (which can hold signed tokens).
pub fn shown(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.set_query(None);
            u.to_string()
        }
        Err(_) => "<unparseable URL>".into(),
    }
}

/// Whether `s` names an object in a store rather than a local path.
pub fn is_object_url(s: &str) -> bool {
    ["s3://", "gs://", "az://", "abfs://", "azure://"]
        .iter()
        .any(|p| s.starts_with(p))
}

/// Run `f` to completion on a private single-threaded runtime (stages are blocking code).
pub fn block_on<F: std::future::Future>(f: F) -> Result<F::Output, StageError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| StageError::new(format!("cannot start a runtime: {e}")))?;
    Ok(rt.block_on(f))
}

/// The store and path an object URL names, with options from the environment.
pub fn open(url: &str) -> Result<(Box<dyn ObjectStore>, ObjectPath), StageError> {
    let parsed = url::Url::parse(url)
        .map_err(|e| StageError::new(format!("`{}` is not a URL: {e}", shown(url))))?;
    let opts = std::env::vars().map(|(k, v)| (k.to_ascii_lowercase(), v));
    object_store::parse_url_opts(&parsed, opts)
        .map_err(|e| StageError::new(format!("cannot open `{}`: {e}", shown(url))))
}

/// An object's identity for pinning: `etag=...;size=...`; `None` when it does not exist.
pub fn identity(url: &str) -> Result<Option<String>, StageError> {
    let (store, path) = open(url)?;
    match block_on(store.head(&path))? {
        Ok(meta) => Ok(Some(format!(
            "etag={};size={}",
            meta.e_tag.unwrap_or_default(),
            meta.size
        ))),
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(StageError::new(format!(
            "cannot read `{}`: {e}",
            shown(url)
        ))),
    }
}

/// Copy the object at `url` to `dest` (through a `.part` file, so a crash leaves no torn file).
pub fn fetch(url: &str, dest: &Path) -> Result<(), StageError> {
    let (store, path) = open(url)?;
    let bytes = block_on(async { store.get(&path).await?.bytes().await })?
        .map_err(|e| StageError::new(format!("cannot read `{}`: {e}", shown(url))))?;
    let part = dest.with_extension("part");
    std::fs::write(&part, &bytes)?;
    std::fs::rename(&part, dest)?;
    Ok(())
}
