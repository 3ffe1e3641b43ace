//! The OpenAI-compatible client: chat completions spread over several endpoints (SGLang, vLLM,
//! llama.cpp's server), each with its own in-flight limit.
//!
//! A request goes to the live endpoint with the most free capacity, and only when it has a free
//! slot: an endpoint never holds more than its `max_in_flight` (a server sized for 16 running
//! requests gets 16, also when the others are down); with every live endpoint full, the request
//! waits for a slot to free. Failures that a retry can
//! cure (connection errors, resets, timeouts, 5xx, 429, a body that is not the JSON promised) are
//! retried up to a bound, preferring another endpoint. The backoff (exponential with jitter, or
//! the server's `Retry-After`) spares the servers that failed the request, not the others:
//! during it, the retry takes the first free slot of a live endpoint that has not failed it, so
//! a healthy server never idles while retries wait; once every live endpoint has failed it, it
//! waits the backoff out. An endpoint is drained only on evidence that the server
//! is down — three connection failures or timeouts in a row, not errors it answers quickly (a
//! 503 or a malformed body come from a server that is up) — for a cool-down that doubles each
//! time, so a dead server stops taking requests while the others carry on; and when every
//! endpoint is drained, the one whose cool-down ends first still takes requests, so the last
//! server standing is never left idle while work waits. A 4xx other than 408/429 is
//! the request's own fault (a prompt longer than the context, say) and is not retried.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dflash_stage_api::StageError;
use serde_json::{Map, Value as Json, json};
use xxhash_rust::xxh3::xxh3_64;

/// Consecutive failures after which an endpoint is drained.
const DRAIN_AFTER: u32 = 3;

/// One server.
pub struct Endpoint {
    /// Base URL, ending in `/v1`.
    pub url: String,
    /// Requests it may hold at once.
    pub capacity: usize,
    /// Requests it holds now.
    pub in_flight: AtomicUsize,
    /// Requests sent.
    pub sent: AtomicU64,
    /// Failed attempts.
    pub errors: AtomicU64,
    consecutive: AtomicU32,
    drains: AtomicU32,
    /// Times it was drained.
    drained_count: AtomicU64,
    dead_until: Mutex<Option<Instant>>,
}

impl Endpoint {
    /// An endpoint at `url` holding at most `capacity` requests.
    pub fn new(url: &str, capacity: usize) -> Self {
        Self {
            url: url.trim_end_matches('/').to_owned(),
            capacity: capacity.max(1),
            in_flight: AtomicUsize::new(0),
            sent: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            consecutive: AtomicU32::new(0),
            drains: AtomicU32::new(0),
            drained_count: AtomicU64::new(0),
            dead_until: Mutex::new(None),
        }
    }

    fn drained_until(&self) -> Option<Instant> {
        let d = *self
            .dead_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        d.filter(|t| *t > Instant::now())
    }

    /// A failed attempt; `down` when it says the server is not there (no connection, no
    /// answer in time), which alone counts towards draining it.
    fn failed(&self, down: bool) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        if !down {
            // An answer, even an error, says the server is up: the run of failures ends.
            self.consecutive.store(0, Ordering::Relaxed);
            return;
        }
        if self.consecutive.fetch_add(1, Ordering::Relaxed) + 1 >= DRAIN_AFTER {
            self.drained_count.fetch_add(1, Ordering::Relaxed);
            self.consecutive.store(0, Ordering::Relaxed);
            let n = self.drains.fetch_add(1, Ordering::Relaxed).min(4);
            *self
                .dead_until
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) =
                Some(Instant::now() + Duration::from_secs(2 << n));
        }
    }

    fn succeeded(&self) {
        self.consecutive.store(0, Ordering::Relaxed);
        self.drains.store(0, Ordering::Relaxed);
    }

    /// Whether it is drained now.
    pub fn is_drained(&self) -> bool {
        self.drained_until().is_some()
    }

    /// How many times it was drained.
    pub fn drained_times(&self) -> u64 {
        self.drained_count.load(Ordering::Relaxed)
    }
}

/// One generated reply.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The visible text.
    pub content: String,
    /// The reasoning, when the server splits it off (`reasoning_content`, or vLLM's `reasoning`).
    pub reasoning: Option<String>,
    /// `stop`, `length`, ...
    pub finish_reason: String,
    /// Tokens generated, as the server counts them.
    pub completion_tokens: u64,
}

