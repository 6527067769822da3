fn main() {
    // args_os: `std::env::args` panics on an argument that is not UTF-8 (a Linux path may not be).
    let args = std::env::args_os()
        .map(fastload::cli::arg_from_os)
        .collect();
    std::process::exit(fastload::cli::run(args));
}
