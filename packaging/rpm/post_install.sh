# %post of the sciencediscovery RPM: system users (sysusers.d), the runner token, and the
# distribution's presets decide whether the units are enabled (RPM policy); nothing is
# started. $1: 1 on first install, 2+ on upgrade.

# --- shared with packaging/debian/postinst (a packaging test keeps the two identical) ---
# Creates /etc/sciencediscovery/runner-token (32 random bytes in hex, root:root 0600) unless
# one exists: an existing token, yours or ours, is never replaced.
create_runner_token() {
    token=/etc/sciencediscovery/runner-token
    [ -e "$token" ] && return 0
    mkdir -p /etc/sciencediscovery
    old_umask=$(umask)
    umask 077
    tmp=$(mktemp /etc/sciencediscovery/.runner-token.XXXXXX)
    if ! od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$tmp" || [ "$(wc -c < "$tmp")" -ne 64 ]; then
        rm -f "$tmp"
        umask "$old_umask"
        echo "sciencediscovery: could not generate $token" >&2
        return 1
    fi
    echo >> "$tmp"
    chown root:root "$tmp"
    chmod 0600 "$tmp"
    mv "$tmp" "$token"
    umask "$old_umask"
    echo "sciencediscovery: generated the runner token in $token (root only, 0600)"
}

# Runs `runnerd selftest` (one real sandbox) as runnerd's user in a scratch data directory
# and reports the outcome. Advisory: a host without usable user namespaces (a build chroot, a
# container) must still be able to install the package. SCIENCEDISCOVERY_SKIP_SELFTEST=1
# skips it.
advisory_selftest() {
    [ "${SCIENCEDISCOVERY_SKIP_SELFTEST:-}" = 1 ] && return 0
    command -v runuser >/dev/null 2>&1 || return 0
    scratch=$(mktemp -d /tmp/sciencediscovery-selftest.XXXXXX) || return 0
    chown sciencediscovery-runner: "$scratch" 2>/dev/null || { rm -rf "$scratch"; return 0; }
    if out=$(cd / && timeout 120 runuser -u sciencediscovery-runner -- env -i PATH=/usr/bin:/bin \
            SCIENCE_AGENT_DATA_DIR="$scratch/data" SCIENCE_AGENT_LOG_TARGET=stderr \
            /usr/bin/runnerd selftest 2>&1); then
        echo "sciencediscovery: runnerd selftest passed: sandboxes work on this host"
    else
        echo "sciencediscovery: WARNING: runnerd selftest failed; executions will not work until this is fixed:" >&2
        printf '%s\n' "$out" | sed 's/^/    /' >&2
    fi
    rm -rf "$scratch"
}
# --- end of the shared part ---

systemd-sysusers /usr/lib/sysusers.d/sciencediscovery.conf || :
create_runner_token || :
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
fi
if [ "$1" -eq 1 ]; then
    # First install: enable or not as the distribution's presets say (Fedora: disabled
    # unless a preset names them); never start.
    systemctl --no-reload preset egressd.service npu-brokerd.service runnerd.service runnerd.socket runner-router.service >/dev/null 2>&1 || :
fi
advisory_selftest
