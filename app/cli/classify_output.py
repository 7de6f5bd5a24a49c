"""What a ``vramguard classify`` run writes: one result per image in the chosen format
(lines, JSON or CSV) on stdout, the tally and the progress bar's speed on stderr."""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import ProgressColumn, Task
from rich.text import Text


@dataclass
class Tally:
    """What happened so far (kept outside the event loop: Ctrl-C ends that first)."""

    total: int
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> int:
        return self.ok + self.failed + self.skipped

    def summary(self, stopped: bool) -> str:
        took = time.monotonic() - self.started
        rate = (self.ok + self.failed) / took if took > 0 else 0.0
        head = (f"Stopped after {self.done} of {self.total} images" if stopped
                else f"Done: {self.total} images")
        return (f"{head}: {self.ok} tagged, {self.failed} failed, {self.skipped} skipped, "
                f"in {took:.1f} s ({rate:.1f} images/s).")


class Output:
    """One result per image in the chosen format, written as it comes."""

    def __init__(self, kind: str, top_k: int, embed: bool,
                 write: Callable[[str], None]) -> None:
        self.kind, self.top_k, self.embed, self._write = kind, top_k, embed, write
        if kind == "csv":
            header = ["path", "model"]
            for rank in range(1, top_k + 1):
                header += [f"label_{rank}", f"score_{rank}"]
            header += ["error"] + (["embedding"] if embed else [])
            self._row(header)

    def _row(self, cells: Sequence[object]) -> None:
        out = io.StringIO()
        csv.writer(out, lineterminator="").writerow(cells)
        self._write(out.getvalue())

    def result(self, path: Path, answer: dict[str, Any]) -> None:
        predictions = answer["predictions"]
        if self.kind == "json":
            record = {"path": str(path), "model": answer["model"],
                      "predictions": predictions, "cached": answer["cached"]}
            if "embedding" in answer:
                record["embedding"] = answer["embedding"]
            self._write(json.dumps(record))
        elif self.kind == "csv":
            cells: list[object] = [path, answer["model"]]
            for rank in range(self.top_k):
                found = predictions[rank] if rank < len(predictions) else None
                cells += [found["label"], f"{found['score']:.6f}"] if found else ["", ""]
            cells.append("")
            if self.embed:
                cells.append(" ".join(str(v) for v in answer.get("embedding", [])))
            self._row(cells)
        else:
            labels = ", ".join(f"{p['label']} {p['score']:.1%}" for p in predictions)
            features = f" ({answer['dimensions']} features)" if "dimensions" in answer else ""
            self._write(f"{path}: {labels}{features}")

    def failure(self, path: Path, error: dict[str, Any]) -> None:
        text = f"{error['code']}: {error['message']}"
        if self.kind == "json":
            self._write(json.dumps({"path": str(path), "error": {
                "code": error["code"], "message": error["message"]}}))
        elif self.kind == "csv":
            self._row([path, "", *([""] * (2 * self.top_k)), text,
                       *([""] if self.embed else [])])
        else:
            self._write(f"{path}: FAILED {text}")


class ImagesPerSecond(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:.1f} images/s" if speed else "- images/s")
