//! A temp folder to run the `dflash` binary in, shared by the end-to-end test files.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// A temp folder to run `dflash` in, with its own store (`cache/`) and work folder.
pub struct Env {
    /// The folder (removed on drop).
    pub dir: tempfile::TempDir,
    vars: Vec<(String, String)>,
}

impl Env {
    pub fn new() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            vars: Vec::new(),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.path().join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
        p
    }

    /// Set an environment variable for every later `dflash` call.
    pub fn set(&mut self, name: &str, value: &str) {
        self.vars.push((name.to_owned(), value.to_owned()));
    }

    pub fn dflash(&self, args: &[&str]) -> Output {
        self.dflash_under(&[], args)
    }

    /// [`Self::dflash`] run by another program (`wrapper`, its arguments before the command's:
    /// `strace -f ...`).
    pub fn dflash_under(&self, wrapper: &[&str], args: &[&str]) -> Output {
        let mut cmd = match wrapper.split_first() {
            Some((program, before)) => {
                let mut c = Command::new(program);
                c.args(before).arg(env!("CARGO_BIN_EXE_dflash"));
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_dflash")),
        };
        cmd.args(args)
            .current_dir(self.path())
            // The tests' own: a caller's thread count would hide what dflash sets.
            .env_remove("RAYON_NUM_THREADS")
            .env_remove("DFLASH_STORE")
            .env_remove("HF_TOKEN")
            .env_remove("HF_ENDPOINT")
            .env("NO_COLOR", "1")
            .env("DFLASH_WORK", self.path().join(".work"));
        for (k, v) in &self.vars {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    }

    /// Start `dflash run PIPELINE` in the background and return once `shards` shards are
    /// committed to the store (to kill it mid-run at a known point).
    pub fn run_until_shards(&self, pipeline: &str, shards: usize) -> std::process::Child {
        let dir = self.path().join("cache/shards");
        self.run_until(pipeline, "no shard was committed", &|| {
            walk(&dir)
                .iter()
                .filter(|p| p.extension().is_some_and(|e| e == "json"))
                .count()
                >= shards
        })
    }

    /// Start `dflash run PIPELINE` in the background and return once `ready` holds (a file the
    /// run writes has appeared), polling the folder; `what` says what never happened.
    pub fn run_until(
        &self,
        pipeline: &str,
        what: &str,
        ready: &dyn Fn() -> bool,
    ) -> std::process::Child {
        let child = Command::new(env!("CARGO_BIN_EXE_dflash"))
            .args(["run", pipeline])
            .current_dir(self.path())
            .env("DFLASH_WORK", self.path().join(".work"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while !ready() {
            assert!(std::time::Instant::now() < deadline, "{what}");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        child
    }

    /// `dflash run --json`, asserting the exit code; returns status by stage id.
    /// `dflash show STAGE -p PIPELINE`: the artifact's manifest, which must exist.
    pub fn show(&self, stage: &str, pipeline: &str) -> Value {
        let out = self.dflash(&["show", stage, "-p", pipeline]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    pub fn run(&self, pipeline: &str, code: i32) -> (BTreeMap<String, String>, Value) {
        self.run_with(pipeline, &[], code)
    }

    /// [`Self::run`] with more arguments (`-j 4`, `--only STAGE`).
    pub fn run_with(
        &self,
        pipeline: &str,
        args: &[&str],
        code: i32,
    ) -> (BTreeMap<String, String>, Value) {
        let mut all = vec!["run", pipeline, "--json"];
        all.extend_from_slice(args);
        let out = self.dflash(&all);
        assert_eq!(
            out.status.code(),
            Some(code),
            "stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let statuses = v["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s["id"].as_str().unwrap().to_owned(),
                    s["status"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        (statuses, v)
    }

    /// Every object in the store: path -> (bytes, inode, mtime).
    pub fn objects(&self) -> BTreeMap<String, (Vec<u8>, u64, i64)> {
        let mut out = BTreeMap::new();
        for e in walk(&self.path().join("cache")) {
            let m = std::fs::metadata(&e).unwrap();
            out.insert(
                e.strip_prefix(self.path()).unwrap().display().to_string(),
                (
                    std::fs::read(&e).unwrap(),
                    m.ino(),
                    m.mtime_nsec() + m.mtime() * 1_000_000_000,
                ),
            );
        }
        out
    }
}

/// Every file under `dir`, recursively.
pub fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}
