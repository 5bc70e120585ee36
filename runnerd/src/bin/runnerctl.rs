fn main() {
    std::process::exit(runnerd::ctl::run());
}
