//! The provisioning steps as sandboxed commands: the conda provisioner's request, pip through
//! the environment's own Python, CRAN and Bioconductor through its R, and the inventories.
//! Building each step is pure (table-tested); running it is [`super::sandboxed::run`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::provision::{self, Op};

use super::sandboxed::{PROVISIONER_MOUNT, Step, Writes};

/// A conda step may download and unpack a large environment.
pub const CONDA_TIMEOUT: Duration = Duration::from_secs(60 * 60);
pub const PIP_TIMEOUT: Duration = Duration::from_secs(30 * 60);
pub const R_TIMEOUT: Duration = Duration::from_secs(60 * 60);
pub const INVENTORY_TIMEOUT: Duration = Duration::from_secs(120);

/// The host of an `http(s)://` URL (no userinfo, no port), lower-cased; `None` otherwise.
pub fn url_host(url: &str) -> Option<String> {
    let rest = url.strip_prefix("https://").or_else(|| url.strip_prefix("http://"))?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host_port = authority.rsplit('@').next().unwrap_or("");
    let host = match host_port.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host_port.split(':').next().unwrap_or(""),
    };
    (!host.is_empty()).then(|| host.to_ascii_lowercase())
}

/// The directory of a `file://` channel URL.
pub fn file_channel_dir(url: &str) -> Option<PathBuf> {
    url.strip_prefix("file://").filter(|p| p.starts_with('/')).map(|p| PathBuf::from(p.trim_end_matches('/')))
}

/// The hosts a set of URLs needs (sorted, unique).
pub fn hosts_of<'a>(urls: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut hosts: Vec<String> = urls.into_iter().filter_map(url_host).collect();
    hosts.sort();
    hosts.dedup();
    hosts
}

/// Whether a host is a literal private, loopback or link-local address, or `localhost`: a
/// channel the operator configured there is allowed as configured (egressd otherwise
/// refuses private destinations).
pub fn is_private_host(host: &str) -> bool {
    if host == "localhost" || host.ends_with(".localhost") {
        return true;
    }
    match host.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(a)) => a.is_private() || a.is_loopback() || a.is_link_local(),
        Ok(std::net::IpAddr::V6(a)) => {
            a.is_loopback() || (a.segments()[0] & 0xfe00) == 0xfc00 || (a.segments()[0] & 0xffc0) == 0xfe80
        }
        Err(_) => false,
    }
}

/// Hosts that serve the public channels and indexes (anaconda.org, the preset mirrors,
/// PyPI, CRAN, Bioconductor): never on a private address, whoever configured them.
pub const PUBLIC_HOSTS: [&str; 9] = [
    "conda.anaconda.org",
    "repo.anaconda.com",
    "mirrors.tuna.tsinghua.edu.cn",
    "mirrors.bfsu.edu.cn",
    "mirrors.ustc.edu.cn",
    "pypi.org",
    PYPI_FILES,
    "cloud.r-project.org",
    "bioconductor.org",
];

/// Whether a step may reach private addresses (egressd's policy is one switch for all the
/// step's hosts): only when it reaches something, and every host it reaches is a literal
/// private address (which only the operator's configuration can name: a request names
/// configured channels or preset mirrors) or a host of the operator's own configuration
/// (`configured`: a LAN mirror allowed as configured) that is not one of the public
/// [`PUBLIC_HOSTS`]. A preset mirror or a default public host resolves to public addresses
/// only, so a poisoned name cannot point a step into the LAN.
pub fn private_allowed(hosts: &[String], configured: &[String]) -> bool {
    !hosts.is_empty()
        && hosts
            .iter()
            .all(|h| is_private_host(h) || (configured.contains(h) && !PUBLIC_HOSTS.contains(&h.as_str())))
}

