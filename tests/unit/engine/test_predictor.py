"""The batch call: the CPU path stacks and runs as before; on CUDA the batch goes through
a reused pinned staging buffer with an asynchronous copy.

The CUDA path can only run where CUDA exists: ``test_the_cuda_path_uses_a_pinned_buffer``
is skipped elsewhere, and the staging logic itself (reuse, growth, waiting for the last
copy) is tested here with an unpinned buffer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_model import tiny_model

from app.engine.predictor import Predictor, Sample, StagingBuffer


def samples(count: int, crop: int = 16) -> list[Sample]:
    generator = torch.Generator().manual_seed(count)
    return [Sample(torch.randn(3, crop, crop, generator=generator), 3) for _ in range(count)]


def test_the_cpu_path_is_unchanged() -> None:
    model = tiny_model()
    predictor = Predictor(model, keep_all=False)
    assert predictor.staging is None
    batch = samples(4)
    with torch.inference_mode():
        expected = model.module(torch.stack([s.pixels for s in batch])).softmax(dim=-1)
    scores, indices = expected.topk(3, dim=-1)
    for i, prediction in enumerate(predictor(batch)):
        assert np.array_equal(prediction.ranked.indices, indices[i].numpy())
        assert np.allclose(prediction.ranked.scores, scores[i].numpy())


def test_staging_reuses_its_buffer_and_grows_when_needed() -> None:
    staging = StagingBuffer(pin=False)
    first = staging.stack([s.pixels for s in samples(4)])
    smaller = staging.stack([s.pixels for s in samples(2)])
    assert smaller.data_ptr() == first.data_ptr()  # the same memory, no new allocation
    assert torch.equal(smaller, torch.stack([s.pixels for s in samples(2)]))
    larger = staging.stack([s.pixels for s in samples(8)])
    assert larger.shape == (8, 3, 16, 16)
    assert torch.equal(larger, torch.stack([s.pixels for s in samples(8)]))
    other_shape = staging.stack([s.pixels for s in samples(2, crop=8)])
    assert other_shape.shape == (2, 3, 8, 8)


def test_the_idle_release_gives_the_staging_buffer_back(tmp_path) -> None:
    """Through the engine's release (the idle release and Empty GPU cache): the buffer is
    dropped, and the next batch stacks into a new one."""
    from standin_engine import Clock

    from app.config import load_settings
    from app.engine.engine import InferenceEngine, Phase

    engine = InferenceEngine(load_settings(device="cpu", log_dir=tmp_path / "logs",
                                           profile_dir=tmp_path / "profiles",
                                           max_batch_size=2), clock=Clock())
    runtime = engine.warm_up(engine.load())
    engine.phase = Phase.READY  # as the server's start does after warmup
    runtime.predictor.staging = staging = StagingBuffer(pin=False)  # the CUDA path's part
    staging.stack([s.pixels for s in samples(4)])
    assert staging.buffer is not None
    engine.release()
    assert staging.buffer is None
    assert staging.stack([s.pixels for s in samples(2)]).shape == (2, 3, 16, 16)
    engine.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: this path exists only "
                    "there")
def test_the_cuda_path_uses_a_pinned_buffer() -> None:
    model = tiny_model()
    model.module.to("cuda")
    model.device = torch.device("cuda", 0)
    predictor = Predictor(model, keep_all=True)
    assert predictor.staging is not None
    on_gpu = predictor(samples(4))
    assert predictor.staging.buffer is not None and predictor.staging.buffer.is_pinned()
    model.module.to("cpu")
    model.device = torch.device("cpu")
    on_cpu = Predictor(model, keep_all=True)(samples(4))
    for gpu, cpu in zip(on_gpu, on_cpu, strict=True):
        order = np.argsort(cpu.ranked.indices)
        assert np.allclose(gpu.ranked.scores[np.argsort(gpu.ranked.indices)],
                           cpu.ranked.scores[order], atol=1e-2)
