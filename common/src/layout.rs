//! The data directory's layout: the names runnerd and npu-brokerd (and the original runner,
//! whose on-disk format this is: `original-runner-internals.md`,
//! `original-versioning-format.md`) use
//! under `SCIENCE_AGENT_DATA_DIR`. One place, so a daemon never retypes a name another one
//! creates: a misspelt root would make npu-brokerd refuse every workspace, or confine itself
//! away from them, without any test of the other daemon noticing.
//!
//! Only names live here, never paths: each daemon joins them onto its own configured
//! directory, and the names themselves must stay byte for byte the original's.

use std::path::{Path, PathBuf};

/// `<data>/projects/<project>/sessions/<session>/workspace`: the workspaces of
/// `runnerWorkspaceRoot`.
pub const PROJECTS: &str = "projects";
/// `<data>/remote-workspaces/<key>`: the workspaces of `runnerWorkspaceKey`.
pub const REMOTE_WORKSPACES: &str = "remote-workspaces";
/// The two directories a workspace may lie in (strictly below one of them).
pub const WORKSPACE_ROOTS: [&str; 2] = [PROJECTS, REMOTE_WORKSPACES];
/// `<data>/projects/.skill-packages/`: the published skill packages (runnerd's skill store).
/// Never a workspace nor part of one: mounted writable, a package could be rewritten.
pub const SKILL_PACKAGES: &str = ".skill-packages";

/// `<parent of a workspace>/.workspace-coordination/<sha256>.sqlite`: the lease files that
/// serialise writers of one workspace across processes. Never part of a
/// snapshot, never reachable through the file routes.
pub const COORDINATION_DIR: &str = ".workspace-coordination";
/// `<data>/.workspace-lifecycle/`: the registry of workspace roots and their fences.
pub const LIFECYCLE_DIR: &str = ".workspace-lifecycle";
/// The lifecycle registry's database, in [`LIFECYCLE_DIR`].
pub const LIFECYCLE_REGISTRY: &str = "registry.sqlite";

/// `<data>/versioning/`: the content-addressed store (two OCI-layout pools) and its refs.
pub const VERSIONING: &str = "versioning";
/// The refs database, in [`VERSIONING`].
pub const REFS_DB: &str = "refs.sqlite";

/// `<data>/runner-executions/`: the managed executions' records ([`EXECUTIONS_DB`]) and the
/// lease journal ([`LEASE_JOURNAL`]).
pub const RUNNER_EXECUTIONS: &str = "runner-executions";
/// The managed executions' database, in [`RUNNER_EXECUTIONS`].
pub const EXECUTIONS_DB: &str = "executions.sqlite";
/// `<data>/runner-executions/active-leases/<sha256>`: runnerd's own journal of held leases.
pub const LEASE_JOURNAL: &str = "active-leases";

/// `<data>/runner-runtime/`: what runnerd publishes at start-up (the seccomp programs) and
/// its scratch space.
pub const RUNTIME: &str = "runner-runtime";
/// `<data>/runner-runtime/accel-probe/`: the throwaway workspaces of accelerator probes.
pub const ACCEL_PROBE: &str = "accel-probe";
/// `<data>/runner-runtime/provision/`: the empty workspaces of provisioning sandboxes.
pub const PROVISION_SCRATCH: &str = "provision";

/// `<data>/python-packages/<pyX.Y | py3 | .>`: packages mounted into every sandbox.
pub const PYTHON_PACKAGES: &str = "python-packages";

/// `<data>/scientific-envs/`: the managed scientific environments.
pub const SCIENTIFIC_ENVS: &str = "scientific-envs";
/// `<data>/scientific-envs/revisions/<env>/<revision>/`: one environment revision's prefix.
pub const ENV_REVISIONS: &str = "revisions";
/// `<data>/scientific-envs/catalog.json`: the environments and their revision records.
pub const ENV_CATALOG: &str = "catalog.json";
/// `<data>/scientific-envs/snapshots/<revision>.json`: one write-once snapshot per revision.
pub const ENV_SNAPSHOTS: &str = "snapshots";
/// `<data>/scientific-envs/wheels/<sha256>/<file>.whl`: local wheels, persisted by content.
pub const ENV_WHEELS: &str = "wheels";
/// `<data>/scientific-envs/provisioner/`: runner-provisioner's cache, `pkgs/` (extracted
/// packages, copied into prefixes) and `repodata/`, as the original's micromamba root
/// (`MAMBA_ROOT_PREFIX`) kept `provisioner/pkgs/`.
pub const ENV_PACKAGE_CACHE: &str = "provisioner";

/// `<state>/npu-jobs/jobs.json`: the NPU broker's job records (the original kept them in its
/// data directory; npu-brokerd keeps them in its own state directory, with the same names).
pub const NPU_JOBS_DIR: &str = "npu-jobs";
/// The job records' file, in [`NPU_JOBS_DIR`].
pub const NPU_JOBS_FILE: &str = "jobs.json";

/// `<data>/projects` and `<data>/remote-workspaces`, in that order.
pub fn workspace_roots(data_dir: &Path) -> [PathBuf; 2] {
    WORKSPACE_ROOTS.map(|name| data_dir.join(name))
}

/// `<data>/scientific-envs/revisions`.
pub fn env_revisions(data_dir: &Path) -> PathBuf {
    data_dir.join(SCIENTIFIC_ENVS).join(ENV_REVISIONS)
}

/// `<state>/npu-jobs/jobs.json`.
pub fn npu_jobs_file(state_dir: &Path) -> PathBuf {
    state_dir.join(NPU_JOBS_DIR).join(NPU_JOBS_FILE)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names are the original's on-disk format: a rename here is a migration, not a
    /// refactoring, so the table spells each one out.
    #[test]
    fn names_are_the_originals() {
        let data = Path::new("/d");
        let envs = data.join(SCIENTIFIC_ENVS);
        let cases: [(PathBuf, &str); 17] = [
            (workspace_roots(data)[0].clone(), "/d/projects"),
            (workspace_roots(data)[1].clone(), "/d/remote-workspaces"),
            (data.join(PROJECTS).join(SKILL_PACKAGES), "/d/projects/.skill-packages"),
            (data.join(COORDINATION_DIR), "/d/.workspace-coordination"),
            (data.join(LIFECYCLE_DIR).join(LIFECYCLE_REGISTRY), "/d/.workspace-lifecycle/registry.sqlite"),
            (data.join(VERSIONING).join(REFS_DB), "/d/versioning/refs.sqlite"),
            (data.join(RUNTIME), "/d/runner-runtime"),
            (data.join(RUNTIME).join(ACCEL_PROBE), "/d/runner-runtime/accel-probe"),
            (data.join(PYTHON_PACKAGES), "/d/python-packages"),
            (env_revisions(data), "/d/scientific-envs/revisions"),
            (envs.join(ENV_CATALOG), "/d/scientific-envs/catalog.json"),
            (envs.join(ENV_SNAPSHOTS), "/d/scientific-envs/snapshots"),
            (envs.join(ENV_WHEELS), "/d/scientific-envs/wheels"),
            (envs.join(ENV_PACKAGE_CACHE), "/d/scientific-envs/provisioner"),
            (npu_jobs_file(data), "/d/npu-jobs/jobs.json"),
            (data.join(RUNNER_EXECUTIONS).join(EXECUTIONS_DB), "/d/runner-executions/executions.sqlite"),
            (data.join(RUNNER_EXECUTIONS).join(LEASE_JOURNAL), "/d/runner-executions/active-leases"),
        ];
        for (got, want) in cases {
            assert_eq!(got, Path::new(want));
        }
    }
}
