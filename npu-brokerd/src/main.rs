fn main() {
    std::process::exit(npu_brokerd::run());
}
