//! The `dflash` command.

// One unsafe call, while the process has one thread: `settle_cpu_threads` sets an environment
// variable (see its docs for why).
#[allow(unsafe_code)]
fn main() -> std::process::ExitCode {
    // SAFETY: first thing in main, before any thread exists.
    unsafe { dflash_model::threads::settle_cpu_threads() };
    dflash::cli::main()
}
