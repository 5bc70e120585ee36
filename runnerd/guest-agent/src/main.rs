//! The guest agent's binary: PID 1 of the microVM, all of it in the library.

fn main() {
    runner_guest_agent::agent::run()
}
