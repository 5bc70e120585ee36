//! Atomic publication of compiled programs under `<dataDir>/runner-runtime/`.
//!
//! The launch path does not read these files (it hands bwrap a sealed memfd), but operators
//! and the original's tooling look for them here. A reader holding the old file keeps the
//! whole old program, because we replace by rename: a truncated program would make
//! `PR_SET_SECCOMP` fail with EINVAL.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::{Arch, Profile, SeccompError, compile};

/// Compiles `profile` for `arch` and publishes it as `<runtime_dir>/<file name>`, mode 0600,
/// by writing a uniquely named staging file and renaming it over the target.
pub fn publish(runtime_dir: &Path, profile: Profile, arch: Arch) -> Result<PathBuf, SeccompError> {
    let program = compile(profile, arch)?;
    let target = runtime_dir.join(profile.file_name(arch));
    let err = |path: &Path| {
        let path = path.to_owned();
        move |source| SeccompError::Publish { path, source }
    };
    fs::DirBuilder::new().recursive(true).mode(0o700).create(runtime_dir).map_err(err(runtime_dir))?;

    let staging = runtime_dir.join(format!(
        ".{}.{}.{}.tmp",
        profile.file_name(arch),
        std::process::id(),
        unique_suffix()
    ));
    let write = || -> std::io::Result<()> {
        let mut file = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&staging)?;
        file.write_all(program.bytes())?;
        file.sync_all()?;
        fs::rename(&staging, &target)
    };
    write().map_err(|e| {
        let _ = fs::remove_file(&staging);
        SeccompError::Publish { path: target.clone(), source: e }
    })?;
    Ok(target)
}

fn unique_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    COUNTER.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    #[test]
    fn publishes_atomically_with_mode_0600() {
        let dir = tempfile::tempdir().unwrap();
        let runtime = dir.path().join("runner-runtime");
        let arch = Arch::X86_64;
        let path = publish(&runtime, Profile::Baseline, arch).unwrap();
        assert!(path.ends_with("seccomp-x86_64.bpf"));
        let meta = fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let before = meta.ino();

        // A reader holding the old file keeps reading the complete old program.
        let held = fs::read(&path).unwrap();
        let mut handle = fs::File::open(&path).unwrap();
        publish(&runtime, Profile::Baseline, arch).unwrap();
        let mut old = Vec::new();
        std::io::Read::read_to_end(&mut handle, &mut old).unwrap();
        assert_eq!(old, held);
        assert_ne!(fs::metadata(&path).unwrap().ino(), before, "replace must be by rename");

        // Eight concurrent republishes leave one complete file and no staging files.
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| publish(&runtime, Profile::Baseline, arch).unwrap());
            }
        });
        let names: Vec<_> =
            fs::read_dir(&runtime).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        assert_eq!(names, vec!["seccomp-x86_64.bpf".to_owned()]);
        assert_eq!(fs::read(&path).unwrap(), compile(Profile::Baseline, arch).unwrap().bytes());
    }

    #[test]
    fn profiles_get_distinct_files_with_their_arch() {
        let dir = tempfile::tempdir().unwrap();
        for arch in [Arch::X86_64, Arch::Aarch64] {
            for profile in Profile::ALL {
                let path = publish(dir.path(), profile, arch).unwrap();
                let bytes = fs::read(&path).unwrap();
                // The first instruction loads the arch; the second compares it (k at byte 12).
                let k = u32::from_le_bytes(bytes[12..16].try_into().unwrap());
                assert_eq!(k, arch.audit_arch(), "{}", path.display());
            }
        }
        let mut names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "seccomp-aarch64.bpf",
                "seccomp-network-aarch64.bpf",
                "seccomp-network-x86_64.bpf",
                "seccomp-npu-aarch64.bpf",
                "seccomp-npu-x86_64.bpf",
                "seccomp-x86_64.bpf"
            ]
        );
    }

    #[test]
    fn unknown_arch_is_refused_with_the_original_message() {
        let err = Arch::from_name("riscv64").unwrap_err();
        assert!(err.to_string().contains("unavailable for architecture riscv64"));
    }
}