/// Pins the origins of `configured` URLs (the operator's channels or CRAN mirror) whose host
/// no allowlist entry can name — an IP literal (`http://10.1.2.3/conda`,
/// `http://127.0.0.1:8080/ch`) or a single-label name (`http://mirror:3128/`) — and takes
/// their hosts off `hosts` (issue #30): egressd then admits exactly that scheme, host and
/// port, as the original's host-side tools reached them. A URL a request named is never
/// pinned. The private switch is then decided on the hosts left ([`private_allowed`], the
/// configured URLs' hosts as the operator's).
pub fn pin_configured(step: &mut Step, configured: &[String]) {
    let mut hosts_left = step.hosts.clone();
    for url in configured {
        let (Some(host), Ok(origin)) = (url_host(url), common::egress::origin::Origin::of_url(url)) else {
            continue;
        };
        if !step.hosts.contains(&host) || common::egress::Entry::parse(&host).is_ok() {
            continue;
        }
        hosts_left.retain(|h| *h != host);
        let text = origin.to_string();
        if !step.origins.contains(&text) {
            step.origins.push(text);
        }
    }
    step.origins.sort();
    step.hosts = hosts_left;
    step.allow_private = private_allowed(&step.hosts, &hosts_of(configured.iter().map(String::as_str)));
}

/// Where conda's packages are cached: the store's own cache (written by fetch steps), and the
/// operator's offline cache (never written).
#[derive(Debug)]
pub struct CondaPlaces<'a> {
    pub provisioner: &'a Path,
    pub cache_dir: &'a Path,
    pub read_only_caches: &'a [PathBuf],
    pub offline: bool,
    /// The most bytes a link step's packages may add (`env_step_max_prefix_bytes`; 0: none).
    pub max_prefix_bytes: u64,
}

/// A `runner-provisioner` step: the request on stdin. No step has both the cache and the
/// prefix writable (see [`provision::Stage`]): a fetch step (and `List`) sees the prefix
/// read-only and, for a change, the cache writable, `file://` channels read-only and network
/// only to the remote channels' hosts; a link step sees the prefix writable, the caches
/// read-only, no channel and no network.
pub fn conda(
    places: &CondaPlaces<'_>,
    op: Op,
    prefix: &Path,
    channels: &[String],
    extra_ro: &[PathBuf],
    stage: provision::Stage,
) -> Step {
    let linking = matches!(stage, provision::Stage::Link { .. });
    let listing = op == Op::List;
    let request = provision::Request {
        op,
        prefix: prefix.to_path_buf(),
        channels: channels.to_vec(),
        cache_dir: places.cache_dir.to_path_buf(),
        read_only_caches: places.read_only_caches.to_vec(),
        offline: places.offline,
        stage,
        max_prefix_bytes: places.max_prefix_bytes,
    };
    let mut binds = vec![(prefix.to_path_buf(), linking)];
    if !listing {
        binds.push((places.cache_dir.to_path_buf(), !linking));
        binds.extend(places.read_only_caches.iter().map(|d| (d.clone(), false)));
    }
    if !linking && !listing {
        binds.extend(channels.iter().filter_map(|c| file_channel_dir(c)).map(|d| (d, false)));
    }
    binds.extend(extra_ro.iter().map(|p| (p.clone(), false)));
    let hosts = match places.offline || linking || listing {
        true => Vec::new(),
        false => hosts_of(channels.iter().map(String::as_str)),
    };
    let allow_private = private_allowed(&hosts, &[]);
    Step {
        label: "conda",
        command: vec![PROVISIONER_MOUNT.to_owned()],
        // Serialising a plain struct of strings and paths cannot fail.
        stdin: serde_json::to_vec(&request).unwrap_or_default(),
        binds,
        provisioner: Some(places.provisioner.to_path_buf()),
        env: Vec::new(),
        hosts,
        origins: Vec::new(),
        allow_private,
        timeout: CONDA_TIMEOUT,
        writes: match (linking, listing) {
            (true, _) => Some(Writes::Prefix(prefix.to_path_buf())),
            (false, false) => Some(Writes::Cache(places.cache_dir.to_path_buf())),
            (false, true) => None,
        },
    }
}

/// pip's default index, and the host PyPI serves its files from.
pub const PYPI: &str = "https://pypi.org/simple";
pub const PYPI_FILES: &str = "files.pythonhosted.org";

/// Where pip gets packages: an HTTPS index, the offline cache (`--no-index --find-links`),
/// or nowhere (`--no-index`: only local wheels, whose dependencies must be installed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PipSource {
    Index(String),
    Offline(PathBuf),
    WheelsOnly,
}

