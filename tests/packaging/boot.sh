#!/usr/bin/env bash
# Packaging test (b), the boot test: a real systemd, booted with systemd-nspawn on an
# overlay of this machine's / (upper layer on tmpfs: the machine is not changed), with the
# .deb installed in it. Inside, a probe unit starts egressd.service and runnerd.socket, runs
# `runnerd selftest` as the runner user, makes a signed execution through the
# socket-activated port with runnerctl, checks /health and the daemons' users, reads
# `journalctl -o json` for runnerd's and egressd's audit records, and powers the container
# off. The journal, the probe's log and /health land in target/ci-artifacts/boot-*.
set -euo pipefail
# shellcheck source=tests/packaging/lib.sh
. "$(dirname "$0")/lib.sh"
require_root
require_cmd systemd-nspawn systemd-container
require_cmd python3 python3
find_packages
mkdir -p "$artifacts_dir"
here="$(cd "$(dirname "$0")" && pwd)"

overlay_root sciencediscovery-boot 2g

# --private-network: the container's 127.0.0.1:4311 is its own. Landlock's calls are allowed
# through nspawn's own seccomp filter (systemd 252 refuses them with EPERM), so egressd's
# landlock outcome is decided by egressd.service alone.
nspawn=(systemd-nspawn -q -D "$merged" --register=no --keep-unit --private-network
        --system-call-filter='landlock_create_ruleset landlock_add_rule landlock_restrict_self')

# The container is this machine's OS, minus what would tie it to this machine (no fstab
# mounts: overlay_root empties it) and no package of ours left over from an earlier run.
rm -rf "$merged/etc/sciencediscovery"
cp "$deb" "$merged/var/tmp/sciencediscovery.deb"

echo "==> dpkg -i inside the container"
if ! "${nspawn[@]}" -E SCIENCEDISCOVERY_SKIP_SELFTEST=1 -E DEBIAN_FRONTEND=noninteractive \
        dpkg -i /var/tmp/sciencediscovery.deb > "$artifacts_dir/boot-dpkg.log" 2>&1; then
    cat "$artifacts_dir/boot-dpkg.log" >&2
    die "dpkg -i inside the container failed"
fi
ok "installed"

# The probe: a oneshot that powers the container off whatever happens.
install -m 0755 "$here/boot-probe" "$merged/usr/local/sbin/ci-probe"
cat > "$merged/etc/systemd/system/ci-probe.service" <<'UNIT'
[Unit]
Description=sciencediscovery boot test probe
After=basic.target
SuccessAction=poweroff-force
FailureAction=poweroff-force

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/ci-probe /ci-out
# The journal, also when the probe fails or times out: what a failure needs to be read.
ExecStopPost=/bin/sh -c 'journalctl --flush; journalctl -o json --no-pager > /ci-out/journal.json'
TimeoutStartSec=300
UNIT
mkdir -p "$merged/etc/systemd/system/multi-user.target.wants"
ln -sf /etc/systemd/system/ci-probe.service "$merged/etc/systemd/system/multi-user.target.wants/ci-probe.service"

# Whether egressd must report landlock enforced: when this kernel offers landlock at all.
if python3 -c 'import ctypes, sys; sys.exit(0 if ctypes.CDLL(None).syscall(444, None, 0, 1) > 0 else 1)'; then
    touch "$out/expect-landlock"
fi

echo "==> booting systemd in the container"
start=$(date +%s)
timeout 400 "${nspawn[@]}" --bind="$out:/ci-out" -b > "$artifacts_dir/boot-console.log" 2>&1 || true
echo "    container ran for $(( $(date +%s) - start )) s"

for f in journal.json probe.log health.json selftest.log; do
    [ -f "$out/$f" ] && cp "$out/$f" "$artifacts_dir/boot-$f"
done
if [ ! -f "$out/probe.log" ]; then
    tail -50 "$artifacts_dir/boot-console.log" >&2
    die "the probe never ran (console: $artifacts_dir/boot-console.log)"
fi
sed 's/^/    | /' "$out/probe.log"
[ -f "$artifacts_dir/boot-journal.json" ] && note "journal: $artifacts_dir/boot-journal.json"
grep -qx 'result: ok' "$out/probe.log" || die "the boot test failed (see above and $artifacts_dir/boot-*)"
echo "boot.sh: all checks passed"
