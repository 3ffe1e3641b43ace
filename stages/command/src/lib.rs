//! The `command` stage kind: run a user's shell command as a pipeline stage.
//!
//! The command runs under `sh -c` in the directory `dflash` was started in, with `$DFLASH_OUT`
//! set to an empty folder whose files become the artifact and `$DFLASH_IN_<ID>` set to a local
//! folder holding each input's files (ID upper-cased, characters other than A-Z and 0-9 turned
//! into `_`). With `shards: N` it runs N times with `$DFLASH_SHARD` = 0..N-1, each run's files
//! committed as soon as it finishes, so a rerun after a crash only runs the missing shards.
//! Its stdout and stderr go to the stage log. A non-zero exit fails the stage.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dflash_stage_api::process::{SIGKILL, SIGTERM, as_the_user_set, kill_group};
use dflash_stage_api::{
    CheckEnv, Issue, Param, ParamType, PathSeg, Pin, Pinner, StageContext, StageError, StageKind,
    StageOutput,
};
use serde::Deserialize;

/// The `command` stage kind.
pub struct CommandKind;

#[derive(Deserialize)]
struct Params {
    run: String,
    env: BTreeMap<String, String>,
    pass_env: Vec<String>,
    files: Vec<String>,
    shards: Option<u32>,
}

/// The environment variable name under which an input is visible to the command.
pub fn input_var(name: &str) -> String {
    let id: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("DFLASH_IN_{id}")
}

impl StageKind for CommandKind {
    fn name(&self) -> &'static str {
        "command"
    }

    fn version(&self) -> u32 {
        1
    }

    fn summary(&self) -> &'static str {
        "run a shell command; files it writes to $DFLASH_OUT become the artifact"
    }

    fn params(&self) -> Vec<Param> {
        vec![
            Param::new("run", ParamType::Str, "the shell command (run with `sh -c`)").required(),
            Param::new("env", ParamType::Map(Box::new(ParamType::Str)), "extra environment variables (hashed into the key)")
                .default(serde_json::json!({})),
            Param::new(
                "pass_env",
                ParamType::List(Box::new(ParamType::Str)),
                "names of variables passed through from dflash's environment; their values never enter the key (use it for secrets)",
            )
            .default(serde_json::json!([])),
            Param::new(
                "files",
                ParamType::List(Box::new(ParamType::Str)),
                "local files the command reads (scripts, configs); their content digests enter the key",
            )
            .default(serde_json::json!([])),
            Param::new("shards", ParamType::Int, "run the command this many times with $DFLASH_SHARD = 0..N-1, committing each run as it finishes").at_least(1.0),
        ]
    }

    fn check(&self, params: &serde_json::Value, env: &CheckEnv<'_>) -> Vec<Issue> {
        let mut issues = Vec::new();
        if params["run"].as_str().is_some_and(|r| r.trim().is_empty()) {
            issues.push(
                Issue::new("run", "the command is empty")
                    .help("e.g. `run: python scripts/prep.py`"),
            );
        }
        for (i, f) in params["files"].as_array().into_iter().flatten().enumerate() {
            let f = f.as_str().unwrap_or_default();
            if !env.path(f).is_file() {
                issues.push(
                    Issue::new("files", format!("`{f}` is not a file"))
                        .below(PathSeg::Index(i))
                        .help("`files` lists the local files the command reads, relative to where dflash runs"),
                );
            }
        }
        let bad_name = |n: &str| n.is_empty() || n.contains('=') || n.contains('\0');
        let shown = |n: &str| {
            if n.is_empty() {
                "an empty name".to_owned()
            } else {
                format!("`{n}`")
            }
        };
        for name in params["env"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, _)| k)
        {
            if bad_name(name) {
                issues.push(
                    Issue::new(
                        "env",
                        format!("{} cannot name an environment variable", shown(name)),
                    )
                    .below(PathSeg::Key(name.clone()))
                    .help("names hold no `=`, e.g. `HF_HOME`"),
                );
            }
        }
        for (i, name) in params["pass_env"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let name = name.as_str().unwrap_or_default();
            if bad_name(name) {
                issues.push(
                    Issue::new(
                        "pass_env",
                        format!("{} cannot name an environment variable", shown(name)),
                    )
                    .below(PathSeg::Index(i))
                    .help("list names only, e.g. `[HF_TOKEN]`; the values never enter the key"),
                );
            }
        }
        issues
    }

    fn pin(&self, params: &serde_json::Value, pinner: &dyn Pinner) -> Result<Vec<Pin>, StageError> {
        let params: Params =
            serde_json::from_value(params.clone()).map_err(|e| StageError::new(e.to_string()))?;
        params
            .files
            .iter()
            .map(|f| {
                let digest = pinner.file_digest(Path::new(f))?;
                Ok(Pin {
                    name: format!("file:{f}"),
                    identity: digest.to_hex(),
                })
            })
            .collect()
    }

    fn run(&self, ctx: &StageContext<'_>) -> Result<StageOutput, StageError> {
        let params: Params = ctx.params()?;
        // `a-b` and `a_b` would both become DFLASH_IN_A_B: refuse rather than hide one.
        let mut seen = BTreeMap::new();
        for input in ctx.inputs {
            if let Some(other) = seen.insert(input_var(&input.name), &input.name) {
                return Err(StageError::new(format!(
                    "inputs `{other}` and `{}` both become `{}`",
                    input.name,
                    input_var(&input.name)
                ))
                .with_help(
                    "name the inputs with a map, e.g. `inputs: {first: a-b, second: a_b}`",
                ));
            }
        }
        let mut stats = serde_json::Map::new();
        match params.shards {
            None => run_once(&params, ctx, ctx.out_dir, None)?,
            Some(n) => {
                let done = ctx.shards.done();
                let mut skipped = 0u64;
                for i in 0..n {
                    let name = format!("shard-{i:05}");
                    if done.contains(&name) {
                        skipped += 1;
                        continue;
                    }
                    let dir = ctx.scratch_dir.join(&name);
                    std::fs::create_dir_all(&dir)?;
                    run_once(&params, ctx, &dir, Some(i))?;
                    ctx.shards.commit(&name, &dir)?;
                    ctx.progress
                        .set(u64::from(i) + 1, Some(u64::from(n)), &name);
                }
                stats.insert("shards".into(), n.into());
                stats.insert("shards_reused".into(), skipped.into());
            }
        }
        Ok(StageOutput {
            stats,
            summary: None,
        })
    }
}

