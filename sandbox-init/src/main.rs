//! `main` without Rust's runtime start-up (`#![no_main]`): sandbox-init is exec'd once per
//! launch, and skipping `lang_start` (stack-guard discovery through /proc/self/maps, the
//! SIGSEGV handlers, SIGPIPE ignoring) measurably shortens every launch. `std` is still
//! fully usable: glibc passes argv to std's initialiser before `main`.
#![no_main]

#[unsafe(no_mangle)]
pub extern "C" fn main(_argc: libc::c_int, _argv: *const *const libc::c_char) -> libc::c_int {
    sandbox_init::run()
}