/// pip through the environment's own interpreter, after `ensurepip` when the environment has
/// no pip yet (`-I`: no user site, no `PYTHON*` variables; the sandbox's environment is empty
/// anyway, so `PYTHONHOME`, `PYTHONPATH` and `PYTHONUSERBASE` are never set).
pub fn pip(prefix: &Path, source: &PipSource, specs: &[String], wheels: &[PathBuf]) -> Step {
    let python = prefix.join("bin/python").to_string_lossy().into_owned();
    let script = r#"set -e
py="$1"; shift
"$py" -I -c "import pip" 2>/dev/null || "$py" -I -m ensurepip --default-pip >&2
exec "$py" -I -m pip install --disable-pip-version-check --no-input "$@""#;
    let mut command =
        vec!["/usr/bin/bash".to_owned(), "-c".to_owned(), script.to_owned(), "pip".to_owned(), python];
    let mut binds = vec![(prefix.to_path_buf(), true)];
    let mut hosts = Vec::new();
    match source {
        PipSource::Index(url) => {
            command.extend(["--index-url".to_owned(), url.clone()]);
            hosts = hosts_of([url.as_str()]);
            // PyPI's index links its files on another host.
            if url.trim_end_matches('/') == PYPI {
                hosts.push(PYPI_FILES.to_owned());
            }
        }
        PipSource::Offline(cache) => {
            command.extend([
                "--no-index".to_owned(),
                "--find-links".to_owned(),
                cache.to_string_lossy().into_owned(),
            ]);
            binds.push((cache.clone(), false));
        }
        PipSource::WheelsOnly => command.push("--no-index".to_owned()),
    }
    command.extend(specs.iter().cloned());
    for w in wheels {
        command.push(w.to_string_lossy().into_owned());
        if let Some(dir) = w.parent() {
            binds.push((dir.to_path_buf(), false));
        }
    }
    Step {
        label: "pip",
        command,
        stdin: Vec::new(),
        binds,
        provisioner: None,
        env: vec![("PIP_NO_CACHE_DIR".into(), "1".into())],
        hosts,
        // The index is the request's, never pinned: an origin a request names would let a
        // tenant tunnel to any address and port.
        origins: Vec::new(),
        // The index is the request's: never a private address (not even `localhost`).
        allow_private: false,
        timeout: PIP_TIMEOUT,
        writes: Some(Writes::Prefix(prefix.to_path_buf())),
    }
}

/// An R string literal.
fn r_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            _ => out.push(c),
        }
    }
    out.push('"');
    out
}

