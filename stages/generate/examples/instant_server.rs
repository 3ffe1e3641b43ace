//! A benchmark peer (a mock, named as one): an OpenAI-compatible server that answers every
//! chat completion at once (or after `--delay-ms`), so the client is what gets measured.
//! HTTP/1.1 with keep-alive, one fixed reply, on 127.0.0.1 only. `GET /stats` reports requests
//! served and the share of time, from the first request to the last answer, that at least
//! `--capacity` requests were in progress (how saturated a client keeps it).
//!
//! `--fail-every N` answers every Nth chat completion with a quick 503 (a server that is up
//! but sheds some requests), after the same delay.
//!
//!     instant_server --port 8000 [--delay-ms 0] [--capacity 0] [--fail-every 0]

use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const REPLY: &str = r#"{"id":"c","object":"chat.completion","model":"target","choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":"ok"}}],"usage":{"prompt_tokens":1,"completion_tokens":1}}"#;
const MODELS: &str = r#"{"object":"list","data":[{"id":"target","object":"model"}]}"#;

#[derive(Default)]
struct Busy {
    active: usize,
    since: Option<Instant>,
    full: Duration,
    first: Option<Instant>,
    last: Option<Instant>,
    requests: u64,
}

impl Busy {
    fn change(&mut self, delta: isize, capacity: usize) {
        let now = Instant::now();
        self.first.get_or_insert(now);
        if capacity > 0
            && self.active >= capacity
            && let Some(s) = self.since.take()
        {
            self.full += now - s;
        }
        self.active = self.active.saturating_add_signed(delta);
        self.last = Some(now);
        if capacity > 0 && self.active >= capacity {
            self.since = Some(now);
        }
    }
}

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn serve(
    mut s: TcpStream,
    busy: Arc<Mutex<Busy>>,
    delay: Duration,
    capacity: usize,
    fail_every: u64,
) {
    let _ = s.set_nodelay(true);
    let mut buf: Vec<u8> = Vec::with_capacity(8192);
    let mut chunk = [0u8; 8192];
    loop {
        // Read one request: headers, then Content-Length bytes of body.
        let head_end = loop {
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < head_end + length {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let mut status = "200 OK";
        let body: String = if head.starts_with("get /v1/models") {
            MODELS.to_owned()
        } else if head.starts_with("get /stats") {
            let b = busy.lock().unwrap();
            // From the first request to the last answer: the time the client had work to give.
            let total = match (b.first, b.last) {
                (Some(f), Some(l)) => (l - f).as_secs_f64(),
                _ => 0.0,
            };
            format!(
                r#"{{"requests":{},"full_share":{}}}"#,
                b.requests,
                if total > 0.0 {
                    b.full.as_secs_f64() / total
                } else {
                    0.0
                }
            )
        } else {
            let n = {
                let mut b = busy.lock().unwrap();
                b.requests += 1;
                b.change(1, capacity);
                b.requests
            };
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            busy.lock().unwrap().change(-1, capacity);
            if fail_every > 0 && n % fail_every == 0 {
                status = "503 Service Unavailable";
                r#"{"error":"overloaded"}"#.to_owned()
            } else {
                REPLY.to_owned()
            }
        };
        buf.drain(..head_end + length);
        let resp = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        if s.write_all(resp.as_bytes()).await.is_err() {
            return;
        }
    }
}

fn main() {
    let port = arg("--port", 8000) as u16;
    let delay = Duration::from_millis(arg("--delay-ms", 0));
    let capacity = arg("--capacity", 0) as usize;
    let fail_every = arg("--fail-every", 0);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let listener = TcpListener::bind(("127.0.0.1", port)).await.unwrap();
        let busy = Arc::new(Mutex::new(Busy::default()));
        loop {
            let Ok((s, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(serve(s, busy.clone(), delay, capacity, fail_every));
        }
    });
}
