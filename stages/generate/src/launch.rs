//! Servers the stage starts itself: N processes from a command template with `{gpu}` and
//! `{port}` (one per GPU: data parallel, as the story ran SGLang on 8 GPUs), each in its own
//! process group with `CUDA_VISIBLE_DEVICES` set, its output in a log kept with the artifact.
//! The stage waits until each answers its readiness path, and stops every group (TERM, then KILL
//! after a grace period) when it ends, fails or is cancelled.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dflash_stage_api::process::{SIGKILL, SIGTERM, as_the_user_set, kill_group};
use dflash_stage_api::{Cancel, StageError};
use serde::Deserialize;

/// The `launch:` param.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Launch {
    /// The command, run by `sh -c`; `{gpu}` and `{port}` are filled in per server.
    pub command: String,
    /// One server per GPU index listed.
    #[serde(default = "one_gpu")]
    pub gpus: Vec<u32>,
    /// The first server's port; server i listens on `port + i`.
    #[serde(default = "default_port")]
    pub port: u16,
    /// What answers 200 once a server is ready.
    #[serde(default = "default_ready")]
    pub ready_path: String,
    /// How long a server may take to become ready.
    #[serde(default = "default_ready_timeout")]
    pub ready_timeout_s: u64,
}

fn one_gpu() -> Vec<u32> {
    vec![0]
}
fn default_port() -> u16 {
    30000
}
fn default_ready() -> String {
    "/v1/models".into()
}
fn default_ready_timeout() -> u64 {
    1800
}

/// Running servers; stopped on drop.
pub struct Servers {
    children: Vec<Child>,
    /// Their base URLs (`http://127.0.0.1:PORT/v1`).
    pub endpoints: Vec<String>,
    /// Their logs.
    pub logs: Vec<PathBuf>,
}

/// Start the servers and wait until they are ready.
pub fn start(l: &Launch, log_dir: &Path, cancel: &Cancel) -> Result<Servers, StageError> {
    std::fs::create_dir_all(log_dir)?;
    let mut servers = Servers {
        children: Vec::new(),
        endpoints: Vec::new(),
        logs: Vec::new(),
    };
    for (i, gpu) in l.gpus.iter().enumerate() {
        let port = l.port + i as u16;
        let command = l
            .command
            .replace("{gpu}", &gpu.to_string())
            .replace("{port}", &port.to_string());
        let log_path = log_dir.join(format!("server-{i}.log"));
        let log = File::create(&log_path)?;
        let child = as_the_user_set(&mut Command::new("sh"))
            .arg("-c")
            .arg(&command)
            .env("CUDA_VISIBLE_DEVICES", gpu.to_string())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .spawn()
            .map_err(|e| StageError::new(format!("cannot start `{command}`: {e}")))?;
        servers.children.push(child);
        servers
            .endpoints
            .push(format!("http://127.0.0.1:{port}/v1"));
        servers.logs.push(log_path);
    }
    let deadline = Instant::now() + Duration::from_secs(l.ready_timeout_s);
    for (i, child) in servers.children.iter_mut().enumerate() {
        let port = l.port + i as u16;
        let url = format!("http://127.0.0.1:{port}{}", l.ready_path);
        loop {
            if cancel.is_cancelled() {
                return Err(StageError::cancelled());
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(StageError::new(format!(
                    "server {i} (port {port}) exited before it was ready ({status})"
                ))
                .with_help(format!("its output: {}", servers.logs[i].display()))
                .with_log(servers.logs[i].clone()));
            }
            if ready(port, &l.ready_path) {
                break;
            }
            if Instant::now() > deadline {
                return Err(StageError::new(format!(
                    "server {i} did not answer `{url}` within {} s",
                    l.ready_timeout_s
                ))
                .with_help(format!("its output: {}", servers.logs[i].display())));
            }
            cancel.wait_timeout(Duration::from_millis(250));
        }
    }
    Ok(servers)
}

/// A blocking GET of `path` on 127.0.0.1:`port` that answers 200.
fn ready(port: u16, path: &str) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.") && &head[9..12] == b"200"
}

impl Drop for Servers {
    fn drop(&mut self) {
        for c in &self.children {
            kill_group(c.id(), SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for c in &mut self.children {
            while Instant::now() < deadline {
                if matches!(c.try_wait(), Ok(Some(_))) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            kill_group(c.id(), SIGKILL);
            let _ = c.wait();
        }
    }
}
