//! Tiny conda channels built offline, for the provisioner's and runnerd's tests and for
//! benchmarks: real `.tar.bz2` and `.conda` archives (written with rattler's own writer) with
//! `info/index.json`, `info/paths.json` and `info/files`, a corrupt archive, a `python`
//! package made from the host's interpreter, a stub `r-base`, a real `r-base` made from the
//! host's R when it has one, and `repodata.json` per subdir.
//!
//! ```no_run
//! # use test_channel::*;
//! let mut channel = Channel::new("/tmp/channel");
//! channel.package(Pkg::noarch("tinyutil", "1.0").file("bin/tinyutil", b"#!/bin/sh\necho 1\n", true))?;
//! channel.index()?;
//! # Ok::<(), ChannelError>(())
//! ```

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use rattler_conda_types::compression_level::CompressionLevel;
use rattler_digest::{Md5, Sha256, compute_bytes_digest};
use serde_json::{Value, json};

#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("{0} could not be written")]
    Write(PathBuf, #[source] std::io::Error),
    #[error("the interpreter {0} could not be run")]
    Interpreter(PathBuf, #[source] std::io::Error),
    #[error("the interpreter {0} did not report its version and executable")]
    InterpreterOutput(PathBuf),
    #[error("{0} is not an ELF executable (a shim or script?)")]
    NotElf(PathBuf),
    #[error("{0} could not be read")]
    Read(PathBuf, #[source] std::io::Error),
    #[error("the R front end {0} is not the one this builder knows how to relocate")]
    RFrontEnd(PathBuf),
}

/// The archive format of a package.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    TarBz2,
    Conda,
}

/// One package to write. `files` are `(path in the prefix, bytes, executable)`.
#[derive(Debug, Clone)]
pub struct Pkg {
    pub name: String,
    pub version: String,
    pub build: String,
    pub build_number: u64,
    pub depends: Vec<String>,
    /// `noarch` or `linux-64`.
    pub subdir: String,
    pub format: Format,
    pub files: Vec<(String, Vec<u8>, bool)>,
    /// `(path in the prefix, target)`: symbolic links, relative targets inside the prefix.
    pub symlinks: Vec<(String, String)>,
    /// Compress at the lowest level: for large packages of already-compressed files (R's
    /// lazy-load databases), where the default level costs seconds in a debug build and
    /// saves little.
    pub quick: bool,
    /// `paths.json` entries written exactly as given, after the ones above: the shapes a
    /// hostile package lists (an absolute or `..` path, a file that is a link).
    pub raw_entries: Vec<Value>,
    /// `(path, target)`: symbolic links in the archive that `paths.json` does not list as
    /// links (a `raw_entries` entry may list one as a file).
    pub hidden_links: Vec<(String, String)>,
    /// `(info/…, target)`: metadata files (`info/index.json`, `info/paths.json`, `info/files`)
    /// archived as symbolic links to `target` instead of the files written for them.
    pub metadata_links: Vec<(String, String)>,
    /// `(path in the prefix, length)`: files of that many zero bytes, staged sparse, so a
    /// decompression bomb costs its test neither the memory nor the disk it unpacks to.
    pub zeros: Vec<(String, u64)>,
}

impl Pkg {
    /// A `noarch` `.tar.bz2` package, build `0`, no dependencies, no files.
    pub fn noarch(name: &str, version: &str) -> Self {
        Pkg {
            name: name.into(),
            version: version.into(),
            build: "0".into(),
            build_number: 0,
            depends: Vec::new(),
            subdir: "noarch".into(),
            format: Format::TarBz2,
            files: Vec::new(),
            symlinks: Vec::new(),
            quick: false,
            raw_entries: Vec::new(),
            hidden_links: Vec::new(),
            metadata_links: Vec::new(),
            zeros: Vec::new(),
        }
    }

    pub fn depends(mut self, spec: &str) -> Self {
        self.depends.push(spec.into());
        self
    }

    pub fn file(mut self, path: &str, bytes: &[u8], executable: bool) -> Self {
        self.files.push((path.into(), bytes.to_vec(), executable));
        self
    }

    /// A file of `len` zero bytes ([`Pkg::zeros`]).
    pub fn zeros(mut self, path: &str, len: u64) -> Self {
        self.zeros.push((path.into(), len));
        self
    }

    pub fn symlink(mut self, path: &str, target: &str) -> Self {
        self.symlinks.push((path.into(), target.into()));
        self
    }

    /// A `paths.json` entry as given, with no archive member of its own.
    pub fn raw_entry(mut self, entry: Value) -> Self {
        self.raw_entries.push(entry);
        self
    }

    /// A symbolic link in the archive that `paths.json` does not list as one.
    pub fn hidden_link(mut self, path: &str, target: &str) -> Self {
        self.hidden_links.push((path.into(), target.into()));
        self
    }

    /// A metadata file (`info/paths.json`, say) archived as a symbolic link to `target`.
    pub fn metadata_link(mut self, file: &str, target: &str) -> Self {
        self.metadata_links.push((file.into(), target.into()));
        self
    }

    pub fn format(mut self, format: Format) -> Self {
        self.format = format;
        self
    }

    pub fn subdir(mut self, subdir: &str) -> Self {
        self.subdir = subdir.into();
        self
    }

    /// `name-version-build.tar.bz2` / `.conda`.
    pub fn file_name(&self) -> String {
        let ext = match self.format {
            Format::TarBz2 => "tar.bz2",
            Format::Conda => "conda",
        };
        format!("{}-{}-{}.{ext}", self.name, self.version, self.build)
    }

    fn index_json(&self) -> Value {
        let mut index = json!({
            "name": self.name,
            "version": self.version,
            "build": self.build,
            "build_number": self.build_number,
            "depends": self.depends,
            "subdir": self.subdir,
        });
        if self.subdir == "noarch" {
            index["noarch"] = json!("generic");
        }
        index
    }
}

/// A channel directory being built; [`Channel::index`] writes the repodata at the end.
#[derive(Debug)]
pub struct Channel {
    dir: PathBuf,
    /// subdir → file name → repodata record.
    records: BTreeMap<String, BTreeMap<String, Value>>,
}

impl Channel {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Channel { dir: dir.into(), records: BTreeMap::new() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The channel's `file://` URL.
    pub fn url(&self) -> String {
        format!("file://{}", self.dir.display())
    }

    /// Writes `pkg`'s archive into its subdir and records it for the repodata.
    pub fn package(&mut self, pkg: Pkg) -> Result<PathBuf, ChannelError> {
        let stage = self.dir.join(".stage").join(pkg.file_name());
        let _ = fs::remove_dir_all(&stage);
        let mut paths = Vec::new();
        let mut entries = Vec::new();
        for (path, bytes, executable) in &pkg.files {
            let target = stage.join(path);
            write(&target, bytes)?;
            if *executable {
                use std::os::unix::fs::PermissionsExt;
                fs::set_permissions(&target, fs::Permissions::from_mode(0o755))
                    .map_err(|e| ChannelError::Write(target.clone(), e))?;
            }
            paths.push(stage.join(path));
            entries.push(json!({
                "_path": path,
                "path_type": "hardlink",
                "sha256": hex(&compute_bytes_digest::<Sha256>(bytes)),
                "size_in_bytes": bytes.len(),
            }));
        }
        let mut digests: BTreeMap<u64, String> = BTreeMap::new();
        for (path, len) in &pkg.zeros {
            let target = stage.join(path);
            write(&target, b"")?;
            let grown = fs::OpenOptions::new().write(true).open(&target).and_then(|f| f.set_len(*len));
            grown.map_err(|e| ChannelError::Write(target.clone(), e))?;
            let sha256 = digests.entry(*len).or_insert_with(|| zeros_sha256(*len)).clone();
            paths.push(target);
            entries.push(json!({
                "_path": path,
                "path_type": "hardlink",
                "sha256": sha256,
                "size_in_bytes": len,
            }));
        }
        for (path, target) in &pkg.symlinks {
            let link = stage.join(path);
            if let Some(dir) = link.parent() {
                fs::create_dir_all(dir).map_err(|e| ChannelError::Write(link.clone(), e))?;
            }
            std::os::unix::fs::symlink(target, &link).map_err(|e| ChannelError::Write(link.clone(), e))?;
            paths.push(link);
            entries.push(json!({ "_path": path, "path_type": "softlink" }));
        }
        for (path, target) in &pkg.hidden_links {
            let link = stage.join(path);
            if let Some(dir) = link.parent() {
                fs::create_dir_all(dir).map_err(|e| ChannelError::Write(link.clone(), e))?;
            }
            std::os::unix::fs::symlink(target, &link).map_err(|e| ChannelError::Write(link.clone(), e))?;
            paths.push(link);
        }
        entries.extend(pkg.raw_entries.iter().cloned());
        let files: String = pkg
            .files
            .iter()
            .map(|(p, _, _)| p)
            .chain(pkg.zeros.iter().map(|(p, _)| p))
            .chain(pkg.symlinks.iter().map(|(p, _)| p))
            .map(|p| format!("{p}\n"))
            .collect();
        let info = [
            ("info/index.json", pkg.index_json().to_string()),
            ("info/paths.json", json!({ "paths": entries, "paths_version": 1 }).to_string()),
            ("info/files", files),
        ];
        for (path, text) in info {
            let at = stage.join(path);
            match pkg.metadata_links.iter().find(|(file, _)| file == path) {
                Some((_, target)) => {
                    write(&at, b"")?;
                    fs::remove_file(&at).map_err(|e| ChannelError::Write(at.clone(), e))?;
                    std::os::unix::fs::symlink(target, &at)
                        .map_err(|e| ChannelError::Write(at.clone(), e))?;
                }
                None => write(&at, text.as_bytes())?,
            }
            paths.push(at);
        }
        let archive = self.dir.join(&pkg.subdir).join(pkg.file_name());
        write_archive(&pkg, &stage, &paths, &archive)?;
        let _ = fs::remove_dir_all(&stage);
        self.record(&pkg, &archive)?;
        Ok(archive)
    }

    /// A `noarch` `.tar.bz2` archive `name-version-0` whose bytes are garbage (not bzip2),
    /// listed in the repodata with the md5/sha256/size **of the garbage**: the hash check
    /// passes and the failure is the archive itself, as with a truncated or mangled upload.
    pub fn corrupt(&mut self, name: &str, version: &str) -> Result<PathBuf, ChannelError> {
        let pkg = Pkg::noarch(name, version);
        let archive = self.dir.join("noarch").join(pkg.file_name());
        write(&archive, b"this is not a bzip2 stream, nor a tar archive\n")?;
        self.record(&pkg, &archive)?;
        Ok(archive)
    }

    /// A `linux-64` `python` package whose version is `interpreter`'s: a **copy** of the real
    /// interpreter binary as `bin/pythonX.Y` (a symlink would break where runnerd masks the
    /// host interpreter by binding `/dev/null` onto its real path), `bin/python3` and
    /// `bin/python` as relative links to it (inside the prefix, so never masked), and a
    /// `pyvenv.cfg` whose `home` is the host interpreter's directory so that the standard
    /// library (and `ensurepip`'s bundled pip) come from the host.
    ///
    /// `interpreter` is resolved to the real ELF by asking it for `sys.executable` and
    /// following symlinks (pyenv's `python3` on PATH is a shell shim); see [`host_python`].
    pub fn python_from_host(&mut self, interpreter: &Path) -> Result<PathBuf, ChannelError> {
        let (version, real) = interpreter_facts(interpreter)?;
        let bytes = fs::read(&real).map_err(|e| ChannelError::Interpreter(real.clone(), e))?;
        if !bytes.starts_with(b"\x7fELF") {
            return Err(ChannelError::NotElf(real));
        }
        let short: String = version.split('.').take(2).collect::<Vec<_>>().join(".");
        let home = real.parent().unwrap_or(Path::new("/")).display().to_string();
        let cfg = format!("home = {home}\ninclude-system-site-packages = false\nversion = {version}\n");
        let pkg = Pkg {
            name: "python".into(),
            version: version.clone(),
            build: "0_host".into(),
            build_number: 0,
            depends: Vec::new(),
            subdir: "linux-64".into(),
            format: Format::Conda,
            files: vec![
                (format!("bin/python{short}"), bytes, true),
                ("pyvenv.cfg".into(), cfg.into_bytes(), false),
            ],
            symlinks: vec![
                ("bin/python3".into(), format!("python{short}")),
                ("bin/python".into(), format!("python{short}")),
            ],
            quick: false,
            raw_entries: Vec::new(),
            hidden_links: Vec::new(),
            metadata_links: Vec::new(),
            zeros: Vec::new(),
        };
        self.package(pkg)
    }

    /// A stub `r-base` (`noarch`): `bin/R` is a shell script that echoes its arguments, for
    /// wiring tests on machines without R.
    pub fn stub_r_base(&mut self, version: &str) -> Result<PathBuf, ChannelError> {
        let script = b"#!/bin/sh\necho \"stub R $*\"\n";
        self.package(Pkg::noarch("r-base", version).file("bin/R", script, true))
    }

    /// A real `linux-64` `r-base` made from the host's R home (Debian's layout:
    /// [`HOST_R_HOME`] with `etc` linking into `/etc/R` and `share`, `include` and `doc` in
    /// `/usr/share/R`), laid out as conda's is: `lib/R` is the R home, **copied** (the sandbox
    /// sees neither `/etc/R` nor, when masking binds `/dev/null` there, the host's front end),
    /// `bin/R` the front end, base packages and installed ones in `lib/R/library`. Version:
    /// the host R's; build `0_copy_of_host_r`.
    ///
    /// Three changes make the copy the prefix's own: the front ends (`bin/R`, `lib/R/bin/R`)
    /// find the R home from where they are instead of the hard-coded `/usr/lib/R`, so it
    /// works at the prefix's path and at `/opt/science-env`; `etc/Renviron` keeps site
    /// libraries inside the prefix (Debian's names `/usr/local/lib/R/site-library`, which
    /// would come before the prefix in `.libPaths()`); `etc/Renviron.site` is empty (Debian's
    /// adds the host's site libraries and its own `/usr/lib/R/library`). `bin/Rscript` asks
    /// the copied `Rscript` to use this R home (`RHOME`). The `translations` package (8 MiB
    /// of message catalogues) is left out: R speaks English without it.
    pub fn r_from_host(&mut self, r_home: &Path) -> Result<PathBuf, ChannelError> {
        let front = r_home.join("bin/R");
        let version = host_r_version(r_home)?;
        let mut files = Vec::new();
        for dir in ["bin", "etc", "lib", "library", "modules"] {
            collect(&r_home.join(dir), &format!("lib/R/{dir}"), &mut files)?;
        }
        for dir in ["share", "include", "doc"] {
            collect(&Path::new(HOST_R_SHARE).join(dir), &format!("lib/R/{dir}"), &mut files)?;
        }
        files.retain(|(path, _, _)| {
            !path.starts_with("lib/R/library/translations/") && path != "lib/R/etc/Renviron.ucf"
        });
        let script =
            String::from_utf8_lossy(&fs::read(&front).map_err(|e| ChannelError::Read(front.clone(), e))?)
                .into_owned();
        let relocated = |home: &str| {
            relocate_front_end(&script, home).ok_or_else(|| ChannelError::RFrontEnd(front.clone()))
        };
        let lib_front = relocated("$(cd \"$(dirname \"$0\")/..\" && pwd)")?;
        let bin_front = relocated("$(cd \"$(dirname \"$0\")/../lib/R\" && pwd)")?;
        for (path, bytes, _) in files.iter_mut() {
            match path.as_str() {
                "lib/R/bin/R" => *bytes = lib_front.clone().into_bytes(),
                "lib/R/etc/Renviron" => {
                    *bytes = prefix_site_libraries(&String::from_utf8_lossy(bytes)).into_bytes()
                }
                "lib/R/etc/Renviron.site" => {
                    *bytes = b"## The prefix's R has no site-wide environment: its libraries are in lib/R.\n"
                        .to_vec()
                }
                _ => {}
            }
        }
        files.push(("bin/R".into(), bin_front.into_bytes(), true));
        let rscript = "#!/bin/sh\n# Rscript of this prefix: the copied binary, told which R home to start.\n\
            RHOME=\"$(cd \"$(dirname \"$0\")/../lib/R\" && pwd)\"\nexport RHOME\nexec \"$RHOME/bin/Rscript\" \"$@\"\n";
        files.push(("bin/Rscript".into(), rscript.as_bytes().to_vec(), true));
        self.package(Pkg {
            name: "r-base".into(),
            version,
            build: "0_copy_of_host_r".into(),
            build_number: 0,
            depends: Vec::new(),
            subdir: "linux-64".into(),
            format: Format::Conda,
            files,
            symlinks: Vec::new(),
            quick: true,
            raw_entries: Vec::new(),
            hidden_links: Vec::new(),
            metadata_links: Vec::new(),
            zeros: Vec::new(),
        })
    }

    /// Writes `repodata.json` for `noarch` and `linux-64` (empty ones too: a conda channel
    /// always has both).
    pub fn index(&self) -> Result<(), ChannelError> {
        for subdir in ["noarch", "linux-64"] {
            let mut packages = serde_json::Map::new();
            let mut conda = serde_json::Map::new();
            for (file, record) in self.records.get(subdir).into_iter().flatten() {
                let map = if file.ends_with(".conda") { &mut conda } else { &mut packages };
                map.insert(file.clone(), record.clone());
            }
            let repodata = json!({
                "info": { "subdir": subdir },
                "packages": packages,
                "packages.conda": conda,
                "repodata_version": 1,
            });
            let path = self.dir.join(subdir).join("repodata.json");
            write(&path, serde_json::to_string_pretty(&repodata).unwrap_or_default().as_bytes())?;
        }
        let _ = fs::remove_dir_all(self.dir.join(".stage"));
        Ok(())
    }

    fn record(&mut self, pkg: &Pkg, archive: &Path) -> Result<(), ChannelError> {
        let bytes = fs::read(archive).map_err(|e| ChannelError::Write(archive.to_path_buf(), e))?;
        let mut record = pkg.index_json();
        record["md5"] = json!(hex(&compute_bytes_digest::<Md5>(&bytes)));
        record["sha256"] = json!(hex(&compute_bytes_digest::<Sha256>(&bytes)));
        record["size"] = json!(bytes.len());
        self.records.entry(pkg.subdir.clone()).or_default().insert(pkg.file_name(), record);
        Ok(())
    }
}

/// The host interpreter to copy: `/usr/bin/python3` when it exists (the distribution's,
/// what CI has), else whatever `python3` on PATH reports as `sys.executable`.
pub fn host_python() -> Option<PathBuf> {
    let system = Path::new("/usr/bin/python3");
    if system.exists() {
        return Some(system.to_path_buf());
    }
    interpreter_facts(Path::new("python3")).ok().map(|(_, real)| real)
}

/// Where Debian's R keeps its home and its architecture-independent parts.
pub const HOST_R_HOME: &str = "/usr/lib/R";
const HOST_R_SHARE: &str = "/usr/share/R";

/// The host's R home when the distribution's R is installed (`r-base-core`).
pub fn host_r_home() -> Option<PathBuf> {
    let home = Path::new(HOST_R_HOME);
    home.join("bin/exec/R").is_file().then(|| home.to_path_buf())
}

/// The host R's `X.Y.Z`, asked of R itself.
pub fn host_r_version(r_home: &Path) -> Result<String, ChannelError> {
    let front = r_home.join("bin/R");
    let output = Command::new(&front)
        .args(["--vanilla", "--slave", "-e", "cat(format(getRversion()))"])
        .env("R_ENVIRON_USER", "/dev/null")
        .output()
        .map_err(|e| ChannelError::Interpreter(front.clone(), e))?;
    let version = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    match version.split('.').count() == 3 && version.chars().all(|c| c.is_ascii_digit() || c == '.') {
        true => Ok(version),
        false => Err(ChannelError::InterpreterOutput(front)),
    }
}

/// The R front-end script with its R home found from `home` (a shell expression) instead of
/// the configured `R_HOME_DIR=/usr/lib/R`, and its share, include and doc directories inside
/// that home (conda's layout) instead of `/usr/share/R`. `None` when the script does not
/// have the lines this rewrites.
fn relocate_front_end(script: &str, home: &str) -> Option<String> {
    let mut found = 0;
    let lines: Vec<String> = script
        .lines()
        .map(|line| {
            if line.starts_with("R_HOME_DIR=") && !line.starts_with("R_HOME_DIR=\"") {
                found += 1;
                return format!("R_HOME_DIR=\"{home}\"");
            }
            for dir in ["SHARE", "INCLUDE", "DOC"] {
                if line.starts_with(&format!("R_{dir}_DIR=/")) {
                    found += 1;
                    return format!("R_{dir}_DIR=\"${{R_HOME_DIR}}/{}\"", dir.to_ascii_lowercase());
                }
            }
            line.to_owned()
        })
        .collect();
    (found == 4).then(|| lines.join("\n") + "\n")
}

/// `etc/Renviron` with site libraries inside the R home (`%S`, `lib/R/site-library`).
fn prefix_site_libraries(renviron: &str) -> String {
    renviron
        .lines()
        .map(|line| match line.starts_with("R_LIBS_SITE=") {
            true => "R_LIBS_SITE=${R_LIBS_SITE:-'%S'}",
            false => line,
        })
        .map(|line| format!("{line}\n"))
        .collect()
}

/// Every file under `dir` (symbolic links followed: Debian's R home links into `/etc/R`)
/// as `(prefix/relative, bytes, executable)`, sorted.
fn collect(dir: &Path, prefix: &str, out: &mut Vec<(String, Vec<u8>, bool)>) -> Result<(), ChannelError> {
    use std::os::unix::fs::PermissionsExt;
    let read = |e| ChannelError::Read(dir.to_path_buf(), e);
    let mut entries: Vec<_> = fs::read_dir(dir).map_err(read)?.collect::<Result<_, _>>().map_err(read)?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let Ok(meta) = fs::metadata(&path) else {
            continue; // a dangling link: nothing to copy
        };
        let name = format!("{prefix}/{}", entry.file_name().to_string_lossy());
        if meta.is_dir() {
            collect(&path, &name, out)?;
        } else if meta.is_file() {
            let bytes = fs::read(&path).map_err(|e| ChannelError::Read(path.clone(), e))?;
            out.push((name, bytes, meta.permissions().mode() & 0o111 != 0));
        }
    }
    Ok(())
}

/// `X.Y.Z` and the real (symlink-free) path of the interpreter's executable.
fn interpreter_facts(interpreter: &Path) -> Result<(String, PathBuf), ChannelError> {
    let output = Command::new(interpreter)
        .args(["-I", "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3]); print(sys.executable)"])
        .output()
        .map_err(|e| ChannelError::Interpreter(interpreter.to_path_buf(), e))?;
    let text = String::from_utf8_lossy(&output.stdout);
    let mut lines = text.lines();
    let (Some(version), Some(executable)) = (lines.next(), lines.next()) else {
        return Err(ChannelError::InterpreterOutput(interpreter.to_path_buf()));
    };
    let real =
        fs::canonicalize(executable).map_err(|e| ChannelError::Interpreter(PathBuf::from(executable), e))?;
    Ok((version.to_string(), real))
}

fn write_archive(pkg: &Pkg, stage: &Path, paths: &[PathBuf], archive: &Path) -> Result<(), ChannelError> {
    let failed = |e| ChannelError::Write(archive.to_path_buf(), e);
    if let Some(dir) = archive.parent() {
        fs::create_dir_all(dir).map_err(failed)?;
    }
    let file = fs::File::create(archive).map_err(failed)?;
    let level = if pkg.quick { CompressionLevel::Lowest } else { CompressionLevel::Default };
    match pkg.format {
        Format::TarBz2 => {
            rattler_package_streaming::write::write_tar_bz2_package(file, stage, paths, level, None, None)
        }
        Format::Conda => {
            let out_name = format!("{}-{}-{}", pkg.name, pkg.version, pkg.build);
            rattler_package_streaming::write::write_conda_package(
                file,
                stage,
                paths,
                level,
                Some(1),
                &out_name,
                None,
                None,
            )
        }
    }
    .map_err(failed)
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), ChannelError> {
    let failed = |e| ChannelError::Write(path.to_path_buf(), e);
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(failed)?;
    }
    fs::write(path, bytes).map_err(failed)
}

