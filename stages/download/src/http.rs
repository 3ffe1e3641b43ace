//! HTTP for `download`: a blocking client with bounded retries, HEAD for pinning, and downloads
//! that resume from where a crashed attempt stopped (HTTP `Range`), verified by size.

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use dflash_stage_api::{Cancel, StageError};

/// What a failed request says.
#[derive(Debug)]
pub struct HttpError {
    /// The HTTP status, when there was an answer.
    pub status: Option<u16>,
    /// One line for the user (no secrets: URLs here never carry credentials).
    pub message: String,
}

/// The identity of a remote object, for pinning.
#[derive(Debug, Clone, Default)]
pub struct Head {
    /// `ETag`, when the server sends one.
    pub etag: Option<String>,
    /// `Content-Length`, when known.
    pub size: Option<u64>,
    /// `Last-Modified`, when the server sends it.
    pub last_modified: Option<String>,
}

/// A blocking HTTP client that adds the Hub token to requests for the Hub's own host.
pub struct Client {
    inner: reqwest::blocking::Client,
    token: Option<String>,
    token_host: Option<String>,
}

const ATTEMPTS: u32 = 5;

impl Client {
    /// A client; `HF_TOKEN` (if set) goes only to the host of `hub_endpoint`.
    pub fn new(hub_endpoint: &str) -> Result<Self, StageError> {
        let inner = reqwest::blocking::Client::builder()
            .connect_timeout(Duration::from_secs(20))
            .timeout(None)
            .user_agent(concat!("dflash/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| StageError::new(format!("cannot start an HTTP client: {e}")))?;
        let token = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty());
        let token_host = url::Url::parse(hub_endpoint)
            .ok()
            .and_then(|u| u.host_str().map(str::to_owned));
        Ok(Self {
            inner,
            token,
            token_host,
        })
    }

    fn request(&self, method: reqwest::Method, url: &str) -> reqwest::blocking::RequestBuilder {
        let mut req = self.inner.request(method, url);
        let host = url::Url::parse(url)
            .ok()
            .and_then(|u| u.host_str().map(str::to_owned));
        if let (Some(token), Some(h)) = (&self.token, &self.token_host)
            && host.as_deref() == Some(h.as_str())
        {
            req = req.bearer_auth(token);
        }
        req
    }

    /// Send with bounded retries on connection errors and 429/5xx, backing off exponentially.
    fn send(
        &self,
        build: impl Fn() -> reqwest::blocking::RequestBuilder,
        url: &str,
    ) -> Result<reqwest::blocking::Response, HttpError> {
        let mut delay = Duration::from_millis(200);
        let mut last = None;
        for attempt in 0..ATTEMPTS {
            if attempt > 0 {
                std::thread::sleep(delay);
                delay *= 2;
            }
            match build().send() {
                Ok(r) if r.status().is_success() => return Ok(r),
                Ok(r) => {
                    let status = r.status().as_u16();
                    let err = HttpError {
                        status: Some(status),
                        message: format!("`{}` answered HTTP {status}", shown(url)),
                    };
                    if status != 429 && status < 500 {
                        return Err(err);
                    }
                    last = Some(err);
                }
                Err(e) => {
                    last = Some(HttpError {
                        status: None,
                        message: format!("request to `{}` failed: {}", shown(url), root_cause(&e)),
                    });
                }
            }
        }
        let mut e = last.expect("at least one attempt");
        e.message.push_str(&format!(" (after {ATTEMPTS} attempts)"));
        Err(e)
    }

    /// GET a small text body.
    pub fn get_text(&self, url: &str) -> Result<String, HttpError> {
        let r = self.send(|| self.request(reqwest::Method::GET, url), url)?;
        r.text().map_err(|e| HttpError {
            status: None,
            message: format!("reading `{}` failed: {}", shown(url), root_cause(&e)),
        })
    }

    /// HEAD: the object's identity.
    pub fn head(&self, url: &str) -> Result<Head, HttpError> {
        let r = self.send(|| self.request(reqwest::Method::HEAD, url), url)?;
        let h = r.headers();
        let text = |name: &str| h.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        Ok(Head {
            etag: text("etag"),
            size: text("content-length").and_then(|s| s.parse().ok()),
            last_modified: text("last-modified"),
        })
    }

    /// Download `url` to `dest`, resuming from `dest.part` if an earlier attempt (this run's or
    /// a crashed one's) left one. A connection that breaks mid-body is picked up again with a
    /// `Range` request, a bounded number of times. `expected` (the size from HEAD) is checked at
    /// the end. Returns the bytes fetched now.
    pub fn download(
        &self,
        url: &str,
        dest: &Path,
        expected: Option<u64>,
        cancel: &Cancel,
        on_bytes: &dyn Fn(u64),
    ) -> Result<u64, StageError> {
        if dest.exists() {
            return Ok(0);
        }
        let part = dest.with_extension("part");
        let mut got = 0u64;
        let mut broke = 0;
        while let Some(e) = self.download_once(url, &part, cancel, &mut got, on_bytes)? {
            broke += 1;
            if broke > ATTEMPTS {
                return Err(StageError::new(format!(
                    "download of `{}` broke off {broke} times: {e}",
                    shown(url)
                ))
                .with_help("run again: the download resumes where it stopped"));
            }
        }
        let size = std::fs::metadata(&part)?.len();
        if let Some(want) = expected
            && size != want
        {
            return Err(StageError::new(format!(
                "`{}` is {size} bytes but the server announced {want}",
                shown(url)
            ))
            .with_help("run again; if it persists the server's file changed mid-download"));
        }
        std::fs::rename(&part, dest)?;
        Ok(got)
    }

    /// One request for the rest of `part`. `Ok(Some(e))`: the body broke off (resumable).
    fn download_once(
        &self,
        url: &str,
        part: &Path,
        cancel: &Cancel,
        got: &mut u64,
        on_bytes: &dyn Fn(u64),
    ) -> Result<Option<std::io::Error>, StageError> {
        let have = std::fs::metadata(part).map_or(0, |m| m.len());
        let mut resp = self
            .send(
                || {
                    let r = self.request(reqwest::Method::GET, url);
                    if have > 0 {
                        r.header(reqwest::header::RANGE, format!("bytes={have}-"))
                    } else {
                        r
                    }
                },
                url,
            )
            .map_err(|e| StageError::new(e.message))?;
        // 206: the server resumes; 200: it ignores Range, so start over.
        let resumed = have > 0 && resp.status().as_u16() == 206;
        let mut file = OpenOptions::new()
            .create(true)
            .write(true)
            .append(resumed)
            .truncate(!resumed)
            .open(part)?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            if cancel.is_cancelled() {
                file.flush()?;
                return Err(StageError::cancelled());
            }
            let n = match resp.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => {
                    file.sync_all()?;
                    return Ok(Some(e));
                }
            };
            file.write_all(&buf[..n])?;
            *got += n as u64;
            on_bytes(n as u64);
        }
        file.sync_all()?;
        Ok(None)
    }
}

pub use dflash_stage_api::remote::shown;

fn root_cause(e: &dyn std::error::Error) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}