/// CRAN (`install.packages`) or Bioconductor (`BiocManager::install`) through the
/// environment's R, with `R_ENVIRON_USER=/dev/null` and `--vanilla`.
///
/// R only warns, and exits 0, when a package is not in the repository, its download fails
/// or its build fails; the original then records a revision as if it had landed. Here the
/// step fails when a requested package is not in the library R installs into afterwards, or
/// when one of those warnings names it (a reinstall or an upgrade that failed leaves the old
/// copy in place); `warn = 1` prints R's own warnings as they happen, so the failure
/// carries R's words. A package already current that Bioconductor skips is a success, as in
/// the original. The warnings are R's English ones: the step's environment sets no locale.
///
/// `cran` is the operator's repository (`SCIENCE_AGENT_CRAN_REPO`, never a request's): like
/// a configured conda channel, its host may resolve to a private address (an offline site's
/// mirror), unless it is a public one ([`private_allowed`]). A Bioconductor step also
/// reaches `bioconductor.org`, which never may; egressd's switch is per step, so such a step
/// reaches no private address at all.
pub fn r_install(prefix: &Path, bioconductor: bool, cran: &str, packages: &[String]) -> Step {
    let list = packages.iter().map(|p| r_string(p)).collect::<Vec<_>>().join(", ");
    let install = match bioconductor {
        false => format!("install.packages(pkgs, repos = {}, Ncpus = 1)", r_string(cran)),
        true => format!(
            "options(repos = c(CRAN = {})); if (!requireNamespace(\"BiocManager\", quietly = TRUE)) install.packages(\"BiocManager\", Ncpus = 1); BiocManager::install(pkgs, ask = FALSE, update = FALSE, Ncpus = 1)",
            r_string(cran)
        ),
    };
    let expr = format!(
        "options(warn = 1); pkgs <- c({list}); failed <- character(); \
         named <- function(m) pkgs[vapply(pkgs, function(p) grepl(paste0(\"'\", p, \"'\"), m, fixed = TRUE) || grepl(paste0(\"\\u2018\", p, \"\\u2019\"), m, fixed = TRUE), logical(1))]; \
         withCallingHandlers({install}, warning = function(w) {{ m <- conditionMessage(w); \
         if (grepl(\"is not available|non-zero exit status|download of package|cannot open URL\", m)) failed <<- c(failed, named(m)) }}); \
         missed <- unique(c(failed, pkgs[!file.exists(file.path(.libPaths()[1], pkgs, \"DESCRIPTION\"))])); \
         if (length(missed)) stop(\"not installed: \", paste(missed, collapse = \", \"), call. = FALSE)"
    );
    let r = prefix.join("bin/R").to_string_lossy().into_owned();
    let mut hosts = hosts_of([cran]);
    if bioconductor {
        hosts.push("bioconductor.org".into());
        hosts.sort();
        hosts.dedup();
    }
    Step {
        label: if bioconductor { "bioconductor" } else { "cran" },
        command: vec![r, "--vanilla".into(), "--slave".into(), "-e".into(), expr],
        stdin: Vec::new(),
        binds: vec![(prefix.to_path_buf(), true)],
        provisioner: None,
        env: vec![("R_ENVIRON_USER".into(), "/dev/null".into())],
        allow_private: private_allowed(&hosts, &hosts_of([cran])),
        hosts,
        origins: Vec::new(),
        timeout: R_TIMEOUT,
        writes: Some(Writes::Prefix(prefix.to_path_buf())),
    }
}

/// The Python inventory: one JSON array of `{name, version, installer}` on stdout.
pub fn python_inventory(prefix: &Path) -> Step {
    let script = "import importlib.metadata as m, json\n\
        seen = {}\n\
        for d in m.distributions():\n\
        \x20   n = d.metadata['Name']\n\
        \x20   if n and n.lower() not in seen:\n\
        \x20       seen[n.lower()] = {'name': n, 'version': d.version, 'installer': (d.read_text('INSTALLER') or '').strip()}\n\
        print(json.dumps(sorted(seen.values(), key=lambda e: e['name'].lower())))\n";
    Step {
        label: "inventory",
        command: vec![
            prefix.join("bin/python").to_string_lossy().into_owned(),
            "-I".into(),
            "-c".into(),
            script.into(),
        ],
        stdin: Vec::new(),
        binds: vec![(prefix.to_path_buf(), false)],
        provisioner: None,
        env: Vec::new(),
        hosts: Vec::new(),
        origins: Vec::new(),
        allow_private: false,
        timeout: INVENTORY_TIMEOUT,
        writes: None,
    }
}

/// The R inventory: `Package<TAB>Version<TAB>Repository` lines.
pub fn r_inventory(prefix: &Path) -> Step {
    let expr = "ip <- installed.packages(fields = \"Repository\"); write.table(ip[, c(\"Package\", \"Version\", \"Repository\"), drop = FALSE], sep = \"\\t\", quote = FALSE, row.names = FALSE, col.names = FALSE)";
    Step {
        label: "inventory",
        command: vec![
            prefix.join("bin/R").to_string_lossy().into_owned(),
            "--vanilla".into(),
            "--slave".into(),
            "-e".into(),
            expr.into(),
        ],
        stdin: Vec::new(),
        binds: vec![(prefix.to_path_buf(), false)],
        provisioner: None,
        env: vec![("R_ENVIRON_USER".into(), "/dev/null".into())],
        hosts: Vec::new(),
        origins: Vec::new(),
        allow_private: false,
        timeout: INVENTORY_TIMEOUT,
        writes: None,
    }
}

