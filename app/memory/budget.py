"""The VRAM budget: ``total x fraction - weights - workspaces - overhead``, optionally capped.

Kept as plain arithmetic so it can be printed line by line (`vramguard
doctor`) and tested with numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.units import human_bytes


@dataclass(frozen=True)
class Budget:
    """The inputs and the result, so the computation can be shown, not just its answer."""

    total: int
    fraction: float
    weights: int
    overhead: int
    cap: int | None = None
    workspaces: int = 0

    @property
    def formula_bytes(self) -> int:
        return int(self.total * self.fraction) - self.weights - self.workspaces - self.overhead

    @property
    def bytes(self) -> int:
        value = self.formula_bytes
        if self.cap is not None:
            value = min(value, self.cap)
        return max(0, value)

    def lines(self) -> list[str]:
        """The worked example, e.g. '24.0 GiB x 0.70 - 4.0 GiB - 2.0 GiB = 10.8 GiB'."""
        out = [
            f"device memory      {human_bytes(self.total)}",
            f"x fraction         {self.fraction:.2f} = {human_bytes(self.total * self.fraction)}",
            f"- model weights    {human_bytes(self.weights)}",
            *([f"- workspaces       {human_bytes(self.workspaces)} (kept allocated by GPU "
               "libraries after warmup)"] if self.workspaces else []),
            f"- overhead         {human_bytes(self.overhead)} (measured: device use torch "
            "does not hold)",
            f"= budget           {human_bytes(self.formula_bytes)}",
        ]
        if self.cap is not None:
            out.append(f"capped by setting  {human_bytes(self.cap)}")
        if self.bytes != self.formula_bytes:
            out.append(f"budget in force    {human_bytes(self.bytes)}")
        return out
