fn main() {
    std::process::exit(egressd::bridge::run());
}
