//! `sbx-probe <check>`: makes one system call from inside a sandbox and prints what the
//! kernel answered (`ok` or `errno=N`). Arguments are chosen so that, without our filter,
//! the call would either succeed harmlessly or fail with an errno other than the filter's.

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn answer(ret: i64) -> String {
    if ret == -1 { format!("errno={}", errno()) } else { "ok".to_owned() }
}

fn main() {
    let check = std::env::args().nth(1).unwrap_or_default();
    // SAFETY: each arm is one raw syscall with plain integers or pointers to locals that
    // outlive it; a successful clone child exits at once.
    let ret: i64 = unsafe {
        match check.as_str() {
            "ptrace" => libc::syscall(libc::SYS_ptrace, libc::PTRACE_TRACEME, 0, 0, 0),
            "unshare-user" => libc::syscall(libc::SYS_unshare, libc::CLONE_NEWUSER),
            "clone-newuser" => {
                let pid = libc::syscall(libc::SYS_clone, libc::CLONE_NEWUSER | libc::SIGCHLD, 0, 0, 0, 0);
                if pid == 0 {
                    libc::_exit(0);
                }
                pid
            }
            "clone3" => {
                let mut args = [0u64; 11];
                args[4] = libc::SIGCHLD as u64; // exit_signal
                let pid = libc::syscall(libc::SYS_clone3, args.as_mut_ptr(), std::mem::size_of_val(&args));
                if pid == 0 {
                    libc::_exit(0);
                }
                pid
            }
            "mount" => libc::syscall(
                libc::SYS_mount,
                c"none".as_ptr(),
                c"/tmp".as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                std::ptr::null::<u8>(),
            ),
            "socket-inet" => libc::syscall(libc::SYS_socket, libc::AF_INET, libc::SOCK_STREAM, 0),
            "socket-unix" => libc::syscall(libc::SYS_socket, libc::AF_UNIX, libc::SOCK_STREAM, 0),
            "socket-netlink" => libc::syscall(libc::SYS_socket, libc::AF_NETLINK, libc::SOCK_RAW, 0),
            "socketpair" => {
                let mut fds = [0i32; 2];
                libc::syscall(libc::SYS_socketpair, libc::AF_UNIX, libc::SOCK_STREAM, 0, fds.as_mut_ptr())
            }
            // KEYCTL_GET_KEYRING_ID of the session keyring: works for anyone without a filter.
            "keyctl" => libc::syscall(libc::SYS_keyctl, 0, -3, 0),
            // BPF_MAP_CREATE with a zeroed attr: EINVAL/EPERM from the kernel, EPERM from us.
            "bpf" => {
                let attr = [0u8; 64];
                libc::syscall(libc::SYS_bpf, 0, attr.as_ptr(), attr.len())
            }
            // A software clock event on ourselves: EACCES under perf_event_paranoid, EPERM from us.
            "perf_event_open" => {
                let mut attr = [0u8; 128];
                attr[0..4].copy_from_slice(&1u32.to_ne_bytes()); // PERF_TYPE_SOFTWARE
                attr[4..8].copy_from_slice(&128u32.to_ne_bytes()); // size
                libc::syscall(libc::SYS_perf_event_open, attr.as_ptr(), 0, -1, -1, 0)
            }
            "userfaultfd" => libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC),
            "io_uring_setup" => {
                let mut params = [0u8; 120];
                libc::syscall(libc::SYS_io_uring_setup, 1, params.as_mut_ptr())
            }
            // stdin is a pipe: without a filter the driver answers ENOTTY.
            "tiocsti" => {
                let c = b'x';
                libc::syscall(libc::SYS_ioctl, 0, libc::TIOCSTI, &c as *const u8)
            }
            #[cfg(target_arch = "x86_64")]
            "x32-getpid" => libc::syscall(0x4000_0000 | libc::SYS_getpid),
            "chroot" => libc::syscall(libc::SYS_chroot, c"/tmp".as_ptr()),
            "getpid" => libc::syscall(libc::SYS_getpid),
            other => {
                eprintln!("sbx-probe: unknown check {other:?}");
                std::process::exit(2);
            }
        }
    };
    println!("{}", answer(ret));
}
