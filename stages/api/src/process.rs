//! Stopping child process groups: stages start commands and servers in their own process group
//! (`CommandExt::process_group(0)`), so Ctrl-C reaches dflash first and dflash stops the whole
//! group — the shell and everything it started — instead of leaving orphans.

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
