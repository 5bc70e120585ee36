//! The solve: match specs against the channels' repodata with resolvo, strict channel
//! priority, installed packages favoured, and the host's virtual packages (`__unix`,
//! `__linux`, `__glibc`, `__archspec`) so that real conda-forge packages resolve.

use std::collections::HashSet;
use std::ffi::CStr;
use std::str::FromStr;
use std::time::Instant;

use rattler_conda_types::package::BuildString;
use rattler_conda_types::{
    GenericVirtualPackage, MatchSpec, PackageName, ParseStrictness, RepoDataRecord, Version,
};
use rattler_repodata_gateway::RepoData;
use rattler_solve::{ChannelPriority, SolveError, SolverImpl, SolverTask};

#[derive(Debug, thiserror::Error)]
pub enum SolveFailure {
    #[error("Package spec {0} is not a valid match spec")]
    InvalidSpec(String, #[source] rattler_conda_types::ParseMatchSpecError),
    /// The solver's own text is the part the operator needs.
    #[error("Could not solve for the requested packages: {0}")]
    Unsolvable(String),
}

/// Parses the request's specs (leniently, as conda's command line does).
pub fn parse_specs(specs: &[String]) -> Result<Vec<MatchSpec>, SolveFailure> {
    specs
        .iter()
        .map(|text| {
            MatchSpec::from_str(text, ParseStrictness::Lenient)
                .map_err(|err| SolveFailure::InvalidSpec(text.clone(), err))
        })
        .collect()
}

/// What one solve is asked.
#[derive(Debug)]
pub struct Task<'a> {
    pub repodata: &'a [RepoData],
    pub specs: Vec<MatchSpec>,
    /// Installed packages: kept where they still fit.
    pub favoured: Vec<&'a RepoDataRecord>,
    /// Names no candidate may have (a removal).
    pub excluded: &'a HashSet<PackageName>,
}

/// The records of the solution and the microseconds the solver took.
pub fn solve(task: Task<'_>) -> Result<(Vec<RepoDataRecord>, u64), SolveFailure> {
    let excluded = task.excluded;
    let available: Vec<Vec<&RepoDataRecord>> = task
        .repodata
        .iter()
        .map(|bucket| {
            bucket.iter().filter(|record| !excluded.contains(&record.package_record.name)).collect()
        })
        .collect();
    let solver_task = SolverTask {
        specs: task.specs,
        locked_packages: task.favoured,
        virtual_packages: virtual_packages(),
        channel_priority: ChannelPriority::Strict,
        ..SolverTask::from_iter(available)
    };
    let started = Instant::now();
    let result = rattler_solve::resolvo::Solver.solve(solver_task);
    let micros = started.elapsed().as_micros() as u64;
    match result {
        Ok(solution) => Ok((solution.records, micros)),
        Err(SolveError::Unsolvable(reasons)) => Err(SolveFailure::Unsolvable(reasons.join("\n"))),
        Err(other) => Err(SolveFailure::Unsolvable(other.to_string())),
    }
}

/// The virtual packages of this host, from `uname` and glibc.
fn virtual_packages() -> Vec<GenericVirtualPackage> {
    virtual_packages_for(&host_facts())
}

/// What the virtual packages are made from.
#[derive(Debug, Default)]
struct HostFacts {
    kernel_release: String,
    glibc: String,
    machine: String,
}

fn host_facts() -> HostFacts {
    // SAFETY: utsname is plain data; all-zero is a valid value for uname to fill in.
    let mut uts: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: uts is a valid, writable utsname.
    let uname_ok = common::sys::cvt(unsafe { libc::uname(&mut uts) }).is_ok();
    let field = |raw: &[libc::c_char]| {
        // SAFETY: uname NUL-terminates every field within its array.
        unsafe { CStr::from_ptr(raw.as_ptr()) }.to_string_lossy().into_owned()
    };
    // SAFETY: gnu_get_libc_version returns a pointer to a static NUL-terminated string.
    let glibc = unsafe { CStr::from_ptr(libc::gnu_get_libc_version()) }.to_string_lossy().into_owned();
    if !uname_ok {
        return HostFacts { glibc, ..HostFacts::default() };
    }
    HostFacts { kernel_release: field(&uts.release), glibc, machine: field(&uts.machine) }
}

/// `__unix`, `__linux=<kernel X.Y.Z>`, `__glibc=<X.Y>` and `__archspec=1=<machine>`; a fact
/// that does not parse as a version is left out rather than guessed.
fn virtual_packages_for(facts: &HostFacts) -> Vec<GenericVirtualPackage> {
    let make = |name: &str, version: &str, build: &str| {
        Some(GenericVirtualPackage {
            name: PackageName::new_unchecked(name),
            version: Version::from_str(version).ok()?,
            build_string: BuildString::new_unchecked(build),
        })
    };
    let kernel = leading_version(&facts.kernel_release);
    [
        make("__unix", "0", "0"),
        make("__linux", &kernel, "0"),
        make("__glibc", &leading_version(&facts.glibc), "0"),
        (!facts.machine.is_empty()).then(|| make("__archspec", "1", &facts.machine)).flatten(),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// `6.8.0-45-generic` → `6.8.0`: the dotted digits at the front.
fn leading_version(text: &str) -> String {
    let end = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    text[..end].trim_end_matches('.').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leading_version_table() {
        for (text, version) in
            [("6.8.0-45-generic", "6.8.0"), ("2.36", "2.36"), ("5.15.", "5.15"), ("", ""), ("x", "")]
        {
            assert_eq!(leading_version(text), version, "{text}");
        }
    }

    #[test]
    fn virtual_packages_table() {
        let facts = HostFacts {
            kernel_release: "6.1.0-13-amd64".into(),
            glibc: "2.36".into(),
            machine: "x86_64".into(),
        };
        let names: Vec<String> = virtual_packages_for(&facts).iter().map(|p| p.to_string()).collect();
        assert_eq!(names, ["__unix=0=0", "__linux=6.1.0=0", "__glibc=2.36=0", "__archspec=1=x86_64"]);
        let empty = virtual_packages_for(&HostFacts::default());
        assert_eq!(empty.len(), 1, "only __unix without facts");
    }

    #[test]
    fn specs() {
        assert_eq!(parse_specs(&["numpy>=1,<2".into(), "python=3.12".into()]).expect("ok").len(), 2);
        assert!(parse_specs(&["=".into()]).is_err());
    }
}
