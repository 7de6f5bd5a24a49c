#!/usr/bin/env bash
# A new user's first use: a venv made the README's way, outside the repository (so
# nothing of the tests' import path helps), and every command `vramguard --help` lists,
# as the README shows it. Each command's output goes to the log; the first failure stops
# the script with its name. Run by .ci/run; `bash .ci/first_use.sh` runs it alone.
#
# Not here: `run` and `tray`, which need a desktop (tests/desktop/ starts them under Xvfb).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/vramguard-first-use.XXXXXX)
port=18765  # not the default: a vramguard the developer runs keeps its port
server=""
finish() {
    [ -z "$server" ] || kill "$server" 2>/dev/null || true
    rm -rf "$work"
}
trap finish EXIT
step() { echo "first use: $*"; }
fail() { echo "first use FAILED: $*" >&2; exit 1; }

step "install the README's way (python3.11 -m venv .venv && .venv/bin/pip install -e .)"
python3.11 -m venv "$work/.venv"
"$work/.venv/bin/pip" install --quiet -e "$repo" || fail "pip install -e ."
vg="$work/.venv/bin/vramguard"
cd "$work"  # a user's own folder, not the repository
# A new user's folders: no settings, profiles, token or cache from earlier runs (after the
# install, which keeps this machine's pip configuration).
export HOME="$work/home" XDG_CONFIG_HOME="$work/home/.config" XDG_CACHE_HOME="$work/home/.cache" \
       XDG_STATE_HOME="$work/home/.local/state" XDG_DATA_HOME="$work/home/.local/share"
mkdir -p "$HOME"

step "vramguard --version"
"$vg" --version | grep -q "vramguard" || fail "--version"

step "vramguard doctor"
"$vg" doctor > doctor.log 2>&1 || { cat doctor.log; fail "doctor"; }

step "vramguard classify on a folder, with no server running (it starts one)"
mkdir photos && cp "$repo/tests/data/coffee.jpg" photos/
"$vg" classify photos > classify.txt 2> classify.err || {
    cat classify.err; fail "classify with no server"; }
grep -q "espresso" classify.txt || { cat classify.txt classify.err; fail "classify's answer"; }

step "vramguard serve, then classify against it, then vramguard stop"
"$vg" serve --port "$port" > serve.log 2>&1 &
server=$!
for _ in $(seq 300); do
    curl -fs "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break
    kill -0 "$server" 2>/dev/null || { cat serve.log; fail "serve exited"; }
    sleep 0.5
done
curl -fs "http://127.0.0.1:$port/readyz" >/dev/null || { cat serve.log; fail "serve not ready"; }
curl -fs --data-binary @"$repo/tests/data/coffee.jpg" -H 'Content-Type: image/jpeg' \
    "127.0.0.1:$port/v1/classify" | grep -q espresso || fail "the README's curl"
"$vg" classify --url "http://127.0.0.1:$port" --json photos | grep -q espresso \
    || fail "classify against a running server"
"$vg" stop --port "$port" || fail "stop"
wait "$server" || true
server=""
curl -fs "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && fail "still answering after stop"
step "every command worked"
