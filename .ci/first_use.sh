#!/usr/bin/env bash
# A new user's first use: a venv made the README's way, outside the repository (so
# nothing of the tests' import path helps), and every command `vramguard --help` lists,
# as the README shows it. Each command's output goes to the log; the first failure stops
# the script with its name. Run by .ci/run; `bash .ci/first_use.sh` runs it alone.
#
# `run` and `tray` need a desktop: they run under Xvfb with the tint2 panel as tray host
# where those are installed (.ci/run installs them), with the README's install (no
# PyGObject, so pystray's plain X backend).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/vramguard-first-use.XXXXXX)
port=18765  # not the default: a vramguard the developer runs keeps its port
server=""
desktop=()
finish() {
    [ -z "$server" ] || kill "$server" 2>/dev/null || true
    # the last started first: a tray whose display is stopped under it cannot close its icon
    for ((i = ${#desktop[@]} - 1; i >= 0; i--)); do kill "${desktop[i]}" 2>/dev/null || true; done
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

step "your own model: the worked example, then vramguard models add, list, classify --model, remove"
"$work/.venv/bin/python" "$repo/docs/own_models/train_timm.py" made > train.log 2>&1 || {
    cat train.log; fail "docs/own_models/train_timm.py"; }
"$vg" models add made/onnx --name shapes > add.log 2>&1 || { cat add.log; fail "models add"; }
"$vg" models list | grep "shapes" > /dev/null || fail "models list"
"$work/.venv/bin/python" - "$repo/docs/own_models" shapes <<'PY' || fail "drawing pictures"
import sys
sys.path.insert(0, sys.argv[1])
import shapes_data
from pathlib import Path
Path(sys.argv[2]).mkdir()
for index, (image, label) in enumerate(shapes_data.make_images(6, seed=99)):
    image.save(f"{sys.argv[2]}/{index}-{shapes_data.LABELS[label]}.png")
PY
"$vg" classify --url "http://127.0.0.1:$port" --model shapes --top-k 1 --csv shapes \
    > shapes.csv || { cat shapes.csv; fail "classify --model shapes"; }
wrong=$(awk -F, 'NR > 1 { split($1, name, "-"); sub(/\.png$/, "", name[2]);
                          if (name[2] != $3) print $1 }' shapes.csv)
[ -z "$wrong" ] || { cat shapes.csv; fail "classify --model shapes: wrong for $wrong"; }
"$vg" models remove shapes || fail "models remove"
"$vg" models list | grep "shapes" > /dev/null && fail "models list after remove"
"$vg" stop --port "$port" || fail "stop"
wait "$server" || true
server=""
curl -fs "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && fail "still answering after stop"
wait_ready() {  # wait_ready PID LOG: the server on $port answers /readyz
    for _ in $(seq 300); do
        curl -fs "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && return 0
        kill -0 "$1" 2>/dev/null || { cat "$2"; fail "$3 exited"; }
        sleep 0.5
    done
    cat "$2"; fail "$3: the server never became ready"
}
docked() {  # the tray icon's window is in the panel (named "vramguard: ...")
    for _ in $(seq 60); do
        xwininfo -root -tree 2>/dev/null | grep -q '"vramguard:' && return 0
        sleep 0.5
    done
    return 1
}
if command -v Xvfb >/dev/null && command -v tint2 >/dev/null && command -v xwininfo >/dev/null
then
    display=99
    while [ -e "/tmp/.X11-unix/X$display" ] || [ -e "/tmp/.X$display-lock" ]; do
        display=$((display + 1))
    done
    export DISPLAY=":$display"
    Xvfb "$DISPLAY" -screen 0 1280x800x24 -nolisten tcp > xvfb.log 2>&1 &
    desktop+=($!)
    for _ in $(seq 50); do xwininfo -root >/dev/null 2>&1 && break; sleep 0.2; done
    tint2 > tint2.log 2>&1 &
    desktop+=($!)

    step "vramguard run (the server and its tray icon), then vramguard stop"
    "$vg" run --port "$port" > run.log 2>&1 &
    server=$!
    wait_ready "$server" run.log "run"
    docked || { cat run.log; fail "run: no tray icon in the panel"; }
    "$vg" stop --port "$port" || fail "stop after run"
    wait "$server" || true
    server=""
    docked_after=$(xwininfo -root -tree 2>/dev/null | grep -c '"vramguard:' || true)
    [ "$docked_after" = 0 ] || fail "run: the tray icon stayed after stop"

    step "vramguard tray for a running server"
    "$vg" serve --port "$port" > serve2.log 2>&1 &
    server=$!
    wait_ready "$server" serve2.log "serve"
    "$vg" tray --port "$port" > tray.log 2>&1 &
    tray=$!
    desktop+=("$tray")
    docked || { cat tray.log; fail "tray: no icon in the panel"; }
    kill -0 "$tray" 2>/dev/null || { cat tray.log; fail "tray exited"; }
    "$vg" stop --port "$port" || fail "stop with a tray open"
    wait "$server" || true
    server=""
else
    step "run and tray: skipped (no Xvfb, tint2 or xwininfo here; .ci/run installs them)"
fi
step "every command worked"
