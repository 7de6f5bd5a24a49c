"""The VRAM budget for images in flight.

``room = total x fraction / servers - workspaces - overhead``, capped by the
``memory_budget`` setting, is what vramguard's models may take together on the device
(``servers``: the vramguards on this GPU, each planning for its share of the fraction;
``overhead`` then leaves out what the others use, where the driver reports it, so it is
not subtracted twice); the budget for
images in flight is what the loaded models' weights leave of it:
``budget = room - sum of the loaded models' weights``. Every batch is sized to it, and a
model loads only when ``sum of weights + the largest batch of any loaded model`` fits in
``room`` (see ``app.engine.residency``).

Kept as plain arithmetic so it can be printed line by line (`vramguard
doctor`) and tested with numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.units import human_bytes
from app.vocabulary import GPU_MEMORY, LIMIT, MODELS, ROOM_FOR_IMAGES


@dataclass(frozen=True)
class Budget:
    """The inputs and the result, so the computation can be shown, not just its answer."""

    total: int
    fraction: float
    weights: int
    overhead: int
    cap: int | None = None
    workspaces: int = 0
    servers: int = 1  # vramguards on this GPU, this one included

    @property
    def share(self) -> float:
        """The fraction of the device this server plans for."""
        return self.fraction / max(1, self.servers)

    @property
    def formula_room(self) -> int:
        return int(self.total * self.share) - self.workspaces - self.overhead

    @property
    def room(self) -> int:
        """What the models may take together: weights and the batch in flight."""
        value = self.formula_room
        if self.cap is not None:
            value = min(value, self.cap)
        return max(0, value)

    @property
    def formula_bytes(self) -> int:
        return self.formula_room - self.weights

    @property
    def bytes(self) -> int:
        return max(0, self.room - self.weights)

    def lines(self) -> list[str]:
        """The worked example in the names of ``app/vocabulary.py``, e.g.
        '24.0 GiB x 0.70 - 4.0 GiB = limit 12.8 GiB - 2.0 GiB of models = 10.8 GiB'."""
        out = [
            f"{GPU_MEMORY.name:<18} {human_bytes(self.total)}",
            f"x fraction         {self.fraction:.2f} = {human_bytes(self.total * self.fraction)}",
            *([f"/ {self.servers} vramguards    = {human_bytes(self.total * self.share)} "
               "(each vramguard on this GPU plans for its share)"]
              if self.servers > 1 else []),
            *([f"- workspaces       {human_bytes(self.workspaces)} (kept allocated by GPU "
               "libraries after warmup)"] if self.workspaces else []),
            f"- overhead         {human_bytes(self.overhead)} (measured: device use torch "
            "does not hold)",
            f"= {LIMIT.name.lower():<16} {human_bytes(self.formula_room)} (models and images "
            "together)",
        ]
        if self.cap is not None and self.cap < self.formula_room:
            out.append(f"capped by setting  {human_bytes(self.cap)} (memory_budget)")
        out += [f"- {MODELS.name.lower():<16} {human_bytes(self.weights)} (every loaded model)",
                f"= {ROOM_FOR_IMAGES.name.lower():<16} {human_bytes(self.room - self.weights)}"]
        if self.bytes != self.room - self.weights:
            out.append(f"{ROOM_FOR_IMAGES.name.lower()} now {human_bytes(self.bytes)}")
        return out