/// The most packages one inventory may list (the largest real environments hold a few
/// thousand). The interpreter that prints it lives in the prefix, where a pip or R step may
/// have replaced it, and every revision's list is kept in the catalog for good: an
/// inventory past this fails the change instead of growing the catalog by megabytes.
pub const MAX_INVENTORY_ENTRIES: usize = 20_000;
/// The longest name (PyPI's limit) and version (no real one comes near) an entry may have.
const MAX_NAME_BYTES: usize = 214;
const MAX_VERSION_BYTES: usize = 128;
/// The longest installer or repository text kept.
const MAX_SOURCE_BYTES: usize = 256;

/// An inventory that lists more than [`MAX_INVENTORY_ENTRIES`] packages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the environment's {language} inventory lists more than {MAX_INVENTORY_ENTRIES} packages; a package step may have replaced its interpreter"
)]
pub struct InventoryTooLarge {
    pub language: &'static str,
}

/// Whether an inventory entry looks like a package: a name of letters, digits and `._-+`,
/// a printable version, and a short printable source, each within its length.
fn plausible(name: &str, version: &str, source: &str) -> bool {
    (1..=MAX_NAME_BYTES).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-+".contains(&b))
        && (1..=MAX_VERSION_BYTES).contains(&version.len())
        && version.bytes().all(|b| b.is_ascii_graphic())
        && source.len() <= MAX_SOURCE_BYTES
        && source.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
}

/// At most [`MAX_INVENTORY_ENTRIES`] of `entries`.
fn bounded(
    entries: Vec<(String, String, String)>,
    language: &'static str,
) -> Result<Vec<(String, String, String)>, InventoryTooLarge> {
    match entries.len() > MAX_INVENTORY_ENTRIES {
        true => Err(InventoryTooLarge { language }),
        false => Ok(entries),
    }
}

/// `{name, version, installer}` entries of the Python inventory; anything else, and any
/// entry that does not look like a package ([`plausible`]), is dropped.
pub fn parse_python_inventory(stdout: &str) -> Result<Vec<(String, String, String)>, InventoryTooLarge> {
    let Ok(serde_json::Value::Array(items)) = serde_json::from_str::<serde_json::Value>(stdout.trim()) else {
        return Ok(Vec::new());
    };
    if items.len() > MAX_INVENTORY_ENTRIES {
        return Err(InventoryTooLarge { language: "Python" });
    }
    let entries = items
        .iter()
        .filter_map(|i| {
            let s = |k: &str| i.get(k).and_then(|v| v.as_str()).map(str::to_owned);
            Some((s("name")?, s("version")?, s("installer").unwrap_or_default()))
        })
        .filter(|(n, v, i)| plausible(n, v, i))
        .collect();
    bounded(entries, "Python")
}