/// Why a request has no reply.
#[derive(Debug)]
pub enum Failure {
    /// The request itself is refused (4xx): retrying cannot help.
    Refused(String),
    /// Every attempt failed; the servers are the problem.
    Exhausted(String),
}

/// The client.
pub struct Client {
    http: reqwest::Client,
    /// The endpoints.
    pub endpoints: Vec<Endpoint>,
    model: String,
    /// Fields sent with every request (sampling, `chat_template_kwargs`, extra fields).
    body: Map<String, Json>,
    timeout: Duration,
    attempts: u32,
    /// Wakes one waiting request whenever a request gives its endpoint's slot back.
    freed: tokio::sync::Notify,
}

/// A URL as it may be shown (no credentials or query).
pub fn shown(url: &str) -> String {
    dflash_stage_api::remote::shown(url)
}

impl Client {
    /// A client for `model` on `endpoints`.
    pub fn new(
        endpoints: Vec<Endpoint>,
        model: &str,
        body: Map<String, Json>,
        timeout: Duration,
        attempts: u32,
    ) -> Result<Self, StageError> {
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(1024)
            .tcp_nodelay(true)
            .build()
            .map_err(|e| StageError::new(format!("cannot build the HTTP client: {e}")))?;
        Ok(Self {
            http,
            endpoints,
            model: model.to_owned(),
            body,
            timeout,
            attempts: attempts.max(1),
            freed: tokio::sync::Notify::new(),
        })
    }

    /// Total requests the endpoints hold at once.
    pub fn capacity(&self) -> usize {
        self.endpoints.iter().map(|e| e.capacity).sum()
    }

