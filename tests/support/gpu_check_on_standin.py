"""The whole GPU check on the CUDA stand-in, in a process of its own:

    python tests/support/gpu_check_on_standin.py OUT.json [--only STEP,...]

``torch.cuda`` and ``pynvml`` are the stand-ins (``cuda_standin``), tensors placed on
"cuda" live on the CPU and are counted by the stand-in's allocator
(``cuda_device_standin``), and ``bench.gpu_check`` runs its CUDA branches, every one, as
on the lent GPU; the plan is sized for a 2-core machine. The exit status is the check's.
A process of its own because the check owns the process: its logger, its faulthandler
watchdog, and the patches, which stay for the whole run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest
from cuda_device_standin import StandInDevice
from cuda_standin import GiB, MiB, install_gpu

from bench.gpu_check.__main__ import ask_only, run
from bench.gpu_check.plan import Plan, selected
from bench.gpu_check.state import Check

# Small batches on the CPU, a latency target no CPU misses (so a busy machine tries the same
# sizes), one odd batch size, a budget wide enough for a loaded 2-core machine.
STANDIN_PLAN = Plan(max_batch=2, target_latency_ms=10_000.0, odd_sizes=(3,), seconds=0.3,
                    repeats=1, latency_requests=5, tick_calls=10, server_batch=4,
                    models_batch=2, budget_s=900.0)
TOTAL = 8 * GiB  # the stand-in GPU; its CUDA context takes 300 MiB of it


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", type=lambda text: text.split(","))
    given = parser.parse_args()
    patches = pytest.MonkeyPatch()
    cuda, _ = install_gpu(patches, total=TOTAL, context=300 * MiB)
    device = StandInDevice(cuda).install(patches)
    args = argparse.Namespace(device="cuda", dry=False, model="efficientnet_lite0",
                              max_batch_size=None, seconds=None, budget_s=None, out=given.out,
                              only=given.only, prepare=None)
    check = Check(args, gpu_plan=STANDIN_PLAN)
    ask_only(check, selected(given.only) if given.only else None)
    try:
        return run(check)
    finally:
        device.uninstall()
        patches.undo()


if __name__ == "__main__":
    raise SystemExit(main())
