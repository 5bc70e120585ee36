fn main() {
    std::process::exit(runner_router::run());
}
