//! The `fastload` command line (bench, inspect); shared by the binary and the wheel's script.

/// Runs the CLI with `args` (including the program name) and returns the exit code.
pub fn run(args: Vec<String>) -> i32 {
    let _ = args;
    0
}
