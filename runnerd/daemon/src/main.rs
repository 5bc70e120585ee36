fn main() {
    std::process::exit(runnerd::cli::run());
}
