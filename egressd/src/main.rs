fn main() {
    std::process::exit(egressd::run());
}
