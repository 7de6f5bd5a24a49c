"""A model's forward pass as one frozen TorchScript graph on the CPU: ``torch.jit.trace``,
then ``torch.jit.freeze`` (the weights become constants, batch norms fold into their
convolutions) and ``torch.jit.optimize_for_inference`` (oneDNN: convolutions fused with
their activations, weights packed once). No compiler is needed at run time.

The rule: a graph is used only where it answers as the module does, checked on the
same inputs whenever one is built (``disagreement``): every score within
``SCORE_TOLERANCE`` (an embedding model: every feature). That bound is the whole check:
scores that move by at most d can change an image's best class only where the module's
own two best were within 2d of each other, a near-tie either answer would fit.
Measured on EfficientNet-Lite0 on a 2-core CPU (``bench.cpu_paths``): 1.48x the images/s
end to end, scores within 8e-7. Whether it is also faster is measured per model at warmup
(``app.engine.calibration``).

torch 2.14 marks ``torch.jit`` deprecated. The graph is therefore an optimisation that
may fail at any load (a model that cannot be traced, a later torch without it): the
module then serves, and the log says why. Nothing traced is stored on disk; a graph is
rebuilt from the module at each load. It holds its own copy of the weights (packed for
oneDNN), which the memory accounting counts.

The module stays beside the graph: a batch that asks for a classifier's features
(``app.models.features``: a hook on the module's last layer) runs the module.
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.jit._trace import TracerWarning

log = logging.getLogger("vramguard.engine")
SCORE_TOLERANCE = 0.02  # the largest difference in any score a graph may make
CHECK_IMAGES = 4  # inputs the graph is checked on at each build
CHECK_SEED = 20261207  # the check's inputs are the same at every load
TIMED_ROUNDS = 3  # passes of each, interleaved, after two untimed ones each
Speedup = Callable[[nn.Module, nn.Module, torch.Tensor], float]  # module, graph, batch


class GraphUnavailable(Exception):
    """The model cannot run as a frozen graph; the message says why, for the log."""


def freeze(module: nn.Module, example: torch.Tensor) -> nn.Module:
    """``module`` traced on ``example`` (a batch as the model takes it), frozen and
    optimised for inference; GraphUnavailable where that fails, or where the tracer warns
    that its graph may not follow the module for other inputs. The module itself is not
    changed."""
    with warnings.catch_warnings(record=True) as said:  # torch 2.14: "deprecated"
        warnings.simplefilter("always")
        try:
            with torch.no_grad():
                traced = torch.jit.trace(  # type: ignore[no-untyped-call]  # torch: no hints
                    module.eval(), example, check_trace=False)
                frozen = torch.jit.freeze(traced.eval())
                graph = torch.jit.optimize_for_inference(frozen)
        except Exception as exc:
            first = str(exc).strip().splitlines()
            raise GraphUnavailable(first[0] if first else type(exc).__name__) from exc
    if any(issubclass(w.category, TracerWarning) for w in said):
        # Python code that reads a tensor's values or shape (an ``if`` on them, a size
        # turned into a number): the trace keeps the path taken here, for every input
        raise GraphUnavailable("its Python code depends on its input, which a graph "
                               "would fix at the values it was traced with")
    return graph


def disagreement(reference: torch.Tensor, candidate: torch.Tensor, task: str) -> str | None:
    """Why ``candidate`` (the graph's output) does not answer as ``reference`` (the
    module's) for a model of ``task``; None when it does. Scores compare as the routes
    give them: softmax for a classifier, a sigmoid per label for a multilabel one, the
    L2-normalised features for an embedding model."""
    if not isinstance(candidate, torch.Tensor) or candidate.shape != reference.shape:
        return "its output has another shape"
    reference, candidate = reference.float(), candidate.float()
    if task == "embed":
        first = nn.functional.normalize(reference, dim=-1)
        second = nn.functional.normalize(candidate, dim=-1)
    elif task == "multilabel":
        first, second = reference.sigmoid(), candidate.sigmoid()
    else:
        first, second = reference.softmax(dim=-1), candidate.softmax(dim=-1)
    difference = float((first - second).abs().max()) if first.numel() else 0.0
    if not difference <= SCORE_TOLERANCE:  # also NaN
        return f"its scores differ by up to {difference:.3g}"
    return None


def check_inputs(channels: int, crop: int, dtype: torch.dtype,
                 layout: torch.memory_format) -> torch.Tensor:
    """The inputs every graph is checked on: the same at every load."""
    generator = torch.Generator().manual_seed(CHECK_SEED)
    pixels = torch.randn(CHECK_IMAGES, channels, crop, crop, generator=generator)
    return pixels.to(dtype=dtype, memory_format=layout)


def build(module: nn.Module, inputs: torch.Tensor, task: str, name: str) -> nn.Module | None:
    """The graph of ``module``, traced on ``inputs`` and checked on them and on the first
    alone (serving runs every batch size up to its largest); None (and the log says why)
    when it cannot be built or does not answer as the module does."""
    try:
        graph = freeze(module, inputs)
        reason = None
        with torch.inference_mode():
            for batch in (inputs, inputs[:1]):  # a batch size taken as a constant fails
                reason = reason or disagreement(module(batch), graph(batch), task)
    except Exception as exc:
        first = str(exc).strip().splitlines()
        reason = f"it cannot be built ({first[0] if first else type(exc).__name__})"
    if reason is not None:
        log.info("%s runs as it is, not as a frozen graph: %s", name, reason)
        return None
    return graph


def speedup(module: nn.Module, graph: nn.Module, batch: torch.Tensor,
            clock: Callable[[], float] = time.perf_counter) -> float:
    """How many times faster ``graph`` runs ``batch`` than ``module`` (median wall time,
    passes interleaved so that a machine's drift slows both alike). The two first passes
    of each are not timed: they pay the first pass's setup and the graph executor's
    profiling run."""
    times: dict[str, list[float]] = {"module": [], "graph": []}
    runs = {"module": module, "graph": graph}
    with torch.inference_mode():
        for run in runs.values():
            run(batch)
            run(batch)
        for _ in range(TIMED_ROUNDS):
            for which, run in runs.items():
                started = clock()
                run(batch)
                times[which].append(clock() - started)
    graph_s = statistics.median(times["graph"])
    return statistics.median(times["module"]) / graph_s if graph_s > 0 else float("inf")
