fn main() {
    std::process::exit(sandbox_init::run());
}
