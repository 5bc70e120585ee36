//! The engine's error codes: the stable machine-readable name of every failure an
//! [`EngineError`](crate::error::EngineError) can carry — the HTTP answer's `code` (api.md
//! improvement 1), the audit outcome of an execution it ended and a metric label. One
//! closed set, so a code is a variant rather than a string each call site spells.

common::named_enum! {
    /// An [`EngineError`](crate::error::EngineError)'s code.
    pub enum ErrorCode {
        // The request as sent (contract validation, api.md improvement 1).
        InvalidJson => "invalid_json",
        InvalidFieldType => "invalid_field_type",
        InvalidIdentifier => "invalid_identifier",
        PersistentKernelRefused => "persistent_kernel_refused",
        UnsupportedLanguage => "unsupported_language",
        AgentIdRequired => "agent_id_required",
        CodeRequired => "code_required",
        ExecutionIdRequired => "execution_id_required",
        ExecutionIdTooLong => "execution_id_too_long",
        /// `/shell-executions`' own text for an id outside its pattern.
        InvalidExecutionId => "invalid_execution_id",
        DuplicateExecution => "duplicate_execution",
        InvalidMounts => "invalid_mounts",
        InvalidLimit => "invalid_limit",
        InvalidResourceLimits => "invalid_resource_limits",
        /// `isolation` names no backend, or one this host cannot run (issue #36).
        InvalidIsolation => "invalid_isolation",
        InvalidAccelerators => "invalid_accelerators",
        InvalidNetworkAccess => "invalid_network_access",
        InvalidEgressProxy => "invalid_egress_proxy",
        UnknownEnvironmentRevision => "unknown_environment_revision",
        // The workspace and the working directory.
        WorkspaceRequired => "workspace_required",
        InvalidWorkspaceKey => "invalid_workspace_key",
        ReservedWorkspaceName => "reserved_workspace_name",
        WorkspaceOutsideRoots => "workspace_outside_roots",
        WorkspaceIsRoot => "workspace_is_root",
        WorkspaceSymlink => "workspace_symlink",
        WorkspaceNotDirectory => "workspace_not_directory",
        WorkspaceCreateFailed => "workspace_create_failed",
        WorkspaceNotWritable => "workspace_not_writable",
        PathNotFound => "path_not_found",
        InvalidCwd => "invalid_cwd",
        DataDirUnavailable => "data_dir_unavailable",
        // What this host lacks.
        QueueFull => "queue_full",
        CapabilityUnavailable => "capability_unavailable",
        EnvironmentUnavailable => "environment_unavailable",
        NetworkUnavailable => "network_unavailable",
        SandboxUnavailable => "sandbox_unavailable",
        SkillsUnavailable => "skills_unavailable",
        NpuUnavailable => "npu_unavailable",
        GpuUnavailable => "gpu_unavailable",
        // The workspace's writer (`crate::error::workspace_code`).
        WorkspaceRetired => "workspace_retired",
        WorkspaceInterrupted => "workspace_interrupted",
        WorkspacePoisoned => "workspace_poisoned",
        NoBaseline => "no_baseline",
        WorkspaceVersionFailed => "workspace_version_failed",
        // Skill packages (`crate::skills::SkillError::code`).
        SkillMetadataInvalid => "skill_metadata_invalid",
        SkillPathInvalid => "skill_path_invalid",
        SkillIntegrityFailed => "skill_integrity_failed",
        SkillMdMissing => "skill_md_missing",
        SkillStoreUnavailable => "skill_store_unavailable",
        SkillRootInvalid => "skill_root_invalid",
        SkillNotPublished => "skill_not_published",
        SkillPackageInUse => "skill_package_in_use",
        SkillUnreachable => "skill_unreachable",
        SkillExtensionsUnavailable => "skill_extensions_unavailable",
        // The run.
        ExecutionTimeout => "execution_timeout",
        ExecutionAborted => "execution_aborted",
        WorkspaceQuotaExceeded => "workspace_quota_exceeded",
        SandboxLaunchFailed => "sandbox_launch_failed",
        /// A sandbox that would not die: its workspace stays locked.
        SandboxUnresponsive => "sandbox_unresponsive",
        VersionCommitFailed => "version_commit_failed",
        /// A failure of runnerd itself.
        Internal => "internal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_snake_case_and_unique() {
        let mut seen = std::collections::HashSet::new();
        for code in ErrorCode::ALL {
            let text = code.as_str();
            assert!(text.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'), "{text:?}");
            assert!(seen.insert(text), "{text:?} twice");
            assert_eq!(ErrorCode::parse(text), Some(*code));
        }
    }
}