/// `Package<TAB>Version<TAB>Repository` lines; malformed lines are dropped.
pub fn parse_r_inventory(stdout: &str) -> Result<Vec<(String, String, String)>, InventoryTooLarge> {
    let entries = stdout
        .lines()
        .filter_map(|l| {
            let mut f = l.split('\t');
            let (name, version) = (f.next()?.trim(), f.next()?.trim());
            let repo = f.next().unwrap_or("").trim();
            let repo = if repo == "NA" { "" } else { repo };
            let ok = name.chars().all(|c| c.is_ascii_alphanumeric() || c == '.')
                && version.chars().next().is_some_and(|c| c.is_ascii_digit())
                && plausible(name, version, repo);
            ok.then(|| (name.to_owned(), version.to_owned(), repo.to_owned()))
        })
        .take(MAX_INVENTORY_ENTRIES + 1)
        .collect();
    bounded(entries, "R")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn hosts_come_from_http_urls_only() {
        for (url, host) in [
            ("https://conda.anaconda.org/conda-forge", Some("conda.anaconda.org")),
            ("http://127.0.0.1:8080/ch", Some("127.0.0.1")),
            ("https://user:pw@Mirror.Example:443/x", Some("mirror.example")),
            ("http://[::1]:9/c", Some("::1")),
            ("file:///srv/ch", None),
            ("conda-forge", None),
            ("https:///nohost", None),
        ] {
            assert_eq!(url_host(url).as_deref(), host, "{url}");
        }
        assert_eq!(
            hosts_of(["https://b.example/x", "https://a.example/", "https://b.example/y"]),
            ["a.example", "b.example"]
        );
    }

    #[test]
    fn private_hosts_are_literal_addresses_or_localhost() {
        for (h, private) in [
            ("127.0.0.1", true),
            ("10.1.2.3", true),
            ("192.168.0.9", true),
            ("::1", true),
            ("fd00::1", true),
            ("localhost", true),
            ("8.8.8.8", false),
            ("conda.anaconda.org", false),
        ] {
            assert_eq!(is_private_host(h), private, "{h}");
        }
    }

    #[test]
    fn only_configured_private_hosts_may_resolve_privately() {
        let v = |hs: &[&str]| hs.iter().map(|h| (*h).to_owned()).collect::<Vec<_>>();
        let configured = v(&["mirror.lan", "conda.anaconda.org", "mirrors.tuna.tsinghua.edu.cn"]);
        for (hosts, allowed) in [
            (v(&[]), false),
            (v(&["mirror.lan"]), true),
            (v(&["127.0.0.1"]), true),
            (v(&["mirror.lan", "10.0.0.7"]), true),
            // The default channel and the preset mirrors are public, even when configured.
            (v(&["conda.anaconda.org"]), false),
            (v(&["mirror.lan", "conda.anaconda.org"]), false),
            (v(&["mirrors.tuna.tsinghua.edu.cn"]), false),
            (v(&["mirror.lan", "bioconductor.org"]), false),
            (v(&["mirror.lan.evil"]), false),
        ] {
            assert_eq!(private_allowed(&hosts, &configured), allowed, "{hosts:?}");
        }
    }

    #[test]
    fn no_conda_step_has_both_the_cache_and_the_prefix_writable() {
        let ro_caches = [PathBuf::from("/srv/offline-pkgs")];
        let places = CondaPlaces {
            provisioner: Path::new("/usr/lib/runner/runner-provisioner"),
            cache_dir: Path::new("/d/pkgs"),
            read_only_caches: &ro_caches,
            offline: false,
            max_prefix_bytes: 1 << 30,
        };
        let channels = vec!["file:///srv/ch/".to_owned(), "http://127.0.0.1:9/c".to_owned()];
        let create = || Op::Create { specs: vec!["python=3.11".into()] };
        let p = |s: &str| PathBuf::from(s);
        let link = provision::Stage::Link { solution: "[]".into() };
        for (op, stage, binds, hosts) in [
            (
                create(),
                provision::Stage::Fetch,
                vec![
                    (p("/d/p"), false),
                    (p("/d/pkgs"), true),
                    (p("/srv/offline-pkgs"), false),
                    (p("/srv/ch"), false),
                ],
                vec!["127.0.0.1"],
            ),
            (
                create(),
                link.clone(),
                vec![(p("/d/p"), true), (p("/d/pkgs"), false), (p("/srv/offline-pkgs"), false)],
                vec![],
            ),
            (Op::List, provision::Stage::Fetch, vec![(p("/d/p"), false)], vec![]),
        ] {
            let step = conda(&places, op.clone(), Path::new("/d/p"), &channels, &[], stage.clone());
            assert_eq!(step.command, [PROVISIONER_MOUNT]);
            assert_eq!(step.binds, binds, "{op:?} {stage:?}");
            assert!(step.binds.iter().filter(|(_, w)| *w).count() <= 1, "one writable place at most");
            assert_eq!(step.hosts, hosts, "{op:?} {stage:?}");
            assert_eq!(step.allow_private, !hosts.is_empty());
            // The one writable place is the one measured: the prefix a link step writes, the
            // shared cache a fetch step writes (its growth).
            let watched = binds.iter().find(|(_, w)| *w).map(|(p, _)| match p == Path::new("/d/p") {
                true => Writes::Prefix(p.clone()),
                false => Writes::Cache(p.clone()),
            });
            assert_eq!(step.writes, watched, "{op:?} {stage:?}");
            let req: provision::Request = serde_json::from_slice(&step.stdin).unwrap();
            assert_eq!(req.max_prefix_bytes, 1 << 30);
            assert_eq!(
                (req.channels, req.stage, req.read_only_caches),
                (channels.clone(), stage, ro_caches.to_vec())
            );
            assert!(!req.offline);
        }
        let offline = CondaPlaces { offline: true, ..places };
        let step = conda(&offline, create(), Path::new("/d/p"), &channels, &[], provision::Stage::Fetch);
        assert!(step.hosts.is_empty(), "offline opens no connection");
    }

    #[test]
    fn pip_uses_the_environments_python_isolated_and_only_its_index() {
        let step = pip(
            Path::new("/d/p"),
            &PipSource::Index("https://pypi.example/simple".into()),
            &["requests==2.0".into()],
            &[PathBuf::from("/d/wheels/ab/x-1.0-py3-none-any.whl")],
        );
        let tail: Vec<&str> = step.command[4..].iter().map(String::as_str).collect();
        assert_eq!(
            tail,
            [
                "/d/p/bin/python",
                "--index-url",
                "https://pypi.example/simple",
                "requests==2.0",
                "/d/wheels/ab/x-1.0-py3-none-any.whl"
            ]
        );
        assert!(step.command[2].contains("-I -m pip install --disable-pip-version-check --no-input"));
        assert_eq!(step.hosts, ["pypi.example"]);
        assert_eq!(step.writes, Some(Writes::Prefix(PathBuf::from("/d/p"))), "measured as it runs");
        assert!(step.binds.contains(&(PathBuf::from("/d/wheels/ab"), false)));
        let off = pip(Path::new("/d/p"), &PipSource::Offline("/cache".into()), &["x".into()], &[]);
        assert!(off.command.windows(3).any(|w| w == ["--no-index", "--find-links", "/cache"]));
        assert!(off.hosts.is_empty());
        let pypi = pip(Path::new("/d/p"), &PipSource::Index(PYPI.into()), &["x".into()], &[]);
        assert_eq!(pypi.hosts, ["pypi.org", "files.pythonhosted.org"]);
        let local =
            pip(Path::new("/d/p"), &PipSource::Index("https://localhost/simple".into()), &["x".into()], &[]);
        assert!(!local.allow_private, "a request's index never reaches private addresses");
    }

    #[test]
    fn r_installs_quote_their_arguments() {
        let s = r_install(
            Path::new("/d/p"),
            false,
            "https://cloud.r-project.org",
            &["survival".into(), "a\"b".into()],
        );
        assert_eq!(s.label, "cran");
        assert_eq!(&s.command[..4], ["/d/p/bin/R", "--vanilla", "--slave", "-e"]);
        assert!(
            s.command[4].starts_with(
                "options(warn = 1); pkgs <- c(\"survival\", \"a\\\"b\"); failed <- character(); "
            )
        );
        assert!(
            s.command[4]
                .contains("install.packages(pkgs, repos = \"https://cloud.r-project.org\", Ncpus = 1)")
        );
        assert!(s.command[4].ends_with(
            "if (length(missed)) stop(\"not installed: \", paste(missed, collapse = \", \"), call. = FALSE)"
        ));
        assert_eq!(s.hosts, ["cloud.r-project.org"]);
        assert!(!s.allow_private, "CRAN's own host is public");
        let mirror = r_install(Path::new("/d/p"), false, "http://cran.lan:8080/", &["x".into()]);
        assert!(mirror.allow_private, "the operator's own mirror is allowed as configured");
        let b = r_install(Path::new("/d/p"), true, "https://cloud.r-project.org", &["DESeq2".into()]);
        assert!(b.command[4].contains("pkgs <- c(\"DESeq2\")"));
        assert!(b.command[4].contains("BiocManager::install(pkgs, ask = FALSE, update = FALSE, Ncpus = 1)"));
        assert_eq!(b.hosts, ["bioconductor.org", "cloud.r-project.org"]);
        assert!(!b.allow_private, "bioconductor.org never resolves to a private address");
        let lan = r_install(Path::new("/d/p"), true, "http://10.0.0.5/cran", &["DESeq2".into()]);
        assert!(!lan.allow_private, "one switch for the step: bioconductor.org keeps it off");
    }

    #[test]
    fn inventories_parse_and_drop_noise() {
        let py =
            parse_python_inventory(r#"[{"name":"pip","version":"23.2.1","installer":"pip"},{"name":"x"}]"#)
                .unwrap();
        assert_eq!(py, [("pip".into(), "23.2.1".into(), "pip".into())]);
        assert!(parse_python_inventory("not json").unwrap().is_empty());
        let r = parse_r_inventory("survival\t3.5-7\tCRAN\nbase\t4.4.1\tNA\nargs: --vanilla -e x\n").unwrap();
        assert_eq!(
            r,
            [
                ("survival".into(), "3.5-7".into(), "CRAN".into()),
                ("base".into(), "4.4.1".into(), String::new())
            ]
        );
    }

    #[test]
    fn inventory_entries_that_are_no_package_are_dropped() {
        let long = "a".repeat(215);
        let cases = [
            (json!({"name": "numpy", "version": "2.1.0", "installer": "pip"}), true),
            (json!({"name": "zope.interface", "version": "6.0", "installer": ""}), true),
            (json!({"name": "a".repeat(214), "version": "1", "installer": "pip"}), true),
            (json!({"name": long, "version": "1", "installer": "pip"}), false),
            (json!({"name": "x y", "version": "1", "installer": "pip"}), false),
            (json!({"name": "x\n", "version": "1", "installer": "pip"}), false),
            (json!({"name": "", "version": "1", "installer": "pip"}), false),
            (json!({"name": "x", "version": "1".repeat(129), "installer": "pip"}), false),
            (json!({"name": "x", "version": "1 2", "installer": "pip"}), false),
            (json!({"name": "x", "version": "1", "installer": "p".repeat(257)}), false),
        ];
        for (entry, kept) in cases {
            let text = serde_json::to_string(&vec![entry.clone()]).unwrap();
            assert_eq!(parse_python_inventory(&text).unwrap().len(), usize::from(kept), "{entry}");
        }
        assert!(parse_r_inventory(&format!("{long}\t1.0\tCRAN\n")).unwrap().is_empty());
    }

    #[test]
    fn an_inventory_of_more_than_the_most_packages_is_refused() {
        let entry = json!({"name": "p", "version": "1", "installer": "pip"});
        let at_most = serde_json::to_string(&vec![entry.clone(); MAX_INVENTORY_ENTRIES]).unwrap();
        assert_eq!(parse_python_inventory(&at_most).unwrap().len(), MAX_INVENTORY_ENTRIES);
        let over = serde_json::to_string(&vec![entry; MAX_INVENTORY_ENTRIES + 1]).unwrap();
        let err = parse_python_inventory(&over).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the environment's Python inventory lists more than 20000 packages; a package step may have replaced its interpreter"
        );
        let lines = "p\t1.0\tCRAN\n".repeat(MAX_INVENTORY_ENTRIES + 1);
        assert_eq!(parse_r_inventory(&lines).unwrap_err(), InventoryTooLarge { language: "R" });
    }

    #[test]
    fn configured_mirrors_by_ip_literal_or_single_label_are_pinned() {
        let places = CondaPlaces {
            provisioner: Path::new("/p"),
            cache_dir: Path::new("/c"),
            read_only_caches: &[],
            offline: false,
            max_prefix_bytes: 0,
        };
        let channels: Vec<String> = [
            "http://127.0.0.1:8080/ch",
            "http://10.1.2.3/conda",
            "https://mirror/c",
            "https://conda.anaconda.org/conda-forge",
            "http://10.9.9.9/requested",
        ]
        .map(String::from)
        .to_vec();
        let mut step = conda(&places, Op::List, Path::new("/d/p"), &channels, &[], provision::Stage::Fetch);
        step = Step { hosts: hosts_of(channels.iter().map(String::as_str)), ..step };
        // The request's own 10.9.9.9 is not configured: never pinned, left to the allowlist.
        pin_configured(&mut step, &channels[..4]);
        assert_eq!(step.origins, ["http://10.1.2.3:80", "http://127.0.0.1:8080", "https://mirror:443"]);
        assert_eq!(step.hosts, ["10.9.9.9", "conda.anaconda.org"]);
        let mut cran = r_install(Path::new("/d/p"), false, "http://192.168.0.5:3838/cran", &["x".into()]);
        pin_configured(&mut cran, &["http://192.168.0.5:3838/cran".to_owned()]);
        assert_eq!(
            (cran.hosts.len(), cran.origins.as_slice()),
            (0, &["http://192.168.0.5:3838".to_owned()][..])
        );
    }
}
