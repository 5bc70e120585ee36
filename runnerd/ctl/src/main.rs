//! `runnerctl`: everything is in the library ([`runnerctl::run`]), which the tests reach too.

fn main() {
    std::process::exit(runnerctl::run());
}
