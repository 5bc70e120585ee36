# shellcheck shell=bash
# Sourced by the packaging tests. They change the machine (install and purge a package,
# create system users, boot a container on an overlay of /), so they run as root only.
# Missing prerequisites: with CI=true they FAIL; elsewhere they skip, loudly.

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
target_dir="${CARGO_TARGET_DIR:-$repo_root/target}"
case "$target_dir" in /*) ;; *) target_dir="$repo_root/$target_dir" ;; esac
packages_dir="$target_dir/packages"
# The ignored output directory CI collects (journals, scores, logs).
# shellcheck disable=SC2034 # used by the scripts that source this file
artifacts_dir="${CI_ARTIFACTS_DIR:-$repo_root/target/ci-artifacts}"

failures=0
note() { printf '    %s\n' "$*"; }
ok() { printf '  ok: %s\n' "$*"; }
bad() { printf '  FAIL: %s\n' "$*" >&2; failures=$((failures + 1)); }
die() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }
# check DESCRIPTION COMMAND...: runs COMMAND, records ok/FAIL.
check() {
    local what="$1"; shift
    if "$@"; then ok "$what"; else bad "$what"; fi
}
# lacks EXTENDED-REGEX TEXT: true when no line of TEXT matches.
lacks() { ! grep -Eq -- "$1" <<< "$2"; }
# Not runnable here: a failure under CI, a loud skip elsewhere.
unavailable() {
    if [ "${CI:-}" = true ]; then
        die "$* (CI=true: a packaging test may not skip)"
    fi
    printf '\n*** SKIPPED %s: %s ***\n\n' "$(basename "$0")" "$*" >&2
    exit 0
}
require_root() {
    [ "$(id -u)" = 0 ] || unavailable "needs root (it installs packages and boots a container)"
}
require_cmd() { # command package
    command -v "$1" >/dev/null 2>&1 || unavailable "$1 is missing (apt-get install $2)"
}
# An overlay of this machine's / with its upper layer on a tmpfs of size $2 (everything the
# container writes vanishes with it), for booting a real systemd under nspawn. Sets $work
# (scratch, removed at exit), $merged (the container's root) and $out (bound into the
# container for its results); the unmounts are trapped on EXIT.
overlay_root() { # name size
    grep -qw overlay /proc/filesystems || modprobe overlay 2>/dev/null || true
    grep -qw overlay /proc/filesystems || unavailable "the kernel has no overlay filesystem"
    work=$(mktemp -d "/var/tmp/$1.XXXXXX")
    merged="$work/merged"
    out="$work/out"
    trap overlay_cleanup EXIT
    mkdir -p "$work/layers" "$merged" "$out"
    mount -t tmpfs -o "size=$2,mode=0755" "$1" "$work/layers"
    mkdir -p "$work/layers/upper" "$work/layers/work"
    mount -t overlay "$1" -o "lowerdir=/,upperdir=$work/layers/upper,workdir=$work/layers/work" "$merged"
    # No fstab mounts: they would fail in the container and hold up the boot.
    : > "$merged/etc/fstab"
}
overlay_cleanup() {
    umount "$merged" 2>/dev/null || umount -l "$merged" 2>/dev/null || true
    umount "$work/layers" 2>/dev/null || true
    rm -rf "$work"
}
# The .deb and .rpm that scripts/package built.
find_packages() {
    deb=$(ls "$packages_dir"/sciencediscovery_*.deb 2>/dev/null | head -1 || true)
    rpm=$(ls "$packages_dir"/sciencediscovery-*.rpm 2>/dev/null | head -1 || true)
    [ -n "$deb" ] && [ -n "$rpm" ] || die "no packages in $packages_dir: run scripts/package first"
}
finish() {
    if [ "$failures" -gt 0 ]; then
        printf '%s: %d check(s) FAILED\n' "$(basename "$0")" "$failures" >&2
        exit 1
    fi
    printf '%s: all checks passed\n' "$(basename "$0")"
}
