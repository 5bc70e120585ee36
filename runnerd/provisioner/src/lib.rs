//! `runner-provisioner`: the conda solver and installer (the rattler crates) that runnerd runs
//! inside one of its sandboxes, so that neither a hostile archive nor a crash in this code
//! reaches runnerd, and runnerd never links it.
//!
//! Protocol ([`common::provision`]): one JSON `Request` on stdin (at most `MAX_REQUEST_BYTES`),
//! one JSON `Response` on stdout, one short progress line per step on stderr. Exit status 0 on
//! success, 1 when the step failed (`error` says why), 2 when the request could not be read.
//!
//! Layout under the request's `cacheDir`: `pkgs/` (extracted packages, hard-linked into the
//! prefixes) and `repodata/` (the gateway's repodata cache).
//!
//! Nothing here needs `/proc`, writes outside the prefix, the cache and `/tmp`, or opens a
//! socket unless a remote channel is actually read (see [`network`]).

mod channels;
mod history;
mod install;
mod inventory;
mod links;
mod network;
mod request;
mod solve;

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use common::provision::{Op, Operation, Request, Response};
use rattler::package_cache::PackageCache;
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
    #[error(transparent)]
    Links(#[from] links::LinkError),
    #[error("Package is not installed: {0}")]
    NotInstalled(String),
    #[error("Source prefix {0} has no conda packages to clone")]
    EmptySource(String),
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
}

/// The binary: read, do, answer.
pub fn run() -> ExitCode {
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
    let code = match result {
        Ok(outcome) => {
            response.operations = outcome.operations;
            response.solve_micros = outcome.solve_micros;
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
    // signal pipe: a socketpair) only when a remote channel may be read. Offline, or with
    // `file://` channels only, the step runs under the baseline seccomp profile, which
    // refuses every socket: nothing here may need one.
    if !request.offline && request.channels.iter().any(|c| !c.starts_with("file://")) {
        builder.enable_io();
    }
    let runtime = builder.build().map_err(Failure::Runtime)?;
    runtime.block_on(step(request))
}

/// The shared pieces of one step.
#[allow(missing_debug_implementations)] // rattler's PackageCache has no Debug
struct Context<'a> {
    request: &'a Request,
    network: Network,
    cache: PackageCache,
}

async fn step(request: &Request) -> Result<Outcome, Failure> {
    let network = if request.offline { Network::Offline } else { Network::Online };
    let cache = PackageCache::new(request.cache_dir.join("pkgs"));
    let context = Context { request, network, cache };
    match &request.op {
        Op::Create { specs } => create(&context, specs).await,
        Op::Clone { source } => clone(&context, source).await,
        Op::Install { specs } => install_specs(&context, specs).await,
        Op::Remove { names } => remove(&context, names).await,
        Op::List => Ok(Outcome::default()),
    }
}

async fn create(context: &Context<'_>, specs: &[String]) -> Result<Outcome, Failure> {
    install::require_new_prefix(&context.request.prefix)?;
    let requested = solve::parse_specs(specs)?;
    let excluded = HashSet::new();
    let (desired, solve_micros) = query_and_solve(context, requested.clone(), Vec::new(), &excluded).await?;
    let operations = apply(context, Vec::new(), desired, requested).await?;
    record(context, "create", &operations, history::Specs::Update(specs.to_vec()))?;
    Ok(Outcome { operations, solve_micros })
}

async fn clone(context: &Context<'_>, source: &Path) -> Result<Outcome, Failure> {
    install::require_new_prefix(&context.request.prefix)?;
    eprintln!("runner-provisioner: reading {}", source.display());
    let records = inventory::installed(source)?;
    if records.is_empty() {
        return Err(Failure::EmptySource(source.display().to_string()));
    }
    links::check_records(source, &records)?;
    links::check_origins(&records, &context.request.channels)?;
    let specs: Vec<String> = earlier_specs(source, &records)?.into_values().collect();
    let requested = solve::parse_specs(&specs)?;
    let desired: Vec<RepoDataRecord> = records.into_iter().map(|r| r.repodata_record).collect();
    let operations = apply(context, Vec::new(), desired, requested).await?;
    record(context, "clone", &operations, history::Specs::Update(specs))?;
    Ok(Outcome { operations, solve_micros: 0 })
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
    let (desired, solve_micros) = query_and_solve(context, requested.clone(), favoured, &excluded).await?;
    let operations = apply(context, installed, desired, requested).await?;
    record(context, "install", &operations, history::Specs::Update(specs.to_vec()))?;
    Ok(Outcome { operations, solve_micros })
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
    let (desired, solve_micros) = if solve_specs.is_empty() {
        (Vec::new(), 0)
    } else {
        query_and_solve(context, solve_specs, favoured, &excluded).await?
    };
    let operations = apply(context, installed, desired, requested).await?;
    let mut removed: Vec<String> = removed.into_iter().collect();
    removed.sort();
    record(context, "remove", &operations, history::Specs::Remove(removed))?;
    Ok(Outcome { operations, solve_micros })
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

async fn query_and_solve(
    context: &Context<'_>,
    specs: Vec<MatchSpec>,
    favoured: Vec<RepoDataRecord>,
    excluded: &HashSet<PackageName>,
) -> Result<(Vec<RepoDataRecord>, u64), Failure> {
    let sources = channels::parse(&context.request.channels)?;
    let gateway = channels::gateway(
        &context.request.cache_dir.join("repodata"),
        context.cache.clone(),
        context.network,
    );
    eprintln!("runner-provisioner: reading {} channel(s)", sources.len());
    let mut query_specs = specs.clone();
    query_specs.extend(favoured.iter().map(|r| MatchSpec::from(r.package_record.name.clone())));
    let repodata = channels::query(&gateway, &sources, query_specs).await?;
    eprintln!("runner-provisioner: solving {} spec(s)", specs.len());
    let task = solve::Task { repodata: &repodata, specs, favoured: favoured.iter().collect(), excluded };
    Ok(solve::solve(task)?)
}

async fn apply(
    context: &Context<'_>,
    installed: Vec<PrefixRecord>,
    desired: Vec<RepoDataRecord>,
    requested: Vec<MatchSpec>,
) -> Result<Vec<Operation>, Failure> {
    eprintln!("runner-provisioner: linking {} package(s)", desired.len());
    let plan = install::Plan {
        prefix: &context.request.prefix,
        installed,
        desired,
        requested,
        cache: &context.cache,
        network: context.network,
    };
    Ok(install::apply(plan).await?)
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

    #[test]
    fn chain_joins_causes_once() {
        let err = Outer(std::io::Error::other("inner"));
        assert_eq!(error_chain(&err), "outer: inner");
    }
}
