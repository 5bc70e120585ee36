//! `runner-provisioner`: the conda solver and installer (the rattler crates) that runnerd runs
//! inside one of its sandboxes, so that neither a hostile archive nor a crash in this code
//! reaches runnerd, and runnerd never links it.
//!
//! Protocol ([`common::provision`]): one JSON `Request` on stdin (at most `MAX_REQUEST_BYTES`),
//! one JSON `Response` on stdout, one short progress line per step on stderr. Exit status 0 on
//! success, 1 when the step failed (`error` says why), 2 when the request could not be read.
//!
//! Layout under the request's `cacheDir`: `pkgs/` (extracted packages, copied or reflinked
//! into the prefixes) and `repodata/` (the gateway's repodata cache). `readOnlyCaches` are
//! searched after `pkgs/` and never written.
//!
//! Every change runs twice, as two steps ([`Stage`]): `fetch` solves and fills the cache
//! with the prefix read-only; `link` is given that solution and links it with the caches
//! read-only. runnerd's sandbox makes each read-only; this binary relies on neither.
//!
//! Nothing here needs `/proc`, writes outside the prefix, the cache and `/tmp`, or opens a
//! socket unless a remote channel is actually read in a fetch step (see [`network`]).

mod channels;
mod history;
mod install;
mod inventory;
mod links;
mod network;
mod packages;
mod request;
mod solve;

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use common::provision::{Op, Operation, Request, Response, Stage};
use rattler::package_cache::PackageCache;
use rattler_cache::validation::ValidationMode;
use rattler_conda_types::{MatchSpec, PackageName, PrefixRecord, RepoDataRecord};

use crate::network::Network;