fn run_once(
    params: &Params,
    ctx: &StageContext<'_>,
    out: &Path,
    shard: Option<u32>,
) -> Result<(), StageError> {
    let mut log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(ctx.log_path)?;
    writeln!(log, "$ {}", params.run)?;
    let mut cmd = Command::new("sh");
    as_the_user_set(&mut cmd)
        .arg("-c")
        .arg(&params.run)
        .current_dir(ctx.cwd);
    cmd.stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log.try_clone()?);
    cmd.env("DFLASH_OUT", out)
        .env("DFLASH_STAGE", ctx.stage_id)
        .env("DFLASH_SCRATCH", ctx.scratch_dir);
    if let Some(i) = shard {
        cmd.env("DFLASH_SHARD", i.to_string());
    }
    for input in ctx.inputs {
        cmd.env(input_var(&input.name), &input.dir);
    }
    for (k, v) in &params.env {
        cmd.env(k, v);
    }
    for name in &params.pass_env {
        if let Some(v) = std::env::var_os(name) {
            cmd.env(name, v);
        }
    }
    // Its own process group, so Ctrl-C at the terminal reaches dflash, which then stops the whole
    // group (the shell and everything it started) instead of leaving orphans.
    cmd.process_group(0);
    let child = cmd
        .spawn()
        .map_err(|e| StageError::new(format!("could not start `sh`: {e}")))?;
    let status = wait_or_cancel(child, ctx)?;
    let log_path = PathBuf::from(ctx.log_path);
    if status.success() {
        return Ok(());
    }
    let why = match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        _ => "failed".to_owned(),
    };
    Err(StageError::new(format!("command `{}` {why}", params.run))
        .with_help(format!("its output is in {}", log_path.display()))
        .with_log(log_path))
}

/// Wait for the child; if the run is cancelled first, stop its process group (TERM, then KILL
/// after a grace period) and report cancellation.
fn wait_or_cancel(
    mut child: std::process::Child,
    ctx: &StageContext<'_>,
) -> Result<std::process::ExitStatus, StageError> {
    let pid = child.id();
    let finished = Arc::new(Mutex::new(false));
    let cancel = ctx.cancel.clone();
    let watcher = {
        let finished = finished.clone();
        std::thread::spawn(move || {
            // Wakes at once when cancelled; the periodic wake only lets the thread end after
            // the child is gone.
            loop {
                if cancel.wait_timeout(Duration::from_millis(200)) {
                    if !*finished
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                    {
                        kill_group(pid, SIGTERM);
                        if !cancel_grace(&finished) {
                            kill_group(pid, SIGKILL);
                        }
                    }
                    return;
                }
                if *finished
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                {
                    return;
                }
            }
        })
    };
    let status = child.wait();
    *finished
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = true;
    // Not joined: the watcher sees `finished` at its next wake and ends by itself; joining would
    // add up to one wake interval to every command.
    drop(watcher);
    let status = status?;
    if ctx.cancel.is_cancelled() {
        return Err(StageError::cancelled());
    }
    Ok(status)
}

fn cancel_grace(finished: &Mutex<bool>) -> bool {
    for _ in 0..50 {
        if *finished
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

#[cfg(test)]
mod tests {
    use super::input_var;

    #[test]
    fn input_var_names() {
        assert_eq!(input_var("prompts"), "DFLASH_IN_PROMPTS");
        assert_eq!(input_var("my-data.v2"), "DFLASH_IN_MY_DATA_V2");
    }
}
