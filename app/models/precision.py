"""How a model's numbers are stored and its images laid out on the device: the
``precision`` setting (auto, fp32, bf16, fp16) and the ``channels_last`` switch.

The rule: ``auto`` means fp32 until a measurement says otherwise (the GPU check's
``precision`` step, docs/memory.md). bf16 and fp16 store the weights and run the batch at
that precision; the scores are computed in fp32 from the model's output. channels_last
stores convolution weights and images as NHWC, the layout cuDNN and oneDNN work in, and
the one for which torch sends depthwise convolutions (EfficientNet-Lite's) to cuDNN in
fp32 too.

They apply to the models vramguard builds as PyTorch modules: the built-in ones, timm,
torchvision, ONNX (converted by onnx2torch) and the Hugging Face formats. A TorchScript or
``torch.export`` program runs as it was saved: its graph may fix its dtypes, so it stays
fp32 NCHW, and the log says so. On a CPU without bf16 instructions bf16 would be emulated,
many times slower: such a CPU runs fp32 and the log says why. fp16 runs on the CPU (torch
has kernels for it) but slowly; the log says that too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

log = logging.getLogger("vramguard.engine")

Precision = Literal["auto", "fp32", "bf16", "fp16"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
AS_SAVED = ("torchscript", "export")  # model formats that run as they were saved


@dataclass(frozen=True)
class Numerics:
    """The precision and memory layout one model runs in."""

    precision: str = "fp32"  # a key of DTYPES
    channels_last: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def layout(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    @property
    def label(self) -> str:
        """'fp32', 'bf16 channels_last': in the result cache's key and the log."""
        return self.precision + (" channels_last" if self.channels_last else "")

    def module(self, module: nn.Module) -> nn.Module:
        """``module`` converted in place (weights and buffers)."""
        module.to(self.dtype)
        return module.to(memory_format=self.layout)

    def batch(self, pixels: torch.Tensor) -> torch.Tensor:
        """A batch of images (N, C, H, W) as the model takes it."""
        if pixels.dtype == self.dtype and not self.channels_last:
            return pixels
        return pixels.to(dtype=self.dtype, memory_format=self.layout)


FP32 = Numerics()


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16, AMX, Arm's BF16)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve(precision: Precision, channels_last: bool, device: torch.device,
            family: str) -> Numerics:
    """What a model of format ``family`` runs in on ``device`` under these settings: also
    the profile's key, known before the model loads, so a measurement is reused exactly
    where the model would run the same way (``auto`` and ``fp32`` alike; ``bf16`` on a CPU
    without it is fp32)."""
    if family in AS_SAVED:
        return FP32
    chosen = "fp32" if precision == "auto" else precision
    if device.type == "cpu" and chosen == "bf16" and not cpu_has_bf16():
        chosen = "fp32"
    return Numerics(chosen, channels_last)


def choose(precision: Precision, channels_last: bool, device: torch.device, family: str,
           name: str) -> Numerics:
    """``resolve``, and in the log why, where that is not what the settings ask for."""
    chosen = resolve(precision, channels_last, device, family)
    asked = "fp32" if precision == "auto" else precision
    if family in AS_SAVED:
        if asked != "fp32" or channels_last:
            wanted = precision + (" channels_last" if channels_last else "")
            log.warning("%s is a %s program and runs as it was saved (fp32), not in %s",
                        name, family, wanted)
    elif asked == "bf16" and chosen.precision == "fp32":
        log.warning("%s runs in fp32: this CPU has no bf16 instructions, and emulating "
                    "them would be many times slower", name)
    elif device.type == "cpu" and chosen.precision == "fp16":
        log.warning("%s runs in fp16 on the CPU, which is several times slower than "
                    "fp32 there: fp16 is meant for a GPU", name)
    return chosen