    /// Check that every endpoint that answers serves the model; returns what each reported.
    /// An endpoint that does not answer starts drained (the others carry the work and it is
    /// tried again after its cool-down); none answering is an error.
    pub async fn check_models(&self) -> Result<Vec<(String, Vec<String>)>, StageError> {
        let mut out = Vec::new();
        let mut unreachable = None;
        for e in &self.endpoints {
            let url = format!("{}/models", e.url);
            let models = async {
                let r = self
                    .http
                    .get(&url)
                    .timeout(Duration::from_secs(30))
                    .send()
                    .await
                    .map_err(|err| root(&err))?;
                if !r.status().is_success() {
                    return Err(format!("HTTP {}", r.status()));
                }
                let bytes = r.bytes().await.map_err(|err| root(&err))?;
                let v: Json = serde_json::from_slice(&bytes).map_err(|err| err.to_string())?;
                Ok(v["data"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|m| m["id"].as_str().map(str::to_owned))
                            .collect::<Vec<_>>()
                    })
                    .unwrap_or_default())
            }
            .await;
            let models = match models {
                Ok(m) => m,
                Err(why) => {
                    for _ in 0..DRAIN_AFTER {
                        e.failed(true);
                    }
                    unreachable.get_or_insert_with(|| {
                        StageError::new(format!("`{}` did not list its models: {why}", shown(&url)))
                            .with_help("is the server up? `endpoints:` take base URLs such as `http://127.0.0.1:30000/v1`")
                    });
                    out.push((shown(&e.url), Vec::new()));
                    continue;
                }
            };
            if !models.iter().any(|m| m == &self.model) {
                return Err(StageError::new(format!(
                    "`{}` serves {}, not `{}`",
                    shown(&e.url),
                    if models.is_empty() {
                        "no model".to_owned()
                    } else {
                        models
                            .iter()
                            .map(|m| format!("`{m}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    },
                    self.model
                ))
                .with_help("set `model:` to the name the server reports (GET /v1/models)"));
            }
            out.push((shown(&e.url), models));
        }
        match unreachable {
            Some(e) if out.iter().all(|(_, m)| m.is_empty()) => Err(e),
            _ => Ok(out),
        }
    }

    /// Take a slot of the live endpoint with the most free capacity (by share) that has one,
    /// preferring one other than `avoid`; `None` when every candidate is full.
    fn reserve(&self, avoid: Option<usize>) -> Option<usize> {
        let mut live: Vec<usize> = (0..self.endpoints.len())
            .filter(|&i| !self.endpoints[i].is_drained())
            .collect();
        if live.is_empty() {
            // Every one drained: the first to come back is the last server standing, and work
            // waits; it takes requests (each attempt still backs off) rather than sit idle.
            let first = (0..self.endpoints.len())
                .min_by_key(|&i| self.endpoints[i].drained_until())
                .expect("at least one endpoint");
            live.push(first);
        }
        let load = |i: usize| self.load(i);
        // Another endpoint than the one that just failed first; that one too if it alone has
        // room (a free slot is never left unused for a preference).
        live.sort_by(|&a, &b| {
            (Some(a) == avoid)
                .cmp(&(Some(b) == avoid))
                .then(load(a).total_cmp(&load(b)))
        });
        live.into_iter().find(|&i| self.take(i))
    }

    /// Take a slot of the endpoint, among those `allowed`, with the most free capacity (by
    /// share) that has one.
    fn reserve_among(&self, allowed: &dyn Fn(&usize) -> bool) -> Option<usize> {
        let mut candidates: Vec<usize> = (0..self.endpoints.len()).filter(allowed).collect();
        candidates.sort_by(|&a, &b| self.load(a).total_cmp(&self.load(b)));
        candidates.into_iter().find(|&i| self.take(i))
    }

    /// The share of an endpoint's slots in use.
    fn load(&self, i: usize) -> f64 {
        let e = &self.endpoints[i];
        e.in_flight.load(Ordering::Relaxed) as f64 / e.capacity as f64
    }

    /// Take one slot of endpoint `i` if it has a free one. Taken only below the limit,
    /// atomically: requests racing for the last slot cannot both get it.
    fn take(&self, i: usize) -> bool {
        let e = &self.endpoints[i];
        e.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < e.capacity).then_some(n + 1)
            })
            .is_ok()
    }

    /// Within `wait`, a slot on a live endpoint that has not failed this request since its last
    /// backoff (`failed`), taken as soon as one frees; `None` when there is no such endpoint or
    /// none freed in time (the caller then backs off from them all: `wait` has passed). A retry
    /// never waits out a backoff while a healthy server has room for it, and one every server
    /// refuses still backs off between rounds.
    async fn slot_elsewhere(&self, failed: &[usize], wait: Duration) -> Option<usize> {
        let deadline = Instant::now() + wait;
        let others = |i: &usize| !failed.contains(i) && !self.endpoints[*i].is_drained();
        if !(0..self.endpoints.len()).any(|i| others(&i)) {
            tokio::time::sleep(wait).await;
            return None;
        }
        loop {
            if let Some(i) = self.reserve_among(&others) {
                return Some(i);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            // Polled, not woken: a waiter that takes a wake-up for a slot it may not use would
            // leave that slot to the next poll of a request that may.
            tokio::time::sleep((deadline - now).min(Duration::from_millis(10))).await;
        }
    }

    /// Wait for a slot (see [`Self::reserve`]). Each freed slot wakes one waiter, which takes
    /// it; a waiter also looks again after a while, for a slot on an endpoint whose cool-down
    /// ended (no release announces that).
    async fn slot(&self, avoid: Option<usize>) -> usize {
        loop {
            // Registered before looking, so a slot freed in between still wakes this one.
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if let Some(i) = self.reserve(avoid) {
                return i;
            }
            let _ = tokio::time::timeout(Duration::from_millis(250), freed).await;
        }
    }

    /// One chat completion for `messages`; `key` seeds the jitter (and names the request in
    /// errors).
    pub async fn complete(
        &self,
        messages: &[Json],
        seed: Option<u64>,
        key: &str,
    ) -> Result<Reply, Failure> {
        let mut body = self.body.clone();
        body.insert("model".into(), Json::String(self.model.clone()));
        body.insert("messages".into(), Json::Array(messages.to_vec()));
        if let Some(s) = seed {
            body.insert("seed".into(), json!(s));
        }
        let body = Json::Object(body);
        let mut last = String::new();
        let mut avoid = None;
        let mut retry_after: Option<Duration> = None;
        // The endpoints that failed this request since its last backoff: the backoff spares
        // them, not the others.
        let mut failed_here: Vec<usize> = Vec::new();
        for attempt in 0..self.attempts {
            let mut slot = None;
            if attempt > 0 {
                // What the server asked for (`Retry-After`, at most 5 minutes), else exponential
                // backoff with jitter in [0.5, 1.5), capped at 30 s.
                let base = (0.25 * f64::from(1u32 << attempt.min(7))).min(30.0);
                let jitter =
                    0.5 + (xxh3_64(format!("{key}/{attempt}").as_bytes()) % 1000) as f64 / 1000.0;
                let wait = retry_after
                    .take()
                    .unwrap_or_else(|| Duration::from_secs_f64(base * jitter));
                slot = self.slot_elsewhere(&failed_here, wait).await;
                if slot.is_none() {
                    failed_here.clear();
                }
            }
            let i = match slot {
                Some(i) => i,
                None => self.slot(avoid).await,
            };
            let e = &self.endpoints[i];
            e.sent.fetch_add(1, Ordering::Relaxed);
            let result = self.attempt(e, &body).await;
            e.in_flight.fetch_sub(1, Ordering::AcqRel);
            self.freed.notify_one();
            match result {
                Ok(reply) => {
                    e.succeeded();
                    return Ok(reply);
                }
                Err(Attempt::Refused(why)) => {
                    e.succeeded();
                    return Err(Failure::Refused(why));
                }
                Err(Attempt::Retry { why, down, after }) => {
                    e.failed(down);
                    last = format!("{}: {why}", shown(&e.url));
                    avoid = Some(i);
                    retry_after = after;
                    failed_here.push(i);
                }
            }
        }
        Err(Failure::Exhausted(format!(
            "{} attempts failed, the last at {last}",
            self.attempts
        )))
    }

    async fn attempt(&self, e: &Endpoint, body: &Json) -> Result<Reply, Attempt> {
        let r = self
            .http
            .post(format!("{}/chat/completions", e.url))
            .timeout(self.timeout)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .map_err(|err| Attempt::Retry {
                // No connection, or no answer in time: evidence the server is down.
                why: if err.is_timeout() {
                    format!("no answer within {} s", self.timeout.as_secs())
                } else {
                    root(&err)
                },
                down: true,
                after: None,
            })?;
        let status = r.status();
        let after = r
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(|s| Duration::from_secs(s.min(300)));
        let bytes = r.bytes().await.map_err(|err| Attempt::Retry {
            why: root(&err),
            down: false,
            after: None,
        })?;
        if status.as_u16() == 429 || status.as_u16() == 408 || status.is_server_error() {
            return Err(Attempt::Retry {
                why: format!("HTTP {status}"),
                down: false,
                after,
            });
        }
        if !status.is_success() {
            let text = String::from_utf8_lossy(&bytes);
            let snippet: String = text.chars().take(300).collect();
            return Err(Attempt::Refused(format!("HTTP {status}: {snippet}")));
        }
        let v: Json = serde_json::from_slice(&bytes).map_err(|err| Attempt::Retry {
            why: format!("the answer is not JSON ({err})"),
            down: false,
            after: None,
        })?;
        let choice = &v["choices"][0];
        let message = &choice["message"];
        let Some(content) = message["content"]
            .as_str()
            .or_else(|| message["content"].is_null().then_some(""))
        else {
            return Err(no_message());
        };
        if !message.is_object() {
            return Err(no_message());
        }
        let reasoning = ["reasoning_content", "reasoning"]
            .iter()
            .find_map(|k| message[*k].as_str())
            .filter(|r| !r.is_empty())
            .map(str::to_owned);
        Ok(Reply {
            content: content.to_owned(),
            reasoning,
            finish_reason: choice["finish_reason"]
                .as_str()
                .unwrap_or("stop")
                .to_owned(),
            completion_tokens: v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
        })
    }
}

enum Attempt {
    /// Worth another try; `down` when the failure says the server is not there; `after`, the
    /// wait it asked for.
    Retry {
        why: String,
        down: bool,
        after: Option<Duration>,
    },
    Refused(String),
}

fn no_message() -> Attempt {
    Attempt::Retry {
        why: "the answer has no `choices[0].message`".into(),
        down: false,
        after: None,
    }
}

fn root(e: &dyn std::error::Error) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}
