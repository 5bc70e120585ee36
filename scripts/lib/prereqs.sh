# Sourced by the scripts: installs what building and sandboxing need on Debian/Ubuntu
# when it is missing (as root, or through sudo), and says what to do otherwise.
ensure_prereqs() {
    local missing=()
    command -v bwrap >/dev/null || missing+=(bubblewrap)
    [ -x /usr/bin/python3 ] || missing+=(python3)
    command -v runuser >/dev/null || missing+=(util-linux)
    # curl: what the network tests run inside sandboxes, through the egress bridge.
    [ -x /usr/bin/curl ] || missing+=(curl)
    if [ "${#missing[@]}" -gt 0 ]; then
        local sudo=()
        [ "$(id -u)" = 0 ] || sudo=(sudo)
        if command -v apt-get >/dev/null; then
            echo "installing ${missing[*]} ..." >&2
            "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
        else
            echo "please install: ${missing[*]}" >&2
            return 1
        fi
    fi
    if ! command -v cargo >/dev/null; then
        # shellcheck disable=SC1091
        [ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
        command -v cargo >/dev/null || { echo "cargo is missing: install Rust (https://rustup.rs)" >&2; return 1; }
    fi
}
