#!/usr/bin/env bash
# Issue #8, the cgroup v2 delegation path under a real systemd: boots systemd with
# systemd-nspawn (unified hierarchy) on an overlay of this machine's / (upper layer on tmpfs:
# the machine is not changed), starts the built runnerd as a transient service of the
# unprivileged test user with Delegate=yes, and checks what runnerd's start-up detection
# concluded: on a host whose memory/pids/cpu controllers are held by cgroup v1 (this CI's
# kind) the delegated cgroup2 has none, and /health must say "controllers missing" instead
# of claiming limits; where controllers exist, it must report cgroup-v2 with runnerd moved
# into supervisor/. Run as root by scripts/test; artifacts in target/ci-artifacts/limits-v2-*.
set -euo pipefail
# shellcheck source=tests/packaging/lib.sh
. "$(dirname "$0")/../packaging/lib.sh"
require_root
require_cmd systemd-nspawn systemd-container
require_cmd python3 python3
user="${RUNNER_TEST_USER:-sbxtest}"
id "$user" >/dev/null 2>&1 || unavailable "no test user $user (set RUNNER_TEST_USER)"
bin_dir="${RUNNER_BIN_DIR:-$target_dir/debug}"
[ -x "$bin_dir/runnerd" ] && [ -x "$bin_dir/sandbox-init" ] || die "build first: no runnerd in $bin_dir"
mkdir -p "$artifacts_dir"

overlay_root sciencediscovery-limits-v2 1g
mkdir -p "$work/bin"
# The binaries under test, wherever the target directory is (a bind of it may be on
# another filesystem than /).
cp "$bin_dir/runnerd" "$bin_dir/sandbox-init" "$work/bin/"

cat > "$merged/usr/local/sbin/limits-v2-probe" <<'PROBE'
#!/bin/bash
# Inside the container, as root: runnerd as a delegated transient service, then /health.
set -u
out=/ci-out user="$1"
data=/var/tmp/limits-v2-data
mkdir -p "$data" && chown "$user": "$data"
systemd-run --unit=runnerd-limits -p User="$user" -p Delegate=yes \
    -E SCIENCE_AGENT_DATA_DIR="$data" -E SCIENCE_AGENT_RUNNER_PORT=4399 \
    -E SCIENCE_AGENT_RUNNER_TOKEN=limits-v2-token -E SCIENCE_AGENT_CONFIG=/dev/null \
    -E SCIENCE_AGENT_LOG_TARGET=stderr -E SCIENCE_AGENT_SANDBOX_INIT_PATH=/ci-bin/sandbox-init \
    -E SCIENCE_AGENT_EGRESS_SOCKET=/nonexistent/control.sock /ci-bin/runnerd > "$out/systemd-run.txt" 2>&1
for _ in $(seq 150); do
    python3 -c 'import urllib.request,sys; sys.stdout.write(urllib.request.urlopen("http://127.0.0.1:4399/health", timeout=2).read().decode())' \
        > "$out/health.json" 2>/dev/null && break
    sleep 0.1
done
cg=$(systemctl show -P ControlGroup runnerd-limits)
pid=$(systemctl show -P MainPID runnerd-limits)
{
    echo "unit_cgroup=$cg"
    echo "controllers=$(cat "/sys/fs/cgroup$cg/cgroup.controllers" 2>&1)"
    echo "procs_owner=$(stat -c %U "/sys/fs/cgroup$cg/cgroup.procs" 2>&1)"
    echo "runnerd_cgroup=$(grep '^0::' "/proc/$pid/cgroup" 2>&1)"
    echo "fs=$(stat -f -c %T /sys/fs/cgroup)"
} > "$out/facts.txt"
journalctl -u runnerd-limits --no-pager > "$out/runnerd.log" 2>&1
systemctl stop runnerd-limits
echo done > "$out/finished"
PROBE
chmod 0755 "$merged/usr/local/sbin/limits-v2-probe"
cat > "$merged/etc/systemd/system/limits-v2-probe.service" <<UNIT
[Unit]
Description=issue 8 cgroup v2 delegation probe
After=basic.target
SuccessAction=poweroff-force
FailureAction=poweroff-force

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/limits-v2-probe $user
TimeoutStartSec=120
UNIT
mkdir -p "$merged/etc/systemd/system/multi-user.target.wants"
ln -sf /etc/systemd/system/limits-v2-probe.service \
    "$merged/etc/systemd/system/multi-user.target.wants/limits-v2-probe.service"
# Only the probe: nothing of the machine's own services that could hold up the boot.
rm -f "$merged"/etc/systemd/system/multi-user.target.wants/sciencediscovery-* 2>/dev/null || true

echo "==> booting systemd (nspawn, unified cgroup hierarchy)"
SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1 timeout 180 systemd-nspawn -q -D "$merged" --register=no --keep-unit \
    --private-network --console=read-only --bind="$out:/ci-out" --bind-ro="$work/bin:/ci-bin" -b \
    > "$artifacts_dir/limits-v2-console.log" 2>&1 || true
cp "$out"/* "$artifacts_dir/" 2>/dev/null || true
for f in facts.txt health.json runnerd.log; do
    [ -f "$out/$f" ] && cp "$out/$f" "$artifacts_dir/limits-v2-$f"
done

[ -f "$out/finished" ] || die "the probe did not finish (see $artifacts_dir/limits-v2-console.log)"
sed 's/^/    /' "$out/facts.txt"
check "runnerd answered /health under systemd" test -s "$out/health.json"
check "the unit's cgroup is delegated to $user" grep -qx "procs_owner=$user" "$out/facts.txt"
check "the container runs on cgroup2" grep -qx "fs=cgroup2fs" "$out/facts.txt"
verdict=$(python3 - "$out/health.json" "$out/facts.txt" <<'PY'
import json, sys
h = json.load(open(sys.argv[1]))
facts = dict(l.rstrip("\n").split("=", 1) for l in open(sys.argv[2]) if "=" in l)
have = set(facts.get("controllers", "").split())
mode, reasons = h["cgroupMode"], h["resourceLimits"]["fallbackReasons"]
if {"memory", "pids", "cpu"} <= have:
    ok = (mode == "cgroup-v2" and h["cgroupDelegated"] is True and h["enforced"]["memory"] is True
          and facts.get("runnerd_cgroup", "").endswith("/supervisor"))
    print(("ok" if ok else "bad") + f": controllers {sorted(have)}: mode {mode}, runnerd in {facts.get('runnerd_cgroup')}")
else:
    ok = (mode == "none" and h["cgroupDelegated"] is False and h["enforced"]["memory"] == "partial"
          and any(r.startswith("cgroup v2: controllers missing") for r in reasons)
          and "controllers missing" in h["reasons"]["memory"])
    print(("ok" if ok else "bad") + f": controllers {sorted(have) or 'none'}: mode {mode}, reasons {reasons}")
PY
)
note "$verdict"
check "health tells the truth about cgroup v2 here" test "${verdict%%:*}" = ok
finish
