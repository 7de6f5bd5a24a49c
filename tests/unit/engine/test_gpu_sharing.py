"""Two vramguards on one GPU (two users on one PC, or two ports), on the CUDA stand-in:
each plans for half of memory_fraction while the other runs, and for all of it again once
it stops; what the other uses is not subtracted twice where the driver reports it, while
a game's memory still is. Server B plays another process (its claim names process
OTHER_PID, which the stand-in's NVML lists with B's memory)."""

from __future__ import annotations

import logging
import os

import pytest
from cuda_standin import CudaStandIn, GiB, MiB, NvmlStandIn, install_gpu
from standin_engine import WEIGHTS, Clock, budget, engine_for, load, tick

from app.config import Settings
from app.engine.engine import InferenceEngine
from app.engine.residency import needed
from app.host.gpu_claims import Claim, GpuClaims
from app.memory.probes import CudaProbe, Probe
from app.memory.sharing import GpuSharing

TOTAL = 8 * GiB
OTHER_PID = 424242


def live(claim: Claim) -> bool:
    return claim.pid in (os.getpid(), OTHER_PID)


def sharing_as(pid: int):
    """The engine's sharing factory, for a server in process ``pid``."""
    def make(settings: Settings, probe: Probe) -> GpuSharing:
        assert isinstance(probe, CudaProbe) and probe.nvml is not None
        claims = GpuClaims(settings.gpu_claims_dir, probe.gpu_id, settings.port, pid=pid,
                           alive=live)
        return GpuSharing(claims, probe.nvml.processes, settings.memory_fraction)
    return make


@pytest.fixture
def two(monkeypatch, tmp_path):
    cuda, nvml = install_gpu(monkeypatch, total=TOTAL, context=200 * MiB)
    clock = Clock()
    folder = tmp_path / "claims"
    a = engine_for(tmp_path / "a", clock, gpu_claims_dir=folder, port=8765,
                   sharing=sharing_as(os.getpid()))
    b = engine_for(tmp_path / "b", clock, gpu_claims_dir=folder, port=8766,
                   sharing=sharing_as(OTHER_PID))
    yield cuda, nvml, clock, a, b
    a.stop()
    b.stop()


def start_b(b: InferenceEngine, cuda: CudaStandIn, nvml: NvmlStandIn,
            reported: bool = True) -> None:
    """B loads its model; then its weights are moved to where another process's are: off
    this process's allocator, onto the device's use, under B's process in NVML's list
    (``reported``) or with no figure, as under WDDM."""
    placed: dict[str, int] = {}
    load(b, cuda, "lite0", placed)
    cuda.free(placed["lite0"])
    if reported:
        nvml.other_processes = {OTHER_PID: WEIGHTS}
    else:
        nvml.other_processes = {OTHER_PID: None}
        cuda.others += WEIGHTS


def room(engine: InferenceEngine) -> int:
    assert engine.models.budget is not None
    return engine.models.budget.room


def test_two_servers_share_the_fraction_and_one_gets_it_back_when_the_other_stops(
        two, caplog):
    cuda, nvml, clock, a, b = two
    caplog.set_level(logging.WARNING, "vramguard.engine")
    load(a, cuda, "lite0")
    alone = room(a)
    assert a.models.budget.servers == 1 and cuda.limit == int(0.7 * TOTAL)
    start_b(b, cuda, nvml)  # B starts: it sees A's claim at once
    assert b.models.budget.servers == 2
    tick(a, clock)  # A sees B's at its next second
    assert a.models.budget.servers == 2
    assert cuda.limit == int(0.35 * TOTAL)  # the allocator's own limit follows
    assert alone - room(a) == pytest.approx(0.35 * TOTAL, abs=2 * MiB)
    # Together they plan for the fraction, not twice it (the bug: 2 x 0.7 of the card).
    assert room(a) + room(b) <= 0.7 * TOTAL
    assert "another vramguard uses this GPU (process 424242 on port 8766): each of the 2 " \
           "plans for 35% of its memory" in caplog.text
    report = a.reports.report(a.models.primary)
    assert [(s.pid, s.port) for s in report.sharing_with] == [(OTHER_PID, 8766)]
    assert "/ 2 vramguards" in "\n".join(a.models.budget.lines())

    b.stop()  # B's claim goes with it, and its memory with its process
    nvml.other_processes = {}
    tick(a, clock)
    assert a.models.budget.servers == 1 and room(a) == alone
    assert cuda.limit == int(0.7 * TOTAL)
    assert "this one plans for 70% of its memory again" in caplog.text
    assert a.reports.report(a.models.primary).sharing_with == []