/// Every way a step fails; the message is the operator's line.
#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error(transparent)]
    Channel(#[from] channels::ChannelError),
    #[error(transparent)]
    Solve(#[from] solve::SolveFailure),
    #[error(transparent)]
    Install(#[from] install::InstallFailure),
    #[error(transparent)]
    Inventory(#[from] inventory::InventoryError),
    #[error(transparent)]
    History(#[from] history::HistoryError),
    /// Found before anything was written.
    #[error("{0}{remedy}", remedy = .0.unchanged_remedy())]
    Links(#[from] links::LinkError),
    /// Found once a pip or R step had written the prefix.
    #[error("{0}. A pip or R step left it there: delete the environment and create it again")]
    LeftByStep(#[source] links::LinkError),
    #[error("Package is not installed: {0}")]
    NotInstalled(String),
    #[error(
        "Package {package} is no longer served by {channel}, and the package cache does not hold it: it cannot be copied"
    )]
    NoLongerServed { package: String, channel: String },
    #[error("Source prefix {0} has no conda packages to clone")]
    EmptySource(String),
    #[error(
        "The solution is {0} bytes, more than the {max} a link step takes: install fewer packages at once",
        max = common::provision::MAX_SOLUTION_BYTES
    )]
    SolutionTooLarge(usize),
    #[error("the link step's solution is not the fetch step's")]
    Solution(#[source] serde_json::Error),
    #[error("the link step's scratch cache {0} could not be made")]
    Scratch(String, #[source] std::io::Error),
    #[error("the async runtime could not be started")]
    Runtime(#[source] std::io::Error),
    /// A bug in this binary or in rattler; still answered as a Response.
    #[error("the provisioner failed unexpectedly: {0}")]
    Panicked(String),
}

/// What a step did, before the inventory is added.
#[derive(Debug, Default)]
struct Outcome {
    operations: Vec<Operation>,
    solve_micros: u64,
    /// A fetch step's solution, for the link step.
    solution: Option<String>,
}

/// The binary: read, do, answer.
pub fn run() -> ExitCode {
    // A write past the step's RLIMIT_FSIZE then fails with EFBIG (an error the answer names)
    // instead of killing the step with no answer at all.
    // SAFETY: signal(2) with SIG_IGN installs no handler; nothing else is running yet.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    let request = match request::read(std::io::stdin().lock()) {
        Ok(request) => request,
        Err(err) => {
            let text = error_chain(&err);
            eprintln!("runner-provisioner: {text}");
            respond(Response { error: Some(text), ..Response::default() });
            return ExitCode::from(2);
        }
    };
    let result = std::panic::catch_unwind(|| execute(&request))
        .unwrap_or_else(|panic| Err(Failure::Panicked(panic_text(&panic))));
    let mut response = Response::default();
    // A prefix the link check refused holds what a hostile step planted (a FIFO where the
    // records are read would hang the inventory): it is not read again.
    let readable = !matches!(result, Err(Failure::Links(_) | Failure::LeftByStep(_)));
    let code = match result {
        Ok(outcome) => {
            response.operations = outcome.operations;
            response.solve_micros = outcome.solve_micros;
            response.solution = outcome.solution;
            ExitCode::SUCCESS
        }
        Err(err) => {
            let text = error_chain(&err);
            eprintln!("runner-provisioner: {text}");
            response.error = Some(text);
            ExitCode::from(1)
        }
    };
    // Whatever happened, report what the prefix holds now.
    if !readable {
        response.peak_rss_kib = peak_rss_kib();
        respond(response);
        return code;
    }
    match inventory::installed(&request.prefix) {
        Ok(records) => response.installed = inventory::packages(&records),
        Err(err) if response.error.is_none() => {
            response.error = Some(error_chain(&err));
            respond(Response { peak_rss_kib: peak_rss_kib(), ..response });
            return ExitCode::from(1);
        }
        Err(_) => {}
    }
    response.peak_rss_kib = peak_rss_kib();
    respond(response);
    code
}

fn respond(response: Response) {
    let mut out = std::io::stdout().lock();
    // A runnerd that stopped reading has nothing left to tell; the exit status still does.
    let _ = serde_json::to_writer(&mut out, &response).map(|()| out.write_all(b"\n"));
    let _ = out.flush();
}

fn execute(request: &Request) -> Result<Outcome, Failure> {
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_time();
    // The I/O driver (and, with tokio's `signal` feature, which the workspace turns on, its
    // signal pipe: a socketpair) only when a remote channel may be read. Offline, with
    // `file://` channels only, or linking, the step runs under the baseline seccomp profile,
    // which refuses every socket: nothing here may need one.
    if network(request) == Network::Online {
        builder.enable_io();
    }
    let runtime = builder.build().map_err(Failure::Runtime)?;
    runtime.block_on(step(request))
}

/// Whether this step may open connections: a fetch step, not offline, with a remote channel.
fn network(request: &Request) -> Network {
    let remote = request.channels.iter().any(|c| !c.starts_with("file://"));
    match (&request.stage, request.offline, remote) {
        (Stage::Fetch, false, true) => Network::Online,
        _ => Network::Offline,
    }
}

/// The shared pieces of one step.
#[allow(missing_debug_implementations)] // rattler's PackageCache has no Debug
struct Context<'a> {
    request: &'a Request,
    network: Network,
    cache: PackageCache,
}

async fn step(request: &Request) -> Result<Outcome, Failure> {
    // A link step's cache lock (rattler takes one in the first writable layer, even to
    // read) goes into a scratch layer of its own: the shared caches are read-only then.
    let scratch = match request.stage {
        Stage::Link { .. } => Some(Scratch::make()?),
        Stage::Fetch => None,
    };
    let mut layers = vec![request.cache_dir.join("pkgs")];
    for dir in &request.read_only_caches {
        // conda's `pkgs_dirs` layout (a package per directory), or ours (`pkgs/` inside).
        layers.extend([dir.clone(), dir.join("pkgs")]);
    }
    if scratch.is_some() {
        // rattler takes a layer it cannot stat for a writable one; a missing layer holds
        // nothing to link anyway.
        layers.retain(|layer| layer.is_dir());
    }
    layers.extend(scratch.as_ref().map(|s| s.0.clone()));
    let cache = PackageCache::new_layered(layers, false, ValidationMode::default());
    let context = Context { request, network: network(request), cache };
    match &request.op {
        Op::Create { specs } => create(&context, specs).await,
        Op::Clone { source } => clone(&context, source).await,
        Op::Install { specs } => install_specs(&context, specs).await,
        Op::Remove { names } => remove(&context, names).await,
        // What a pip or R step left is read next (the records): nothing there may hang it.
        Op::List => {
            links::check_readable(&request.prefix).map(|()| Outcome::default()).map_err(Failure::LeftByStep)
        }
    }
}

/// A link step's own empty cache layer under `/tmp`, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn make() -> Result<Scratch, Failure> {
        let dir = std::env::temp_dir().join(format!("runner-provisioner-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| Failure::Scratch(dir.display().to_string(), e))?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn create(context: &Context<'_>, specs: &[String]) -> Result<Outcome, Failure> {
    install::require_new_prefix(&context.request.prefix)?;
    let requested = solve::parse_specs(specs)?;
    let excluded = HashSet::new();
    let (desired, solve_micros) = solved(context, requested.clone(), Vec::new(), &excluded).await?;
    let change = Change { op: "create", installed: Vec::new(), desired, requested, solve_micros };
    finish(context, change, history::Specs::Update(specs.to_vec())).await
}

async fn clone(context: &Context<'_>, source: &Path) -> Result<Outcome, Failure> {
    install::require_new_prefix(&context.request.prefix)?;
    eprintln!("runner-provisioner: reading {}", source.display());
    links::check(source)?;
    let records = inventory::installed(source)?;
    if records.is_empty() {
        return Err(Failure::EmptySource(source.display().to_string()));
    }
    links::check_records(source, &records)?;
    links::check_origins(records.iter().map(|r| &r.repodata_record), &context.request.channels)?;
    let specs: Vec<String> = earlier_specs(source, &records)?.into_values().collect();
    let requested = solve::parse_specs(&specs)?;
    let desired = match &context.request.stage {
        Stage::Fetch => from_channels(context, &records).await?,
        Stage::Link { solution } => parse_solution(solution)?,
    };
    let change = Change { op: "clone", installed: Vec::new(), desired, requested, solve_micros: 0 };
    finish(context, change, history::Specs::Update(specs)).await
}

async fn install_specs(context: &Context<'_>, specs: &[String]) -> Result<Outcome, Failure> {
    solve::parse_specs(specs)?;
    let prefix = &context.request.prefix;
    links::check(prefix)?;
    let installed = inventory::installed(prefix)?;
    links::check_records(prefix, &installed)?;
    let mut wanted = earlier_specs(prefix, &installed)?;
    for spec in specs {
        wanted.insert(history::spec_name(spec).to_string(), spec.clone());
    }
    let all: Vec<String> = wanted.into_values().collect();
    let requested = solve::parse_specs(&all)?;
    let excluded = HashSet::new();
    let favoured: Vec<RepoDataRecord> = installed.iter().map(|r| r.repodata_record.clone()).collect();
    let (desired, solve_micros) = solved(context, requested.clone(), favoured, &excluded).await?;
    let change = Change { op: "install", installed, desired, requested, solve_micros };
    finish(context, change, history::Specs::Update(specs.to_vec())).await
}

async fn remove(context: &Context<'_>, names: &[String]) -> Result<Outcome, Failure> {
    let prefix = &context.request.prefix;
    links::check(prefix)?;
    let installed = inventory::installed(prefix)?;
    links::check_records(prefix, &installed)?;
    let installed_names: HashSet<&str> =
        installed.iter().map(|r| r.repodata_record.package_record.name.as_normalized()).collect();
    if let Some(missing) = names.iter().find(|n| !installed_names.contains(n.to_lowercase().as_str())) {
        return Err(Failure::NotInstalled(missing.clone()));
    }
    let removed = dependents_closure(&installed, names);
    let mut wanted = earlier_specs(prefix, &installed)?;
    wanted.retain(|name, _| !removed.contains(name));
    let kept: Vec<String> = wanted.values().cloned().collect();
    let requested = solve::parse_specs(&kept)?;
    // What stays installed stays (conda's remove does not prune): unrequested packages are
    // asked for by name, and favoured at their installed version.
    let mut solve_specs = requested.clone();
    for record in &installed {
        let name = record.repodata_record.package_record.name.as_normalized();
        if !removed.contains(name) && !wanted.contains_key(name) {
            solve_specs.push(MatchSpec::from(record.repodata_record.package_record.name.clone()));
        }
    }
    let excluded: HashSet<PackageName> =
        removed.iter().map(|n| PackageName::new_unchecked(n.as_str())).collect();
    let favoured: Vec<RepoDataRecord> = installed
        .iter()
        .filter(|r| !removed.contains(r.repodata_record.package_record.name.as_normalized()))
        .map(|r| r.repodata_record.clone())
        .collect();
    let (desired, solve_micros) = match (&context.request.stage, solve_specs.is_empty()) {
        (Stage::Fetch, true) => (Vec::new(), 0),
        _ => solved(context, solve_specs, favoured, &excluded).await?,
    };
    let mut removed: Vec<String> = removed.into_iter().collect();
    removed.sort();
    let change = Change { op: "remove", installed, desired, requested, solve_micros };
    finish(context, change, history::Specs::Remove(removed)).await
}

/// The channels' own records for what a source prefix holds, matched by channel, subdir and
/// file name: the source's `conda-meta` may have been written by a hostile step, so its
/// records only say *which* package to copy; the URL, hash and name-version-build (the cache
/// key every environment shares) come from the channel's index. A package no channel of the
/// request serves any more is refused.
async fn from_channels(
    context: &Context<'_>,
    records: &[PrefixRecord],
) -> Result<Vec<RepoDataRecord>, Failure> {
    let specs: Vec<MatchSpec> =
        records.iter().map(|r| MatchSpec::from(r.repodata_record.package_record.name.clone())).collect();
    let sources = channels::parse(&context.request.channels)?;
    let gateway = gateway(context);
    let repodata = channels::query(&gateway, &sources, specs).await?;
    let key = |channel: Option<&str>, subdir: &str, file: String| {
        (channel.unwrap_or("").trim_end_matches('/').to_owned(), subdir.to_owned(), file)
    };
    let served: std::collections::HashMap<_, &RepoDataRecord> = repodata
        .iter()
        .flat_map(|r| r.iter())
        .map(|r| (key(r.channel.as_deref(), &r.package_record.subdir, r.identifier.to_string()), r))
        .collect();
    let mut out = Vec::with_capacity(records.len());
    for record in records {
        let wanted = &record.repodata_record;
        let at = key(wanted.channel.as_deref(), &wanted.package_record.subdir, wanted.identifier.to_string());
        if let Some(found) = served.get(&at) {
            out.push((*found).clone());
            continue;
        }
        // No longer listed (moved to a `broken` label, or stale repodata offline): copied
        // only when the caches already hold that build with the recorded hash. Nothing is
        // then fetched, so the source's record cannot bring bytes into the cache.
        if !links::served_by(&wanted.url, &context.request.channels) {
            return Err(Failure::Links(links::LinkError::Foreign {
                package: wanted.package_record.name.as_normalized().to_owned(),
                url: wanted.url.to_string(),
            }));
        }
        let package = &wanted.package_record;
        if package.sha256.is_none() || install::cached(wanted, &context.cache).await.is_err() {
            return Err(Failure::NoLongerServed {
                package: format!("{}-{}-{}", package.name.as_normalized(), package.version, package.build),
                channel: wanted.channel.clone().unwrap_or_default(),
            });
        }
        out.push(wanted.clone());
    }
    Ok(out)
}

/// One change, solved: what the prefix holds and what it is to hold.
#[derive(Debug)]
struct Change {
    /// conda's history name for it.
    op: &'static str,
    installed: Vec<PrefixRecord>,
    desired: Vec<RepoDataRecord>,
    /// Recorded in each linked package's `requested_spec(s)`.
    requested: Vec<MatchSpec>,
    solve_micros: u64,
}

/// The stage's half of a change: a fetch step fills the cache and answers the solution; a
/// link step links it and appends the history.
async fn finish(context: &Context<'_>, change: Change, specs: history::Specs) -> Result<Outcome, Failure> {
    let plan = install::Plan {
        prefix: &context.request.prefix,
        installed: change.installed,
        desired: change.desired,
        requested: change.requested,
        cache: &context.cache,
        network: context.network,
        channels: &context.request.channels,
        max_bytes: context.request.max_prefix_bytes,
    };
    match context.request.stage {
        Stage::Fetch => {
            eprintln!("runner-provisioner: fetching for {} package(s)", plan.desired.len());
            install::fetch(&plan).await?;
            // Serialising records rattler itself read cannot fail.
            let solution = serde_json::to_string(&plan.desired).unwrap_or_default();
            if solution.len() > common::provision::MAX_SOLUTION_BYTES {
                return Err(Failure::SolutionTooLarge(solution.len()));
            }
            Ok(Outcome {
                operations: Vec::new(),
                solve_micros: change.solve_micros,
                solution: Some(solution),
            })
        }
        Stage::Link { .. } => {
            eprintln!("runner-provisioner: linking {} package(s)", plan.desired.len());
            let operations = install::link(plan).await?;
            record(context, change.op, &operations, specs)?;
            Ok(Outcome { operations, solve_micros: 0, solution: None })
        }
    }
}

/// The records to install: solved in a fetch step; in a link step, the fetch step's
/// solution as given (the prefix has not changed in between: runnerd holds the
/// environment's write gate across both).
async fn solved(
    context: &Context<'_>,
    specs: Vec<MatchSpec>,
    favoured: Vec<RepoDataRecord>,
    excluded: &HashSet<PackageName>,
) -> Result<(Vec<RepoDataRecord>, u64), Failure> {
    match &context.request.stage {
        Stage::Fetch => query_and_solve(context, specs, favoured, excluded).await,
        Stage::Link { solution } => Ok((parse_solution(solution)?, 0)),
    }
}

fn parse_solution(solution: &str) -> Result<Vec<RepoDataRecord>, Failure> {
    serde_json::from_str(solution).map_err(Failure::Solution)
}

/// `names` and every installed package that depends on one of them, transitively: removing
/// a library removes what needs it, as conda does.
fn dependents_closure(installed: &[PrefixRecord], names: &[String]) -> HashSet<String> {
    let mut removed: HashSet<String> = names.iter().map(|n| n.to_lowercase()).collect();
    loop {
        let before = removed.len();
        for record in installed {
            let package = &record.repodata_record.package_record;
            if package.depends.iter().any(|dep| removed.contains(history::spec_name(dep))) {
                removed.insert(package.name.as_normalized().to_string());
            }
        }
        if removed.len() == before {
            return removed;
        }
    }
}

/// The specs the prefix was asked for before, by name: its history's, else the records'.
fn earlier_specs(prefix: &Path, installed: &[PrefixRecord]) -> Result<BTreeMap<String, String>, Failure> {
    let mut specs = history::requested_specs(&history::read(prefix)?);
    for record in installed {
        let name = record.repodata_record.package_record.name.as_normalized();
        if let Some(spec) = record.requested_specs.first() {
            specs.entry(name.to_string()).or_insert_with(|| spec.clone());
        }
    }
    Ok(specs)
}

/// The step's repodata gateway over `cacheDir/repodata/`. Offline, what the operator's
/// caches hold in a `repodata/` of their own (the layout runnerd's earlier releases read
/// there) is copied in first where the store's cache lacks it: the operator's caches are
/// never written, and offline the gateway reads only its own cache.
fn gateway(context: &Context<'_>) -> rattler_repodata_gateway::Gateway {
    let own = context.request.cache_dir.join("repodata");
    if context.request.offline && context.request.stage == Stage::Fetch {
        for dir in &context.request.read_only_caches {
            if let Err(err) = channels::seed_repodata(&own, &dir.join("repodata")) {
                eprintln!("runner-provisioner: the repodata in {} could not be used: {err}", dir.display());
            }
        }
    }
    channels::gateway(&own, context.cache.clone(), context.network)
}

async fn query_and_solve(
    context: &Context<'_>,
    specs: Vec<MatchSpec>,
    favoured: Vec<RepoDataRecord>,
    excluded: &HashSet<PackageName>,
) -> Result<(Vec<RepoDataRecord>, u64), Failure> {
    let sources = channels::parse(&context.request.channels)?;
    let gateway = gateway(context);
    eprintln!("runner-provisioner: reading {} channel(s)", sources.len());
    let mut query_specs = specs.clone();
    query_specs.extend(favoured.iter().map(|r| MatchSpec::from(r.package_record.name.clone())));
    let repodata = channels::query(&gateway, &sources, query_specs).await?;
    eprintln!("runner-provisioner: solving {} spec(s)", specs.len());
    let task = solve::Task { repodata: &repodata, specs, favoured: favoured.iter().collect(), excluded };
    Ok(solve::solve(task)?)
}

/// Appends the step to `conda-meta/history` when it changed anything.
fn record(
    context: &Context<'_>,
    op: &str,
    operations: &[Operation],
    specs: history::Specs,
) -> Result<(), Failure> {
    if operations.is_empty() {
        return Ok(());
    }
    let mut entry = history::Entry {
        unix_secs: history::now_secs(),
        op: op.to_string(),
        removed: Vec::new(),
        added: Vec::new(),
        specs,
    };
    for operation in operations {
        use common::provision::Change;
        let name = inventory::history_name(&operation.package);
        match operation.change {
            Change::Install => entry.added.push(name),
            Change::Remove => entry.removed.push(name),
            Change::Change | Change::Reinstall => {
                if let Some(previous) = &operation.previous {
                    entry.removed.push(inventory::history_name(previous));
                }
                entry.added.push(name);
            }
        }
    }
    Ok(history::append(&context.request.prefix, &entry)?)
}

/// Every message of an error's chain, joined: the operator sees the causes once each.
pub(crate) fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut next = err.source();
    while let Some(cause) = next {
        let message = cause.to_string();
        if !text.contains(&message) {
            // Some rattler messages end in a full stop; the chain reads as one sentence.
            text.truncate(text.trim_end_matches('.').len());
            text.push_str(": ");
            text.push_str(&message);
        }
        next = cause.source();
    }
    text
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "the provisioner panicked".to_string())
}

/// `getrusage(RUSAGE_SELF).ru_maxrss` (KiB on Linux); 0 if the call fails.
fn peak_rss_kib() -> u64 {
    // SAFETY: rusage is plain data; all-zero is a valid value for getrusage to fill in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: usage is a valid, writable rusage.
    match common::sys::cvt(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) }) {
        Ok(_) => u64::try_from(usage.ru_maxrss).unwrap_or(0),
        Err(_) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer.")]
    struct Outer(#[source] std::io::Error);

    /// Whether anything was changed is said only where it is true.
    #[test]
    fn a_damaged_prefix_is_reported_with_what_was_changed() {
        let escapes =
            || links::LinkError::Escapes { prefix: "/p".into(), link: "l".into(), target: "/etc".into() };
        let before = error_chain(&Failure::Links(escapes()));
        assert!(
            before.ends_with(
                "a package step put it there. Nothing was changed: delete the environment and create it again"
            ),
            "{before}"
        );
        let after = error_chain(&Failure::Install(install::InstallFailure::Linked(escapes())));
        assert!(
            after.contains("The packages were linked before it was found")
                && !after.contains("Nothing was changed"),
            "{after}"
        );
        let pip = error_chain(&Failure::LeftByStep(escapes()));
        assert!(
            pip.contains("A pip or R step left it there") && !pip.contains("Nothing was changed"),
            "{pip}"
        );
        let foreign = links::LinkError::Foreign { package: "x".into(), url: "file:///elsewhere".into() };
        assert!(error_chain(&Failure::Links(foreign)).ends_with("it is not installed"));
    }

    #[test]
    fn chain_joins_causes_once() {
        let err = Outer(std::io::Error::other("inner"));
        assert_eq!(error_chain(&err), "outer: inner");
    }
}
