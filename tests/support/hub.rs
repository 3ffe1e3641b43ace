//! The local Hub test server (`hub_server.py`) and the real dataset files it serves.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// The folder `scripts/fetch-assets` fills with real datasets (`DFLASH_ASSETS` or `.assets`).
pub fn assets() -> PathBuf {
    let dir = std::env::var_os("DFLASH_ASSETS").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join(".assets"),
        PathBuf::from,
    );
    assert!(
        dir.join("mt-bench.jsonl").exists(),
        "the real datasets are missing from `{}`: run `scripts/fetch-assets` (`.ci/run` does)",
        dir.display()
    );
    dir
}

/// A running `hub_server.py`; killed on drop.
pub struct Hub {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// Its request log.
    pub log: PathBuf,
}

impl Hub {
    /// Serve the repos under `root` (`root/owner/name/...`); `cut_after` drops the first GET of
    /// each file after that many bytes.
    pub fn start(root: &Path, cut_after: Option<u64>, token: Option<&str>) -> Self {
        let port_file = root.join(".port");
        let log = root.join(".requests.log");
        let mut cmd = Command::new("python3");
        cmd.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/hub_server.py"))
            .arg("--root")
            .arg(root)
            .arg("--port-file")
            .arg(&port_file)
            .arg("--log")
            .arg(&log);
        if let Some(n) = cut_after {
            cmd.arg("--cut-after").arg(n.to_string());
        }
        if let Some(t) = token {
            cmd.env("HUB_TOKEN", t);
        }
        let child = cmd.spawn().expect("python3 runs");
        // The server writes its port (atomically) once it listens: wait for that file (a
        // deadline only on failure, generous for a loaded 2-core machine).
        let t0 = Instant::now();
        let port = loop {
            if let Ok(s) = std::fs::read_to_string(&port_file) {
                break s.trim().parse().expect("a port");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "hub_server.py did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        Self { child, port, log }
    }

    /// `HF_ENDPOINT` for this server.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The requests it has served so far, one line each.
    pub fn requests(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
