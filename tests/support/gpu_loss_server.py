"""`python gpu_loss_server.py TRIGGER serve ...`: the real `vramguard serve`, whose
graphics card "stops working" on request. Once the file TRIGGER exists, the next batch's
forward pass raises torch's own AcceleratorError with the message CUDA gives for a broken
context (a driver reset, TDR on Windows, looks like this to torch), and the file is
removed: a new server process finds a working card, as after a real reset. Everything
else (the classification of the error, the engine's failure, the exit) is vramguard's."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from app.cli.main import main
from app.engine import oom

STICKY = "CUDA error: an illegal memory access was encountered"


def _install(trigger: Path) -> None:
    real_init = oom.OomRecovery.__init__

    def init(self: oom.OomRecovery, forward: Callable[[list[Any]], list[Any]],
             *args: Any) -> None:
        def forward_or_lost(samples: list[Any]) -> list[Any]:
            if trigger.exists():
                trigger.unlink()
                raise torch.AcceleratorError(STICKY)
            return forward(samples)

        real_init(self, forward_or_lost, *args)

    oom.OomRecovery.__init__ = init  # type: ignore[method-assign]


if __name__ == "__main__":
    _install(Path(sys.argv[1]))
    raise SystemExit(main(sys.argv[2:]))
