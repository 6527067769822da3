fn main() {
    std::process::exit(fastload::cli::run(std::env::args().collect()));
}
