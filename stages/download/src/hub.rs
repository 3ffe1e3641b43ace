//! The subset of the Hugging Face Hub API that `download` uses: resolve a dataset revision to its
//! commit sha (with the repo's file list) and build the URL of one file at that sha.
//!
//! `HF_ENDPOINT` points it at a mirror; `HF_TOKEN` is sent as a bearer token for gated sets and
//! never appears in a key, a manifest, a log or an error.

use dflash_stage_api::StageError;
use serde::Deserialize;

use crate::http::Client;

/// A resolved dataset revision.
#[derive(Debug, Clone)]
pub struct Revision {
    /// The commit sha the revision pointed at.
    pub sha: String,
    /// Every file in the repository at that sha.
    pub files: Vec<String>,
}

#[derive(Deserialize)]
struct RevisionReply {
    sha: String,
    #[serde(default)]
    siblings: Vec<Sibling>,
}

#[derive(Deserialize)]
struct Sibling {
    rfilename: String,
}

/// The Hub's base URL: `HF_ENDPOINT` or huggingface.co.
pub fn endpoint() -> String {
    std::env::var("HF_ENDPOINT")
        .ok()
        .filter(|e| !e.is_empty())
        .unwrap_or_else(|| "https://huggingface.co".into())
        .trim_end_matches('/')
        .to_owned()
}

fn encode(segment: &str) -> String {
    url::form_urlencoded::byte_serialize(segment.as_bytes()).collect()
}

/// Resolve `revision` of dataset `repo` to a commit sha and its file list.
pub fn resolve(client: &Client, repo: &str, revision: &str) -> Result<Revision, StageError> {
    let base = endpoint();
    let url = format!("{base}/api/datasets/{repo}/revision/{}", encode(revision));
    let body = client.get_text(&url).map_err(|e| {
        let hint = match e.status {
            Some(401 | 403) => "the dataset is gated or private: accept its terms on the Hub and set `HF_TOKEN`".to_owned(),
            Some(404) => format!("check the repo id `{repo}` and the revision `{revision}` (a branch, tag or commit sha)"),
            _ => format!("is the Hub reachable at `{base}`? set `HF_ENDPOINT` to use a mirror"),
        };
        StageError::new(format!("cannot resolve dataset `{repo}` at `{revision}`: {}", e.message)).with_help(hint)
    })?;
    let reply: RevisionReply = serde_json::from_str(&body).map_err(|e| {
        StageError::new(format!(
            "the Hub's answer for `{repo}` at `{revision}` is not what its API returns: {e}"
        ))
    })?;
    if reply.sha.len() != 40 || !reply.sha.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(StageError::new(format!(
            "the Hub resolved `{repo}` at `{revision}` to `{}`, which is not a commit sha",
            reply.sha
        )));
    }
    Ok(Revision {
        sha: reply.sha,
        files: reply.siblings.into_iter().map(|s| s.rfilename).collect(),
    })
}

/// The download URL of `path` in dataset `repo` at commit `sha`.
pub fn file_url(repo: &str, sha: &str, path: &str) -> String {
    let path: Vec<String> = path.split('/').map(encode).collect();
    format!(
        "{}/datasets/{repo}/resolve/{sha}/{}",
        endpoint(),
        path.join("/")
    )
}
