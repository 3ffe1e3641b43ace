//! Child processes: stages start commands and servers in their own process group
//! (`CommandExt::process_group(0)`), so Ctrl-C reaches dflash first and dflash stops the whole
//! group — the shell and everything it started — instead of leaving orphans; and they start
//! with the environment the user gave dflash, not what dflash set for itself ([`as_the_user_set`]).

/// Set (to `1`) beside `RAYON_NUM_THREADS` when dflash set that variable for its own CPU
/// matmuls (`dflash_model::threads`), so children can be given the user's environment back.
pub const THREADS_SETTLED_MARK: &str = "DFLASH_SETTLED_RAYON_NUM_THREADS";

/// Give `cmd` the environment the user started dflash with: without the `RAYON_NUM_THREADS`
/// dflash set for its own matmuls (a user's script or server would otherwise size its rayon
/// pools by it), and without the mark that says so. A value the user set is kept.
pub fn as_the_user_set(cmd: &mut std::process::Command) -> &mut std::process::Command {
    if std::env::var_os(THREADS_SETTLED_MARK).is_some() {
        cmd.env_remove("RAYON_NUM_THREADS")
            .env_remove(THREADS_SETTLED_MARK);
    }
    cmd
}

/// `SIGTERM`.
pub const SIGTERM: i32 = libc::SIGTERM;
/// `SIGKILL`.
pub const SIGKILL: i32 = libc::SIGKILL;

/// Send `sig` to the process group led by `pid`.
#[allow(unsafe_code)]
pub fn kill_group(pid: u32, sig: i32) {
    let Ok(pid) = i32::try_from(pid) else {
        return;
    };
    // SAFETY: kill(2) with a negative pid signals a process group; it has no memory effects.
    unsafe {
        libc::kill(-pid, sig);
    }
}