def test_a_share_that_shrinks_gives_the_cache_back_and_unloads_what_no_longer_fits(
        two, caplog):
    """A alone holds 26 models of 100 MiB and a 2 GiB cache; B's arrival halves A's
    share: A's cache goes back to the GPU at once (the allocator's new limit would not free
    it), and the least recently used models are unloaded until the rest fit."""
    cuda, nvml, clock, a, b = two
    caplog.set_level(logging.INFO, "vramguard")
    names = [f"model{i:02}" for i in range(26)]
    placed: dict[str, int] = {}
    for name in names:
        load(a, cuda, name, placed, pinned=False)
    cuda.free(cuda.alloc(2 * GiB))  # a large batch came and went: it stays cached
    assert cuda.reserved > cuda.allocated + 2 * GiB - MiB
    tick(a, clock, after_s=a.settings.min_residency_s + 1)
    a.models.residents[names[0]].last_used = clock.now  # used just now: stays
    assert set(a.models.runtimes) == set(names)
    start_b(b, cuda, nvml)
    tick(a, clock)
    assert cuda.reserved < cuda.allocated + 100 * MiB
    kept = set(a.models.runtimes)
    assert names[0] in kept and 0 < len(kept) < len(names)
    assert kept == {names[0], *names[len(names) - len(kept) + 1:]}  # the most recent
    for gone in set(names) - kept:  # what a real unload gives back with the model
        cuda.free(placed[gone])
    a.models.rebudget()
    footprints = [r.footprint for r in a.models.residents.values()]
    assert needed(footprints) <= room(a)
    assert "batches will be smaller" not in caplog.text


def test_what_the_other_server_uses_is_not_subtracted_from_a_share_that_leaves_room_for_it(
        two):
    cuda, nvml, clock, a, b = two
    load(a, cuda, "lite0")
    start_b(b, cuda, nvml)
    tick(a, clock)
    shared = budget(a)
    nvml.other_processes = {OTHER_PID: WEIGHTS + GiB}  # B's batches take 1 GiB more
    tick(a, clock)
    assert budget(a) == shared
    cuda.others = GiB  # a game takes a GiB: that one counts
    tick(a, clock)
    assert budget(a) == shared - GiB


def test_where_the_driver_does_not_say_the_other_servers_use_counts_as_other_programs(two):
    """Windows' WDDM: NVML lists the process with no figure; A then plans for less, never
    for more."""
    cuda, nvml, clock, a, b = two
    nvml.process_used = None
    load(a, cuda, "lite0")
    start_b(b, cuda, nvml, reported=False)
    tick(a, clock)
    shared = budget(a)
    cuda.others += GiB  # B's batches take 1 GiB more, which NVML does not put under B
    tick(a, clock)
    assert budget(a) == shared - GiB


def test_a_server_that_cannot_write_its_claim_plans_alone_and_says_why(
        monkeypatch, tmp_path):
    cuda, _ = install_gpu(monkeypatch, total=TOTAL, context=200 * MiB)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    engine = engine_for(tmp_path, Clock(), gpu_claims_dir=blocker / "gpus")
    load(engine, cuda, "lite0")
    report = engine.reports.report(engine.models.primary)
    assert report.sharing_problem and "could not write to" in report.sharing_problem
    assert engine.models.budget.servers == 1


def test_on_the_cpu_no_claim_is_written(tmp_path):
    from app.config import load_settings

    engine = InferenceEngine(load_settings(device="cpu", gpu_claims_dir=tmp_path / "claims",
                                           log_dir=tmp_path / "logs"))
    engine.models.the_probe()
    assert engine.models.sharing.claims is None
    assert not (tmp_path / "claims").exists()



def test_a_server_is_credited_at_most_its_share(two):
    """A claim made up for a game's process (its number and start time are public) must
    not make A plan for more: the claimed server's use counts as a share at most, the
    rest as another program's."""
    cuda, nvml, clock, a, b = two
    load(a, cuda, "lite0")
    start_b(b, cuda, nvml)
    tick(a, clock)
    shared = budget(a)
    nvml.other_processes = {OTHER_PID: 4 * GiB}  # "B" is a game that takes 4 GiB
    tick(a, clock)
    share = int(0.35 * TOTAL)
    assert a.models.sharing.others_bytes == share
    assert budget(a) == shared - (4 * GiB - share)  # the rest is another program's


def test_a_claim_for_a_process_nvml_does_not_list_on_the_gpu_does_not_count(two):
    cuda, nvml, clock, a, b = two
    load(a, cuda, "lite0")
    start_b(b, cuda, nvml)
    nvml.other_processes = {}  # NVML lists processes, and B's is not among them
    tick(a, clock)
    assert a.models.sharing.servers == 1
