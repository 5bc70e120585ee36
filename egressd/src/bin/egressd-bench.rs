fn main() {
    std::process::exit(egressd::bench::run());
}
