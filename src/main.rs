//! The `dflash` command.

fn main() -> std::process::ExitCode {
    dflash::cli::main()
}
