//! `runner-provisioner`: runnerd's conda solver and installer. See the library for the protocol.

fn main() -> std::process::ExitCode {
    runner_provisioner::run()
}
