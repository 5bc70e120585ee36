fn main() {
    std::process::exit(runnerd::bench::run());
}