/// The SHA-256 of `len` zero bytes, a mebibyte at a time.
fn zeros_sha256(len: u64) -> String {
    use rattler_digest::digest::Digest;
    let chunk = vec![0u8; 1 << 20];
    let mut hasher = Sha256::new();
    let mut left = len;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        hasher.update(&chunk[..n]);
        left -= n as u64;
    }
    hex(&hasher.finalize())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The demo channel of `make-test-channel`: `tinyutil` 1.0 and 2.0 (`.tar.bz2`), `tinylib`
/// 1.0 (`.conda`) depending on `tinyutil`, `broken` (corrupt), a stub `r-base`, and `python`
/// from the host when one is found.
pub fn demo(dir: &Path) -> Result<Channel, ChannelError> {
    let mut channel = Channel::new(dir);
    for version in ["1.0", "2.0"] {
        let script = format!("#!/bin/sh\necho tinyutil {version}\n");
        channel.package(Pkg::noarch("tinyutil", version).file("bin/tinyutil", script.as_bytes(), true))?;
    }
    channel.package(Pkg::noarch("tinylib", "1.0").depends("tinyutil >=1.0").format(Format::Conda).file(
        "share/tinylib/data.txt",
        b"tinylib data\n",
        false,
    ))?;
    channel.corrupt("broken", "1.0")?;
    channel.stub_r_base("4.4.0")?;
    if let Some(python) = host_python() {
        channel.python_from_host(&python)?;
    }
    channel.index()?;
    Ok(channel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_archives_and_repodata() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut channel = Channel::new(dir.path());
        let bz2 = channel.package(Pkg::noarch("a", "1.0").file("bin/a", b"a", true)).expect("bz2");
        let conda =
            channel.package(Pkg::noarch("b", "1.0").depends("a").format(Format::Conda)).expect("conda");
        channel.corrupt("c", "1.0").expect("corrupt");
        channel.index().expect("index");
        assert!(fs::read(&bz2).expect("read").starts_with(b"BZh"), "bzip2 magic");
        assert!(fs::read(&conda).expect("read").starts_with(b"PK"), "zip magic");
        let repodata: Value =
            serde_json::from_slice(&fs::read(dir.path().join("noarch/repodata.json")).expect("repodata"))
                .expect("json");
        assert_eq!(repodata["packages"]["a-1.0-0.tar.bz2"]["name"], "a");
        assert_eq!(repodata["packages.conda"]["b-1.0-0.conda"]["depends"][0], "a");
        assert_eq!(repodata["packages"]["c-1.0-0.tar.bz2"]["size"], 46);
        assert!(dir.path().join("linux-64/repodata.json").exists());
    }

    #[test]
    fn zeros_are_listed_with_their_size_and_digest_and_compress_to_little() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut channel = Channel::new(dir.path());
        let len = (3 << 20) + 5;
        let archive =
            channel.package(Pkg::noarch("z", "1.0").format(Format::Conda).zeros("share/z", len)).expect("z");
        assert!(fs::metadata(&archive).expect("archive").len() < 64 << 10, "zstd of zeros is small");
        let out = dir.path().join("out");
        rattler_package_streaming::fs::extract(&archive, &out).expect("extracts");
        assert_eq!(fs::read(out.join("share/z")).expect("z"), vec![0u8; len as usize]);
        let paths: Value =
            serde_json::from_slice(&fs::read(out.join("info/paths.json")).expect("paths")).unwrap();
        let entry = &paths["paths"][0];
        assert_eq!((entry["_path"].as_str(), entry["size_in_bytes"].as_u64()), (Some("share/z"), Some(len)));
        let want = hex(&compute_bytes_digest::<Sha256>(vec![0u8; len as usize]));
        assert_eq!(entry["sha256"], want);
    }

    #[test]
    fn python_from_host_is_a_copy() {
        let Some(python) = host_python() else {
            eprintln!("SKIP: no host python3");
            return;
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let mut channel = Channel::new(dir.path());
        let archive = channel.python_from_host(&python).expect("python");
        assert!(archive.starts_with(dir.path().join("linux-64")));
        assert!(fs::metadata(&archive).expect("archive").len() > 1_000_000, "holds the ELF");
    }

    const FRONT_END: &str = "#!/bin/bash\n# Shell wrapper for R executable.\n\nR_HOME_DIR=/usr/lib/R\n\
        if test \"${R_HOME_DIR}\" = \"/usr/lib/R\"; then\n  :\nfi\nR_HOME=\"${R_HOME_DIR}\"\n\
        R_SHARE_DIR=/usr/share/R/share\nexport R_SHARE_DIR\nR_INCLUDE_DIR=/usr/share/R/include\n\
        R_DOC_DIR=/usr/share/R/doc\nexec \"${R_HOME}/bin/exec/R\"\n";

    #[test]
    fn the_r_front_end_finds_its_home_where_it_is() {
        let out = relocate_front_end(FRONT_END, "$(cd \"$(dirname \"$0\")/..\" && pwd)").expect("relocates");
        for line in [
            "R_HOME_DIR=\"$(cd \"$(dirname \"$0\")/..\" && pwd)\"\n",
            "R_SHARE_DIR=\"${R_HOME_DIR}/share\"\n",
            "R_INCLUDE_DIR=\"${R_HOME_DIR}/include\"\n",
            "R_DOC_DIR=\"${R_HOME_DIR}/doc\"\n",
            // Only assignments change: the test of the configured home stays (and is false).
            "if test \"${R_HOME_DIR}\" = \"/usr/lib/R\"; then\n",
        ] {
            assert!(out.contains(line), "{line:?} in {out}");
        }
        assert!(!out.contains("=/usr/share/R"), "{out}");
        // A front end without the lines (another distribution's, a wrapper) is refused.
        assert_eq!(relocate_front_end("#!/bin/sh\nexec /opt/R/bin/R \"$@\"\n", "x"), None);
        let without_doc = FRONT_END.replace("R_DOC_DIR=/usr/share/R/doc\n", "");
        assert_eq!(relocate_front_end(&without_doc, "x"), None);
    }

    #[test]
    fn site_libraries_stay_in_the_prefix() {
        let renviron = "R_LIBS_USER=${R_LIBS_USER:-'%U'}\nR_LIBS_SITE=${R_LIBS_SITE:-'/usr/local/lib/R/site-library:%S'}\nTAR=${TAR-'/bin/tar'}\n";
        assert_eq!(
            prefix_site_libraries(renviron),
            "R_LIBS_USER=${R_LIBS_USER:-'%U'}\nR_LIBS_SITE=${R_LIBS_SITE:-'%S'}\nTAR=${TAR-'/bin/tar'}\n"
        );
    }

    #[test]
    fn r_from_host_is_a_relocated_copy() {
        let Some(home) = host_r_home() else {
            eprintln!("SKIP: no host R (apt-get install --no-install-recommends r-base-core)");
            return;
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let mut channel = Channel::new(dir.path());
        let archive = channel.r_from_host(&home).expect("r-base");
        channel.index().expect("index");
        let name = archive.file_name().expect("name").to_string_lossy().into_owned();
        assert!(name.starts_with("r-base-") && name.ends_with("-0_copy_of_host_r.conda"), "{name}");
        let repodata: Value =
            serde_json::from_slice(&fs::read(dir.path().join("linux-64/repodata.json")).expect("repodata"))
                .expect("json");
        let version = repodata["packages.conda"][&name]["version"].as_str().expect("version").to_owned();
        assert_eq!(version.split('.').count(), 3, "{version}");
    }
}
