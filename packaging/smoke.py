"""Smoke-test a built bundle the way a user meets it: start, classify, doctor, stop.

    python -m packaging.smoke --bundle dist/vramguard [--json report.json]
    python -m packaging.smoke --venv            # the same checks on `python -m app`

Starts `vramguard serve` on a free loopback port with its settings, token, cache,
models and logs in a temporary folder (the user's own are never touched), waits for
/readyz, classifies a photo of an espresso, checks that a second launch announces the
running one instead of failing, runs `vramguard doctor`, and stops the server with
`vramguard stop`, which must end it with exit status 0. Before it starts, own models are
added (docs/own-models.md), one per loader a bundle must carry: a timm Hugging Face
folder and an ONNX file with `vramguard models add` (its trial load runs in a process the
program spawns), and a transformers folder put in the models folder by hand (the server's
own trial); `vramguard models list` must list all three and the server must classify the
photo with each. The folders are written, untrained, by this Python (the build
environment's timm, torch.onnx and transformers). Reports the time to ready and the
peak memory (RSS) of the server process. Exit status 0 only if every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
PHOTO = ROOT / "tests" / "data" / "coffee.jpg"
EXPECTED_LABEL = "espresso"
OWN_LABELS = ("circle", "square", "triangle")
OWN_SIZE = 64  # pixels: small models, so each own-model step takes seconds
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
ADDED = ("smoke-timm", "smoke-onnx")  # with `vramguard models add`
BY_HAND = "smoke-transformers"  # copied into the models folder


class SmokeFailure(Exception):
    """A step failed; the message says which and shows what the program printed."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PeakRss:
    """Samples a process's resident memory every 50 ms until stopped."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except psutil.Error:
                return
            self._stop.wait(0.05)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def isolated_env(folder: Path) -> dict[str, str]:
    """Settings that keep the smoke test's files out of the user's own folders."""
    env = dict(os.environ)
    (folder / "config.toml").write_text("# defaults: the smoke test changes nothing\n")
    env.update(VRAMGUARD_CONFIG=str(folder / "config.toml"),
               VRAMGUARD_TOKEN_FILE=str(folder / "admin-token"),
               VRAMGUARD_CACHE_DIR=str(folder / "cache"),
               VRAMGUARD_LOG_DIR=str(folder / "logs"),
               VRAMGUARD_MODELS_DIR=str(folder / "models"),
               VRAMGUARD_PROFILE_DIR=str(folder / "profiles"),
               VRAMGUARD_MAX_BATCH_SIZE="8")
    return env


def write_own_models(folder: Path) -> dict[str, Path]:
    """One untrained model folder per loader: timm's Hugging Face layout (timm and
    safetensors), an ONNX file (onnx and onnx2torch), and transformers' save_pretrained
    layout. Untrained is enough: the bundle must load them, not be right."""
    import timm
    import torch
    from transformers import ConvNextImageProcessor, ResNetConfig, ResNetForImageClassification
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one bar per file, in the smoke's output

    torch.manual_seed(0)
    folders = {name: folder / name for name in (*ADDED, BY_HAND)}
    model = timm.create_model("test_byobnet", num_classes=len(OWN_LABELS)).eval()
    # Every tensor different, as in a trained model: torch.onnx.export writes equal tensors
    # (a fresh model's zero biases) once, behind Identity nodes, and onnx2torch cannot
    # take a convolution's bias from one.
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(torch.rand_like(tensor) * 0.01)
    timm.models.save_for_hf(model, folders["smoke-timm"], safe_serialization=True,
                            model_config={"label_names": list(OWN_LABELS)},
                            data_config={"input_size": (3, OWN_SIZE, OWN_SIZE),
                                         "crop_pct": 0.875, "interpolation": "bilinear",
                                         "mean": IMAGENET_MEAN, "std": IMAGENET_STD})
    onnx = folders["smoke-onnx"]
    onnx.mkdir()
    # Opset 17 and the TorchScript exporter, as docs/own_models/train_timm.py exports
    # (onnx2torch lacks some later operators); its deprecation warning is not the smoke's.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(model, (torch.zeros(2, 3, OWN_SIZE, OWN_SIZE),),
                          onnx / "model.onnx", dynamo=False, opset_version=17,
                          input_names=["pixels"], output_names=["scores"],
                          dynamic_axes={"pixels": {0: "batch"}, "scores": {0: "batch"}})
    (onnx / "labels.txt").write_text("\n".join(OWN_LABELS) + "\n", encoding="utf-8")
    (onnx / "vramguard.toml").write_text(
        'labels = "labels.txt"\n\n[model]\nformat = "onnx"\nfile = "model.onnx"\n\n'
        f"[preprocessing]\nsize = {OWN_SIZE}\n", encoding="utf-8")
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                          layer_type="basic", id2label=dict(enumerate(OWN_LABELS)),
                          label2id={label: i for i, label in enumerate(OWN_LABELS)})
    ResNetForImageClassification(config).eval().save_pretrained(folders[BY_HAND])
    ConvNextImageProcessor(size={"shortest_edge": OWN_SIZE}, crop_pct=0.875).save_pretrained(
        folders[BY_HAND])
    return folders


def add_own_models(command: list[str], env: dict[str, str], sources: dict[str, Path]
                   ) -> dict[str, float]:
    """``ADDED`` through `vramguard models add`, ``BY_HAND`` copied in; `models list` must
    list them all. Returns the seconds each `models add` took."""
    seconds: dict[str, float] = {}
    for name in ADDED:
        started = time.monotonic()
        added = run_step([*command, "models", "add", str(sources[name]), "--name", name],
                         env, 300)
        seconds[name] = round(time.monotonic() - started, 2)
        if f"Added {name}:" not in added:
            raise SmokeFailure(f"`models add` did not add {name}:\n{added}")
    shutil.copytree(sources[BY_HAND], Path(env["VRAMGUARD_MODELS_DIR"]) / BY_HAND)
    listed = run_step([*command, "models", "list"], env, 120)  # exit 1: a broken folder
    rows = {tuple(line.split()[:3]) for line in listed.splitlines()}
    expected = {("smoke-timm", "classify", "timm-hf"), ("smoke-onnx", "classify", "onnx"),
                (BY_HAND, "classify", "transformers")}
    if not expected <= rows:
        raise SmokeFailure(f"`models list` does not list {sorted(expected - rows)}:\n{listed}")
    return seconds


def classify_loading(url: str, name: str, timeout: float = 300) -> httpx.Response:
    """The photo through model ``name``, asked again as each 503 "loading" says (a
    request whose deadline passes during the load gets one; a loaded machine takes
    longer)."""
    deadline = time.monotonic() + timeout
    while True:
        answer = httpx.post(f"{url}/v1/classify", params={"model": name},
                            content=PHOTO.read_bytes(),
                            headers={"Content-Type": "image/jpeg"}, timeout=timeout)
        loading = (answer.status_code == 503
                   and answer.json().get("error", {}).get("code") == "loading")
        if not loading or time.monotonic() > deadline:
            return answer
        time.sleep(float(answer.headers.get("Retry-After", "1")))


def classify_own_models(url: str) -> dict[str, dict[str, object]]:
    """The photo through each own model: a label of its own, and the seconds until the
    first answer (the hand-copied folder's trial, each model's load and measurement)."""
    answers: dict[str, dict[str, object]] = {}
    for name in (*ADDED, BY_HAND):
        started = time.monotonic()
        answer = classify_loading(url, name)
        if answer.status_code != 200:
            raise SmokeFailure(f"classify with {name} answered {answer.status_code}: "
                               f"{answer.text}")
        body = answer.json()
        label = body["predictions"][0]["label"]
        if body["model"] != name or label not in OWN_LABELS:
            raise SmokeFailure(f"classify with {name} answered {body}")
        answers[name] = {"label": label, "first_request_s":
                         round(time.monotonic() - started, 2)}
    return answers


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SmokeFailure(f"the server exited with status {process.returncode} before "
                               f"it was ready:\n{log.read_text(errors='replace')}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SmokeFailure(f"not ready after {timeout:.0f} s:\n{log.read_text(errors='replace')}")


def run_step(command: list[str], env: dict[str, str], timeout: float) -> str:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise SmokeFailure(f"{' '.join(command[-2:])} exited with {done.returncode}:\n{output}")
    return output


def smoke(command: list[str], ready_timeout: float) -> dict[str, object]:
    """All the steps against one way of launching vramguard; returns the measurements."""
    with tempfile.TemporaryDirectory(prefix="vramguard-smoke-") as temporary:
        folder = Path(temporary)
        env = isolated_env(folder)
        added_s = add_own_models(command, env, write_own_models(folder / "own-models"))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = folder / "server.log"
        started = time.monotonic()
        with log.open("wb") as sink:
            server = subprocess.Popen([*command, "serve", "--port", str(port)], env=env,
                                      stdout=sink, stderr=subprocess.STDOUT)
        rss = PeakRss(server.pid)
        try:
            wait_ready(url, server, ready_timeout, log)
            ready_s = time.monotonic() - started
            answer = httpx.post(f"{url}/v1/classify", content=PHOTO.read_bytes(),
                                headers={"Content-Type": "image/jpeg"}, timeout=30)
            if answer.status_code != 200:
                raise SmokeFailure(f"classify answered {answer.status_code}: {answer.text}")
            label = answer.json()["predictions"][0]["label"]
            if label != EXPECTED_LABEL:
                raise SmokeFailure(f"classify said {label!r}, expected {EXPECTED_LABEL!r}")
            own = classify_own_models(url)
            again = run_step([*command, "serve", "--port", str(port)], env, 60)
            if "already running" not in again:
                raise SmokeFailure(f"a second launch did not find the first:\n{again}")
            doctor_started = time.monotonic()
            doctor = run_step([*command, "doctor"], env, 300)
            doctor_s = time.monotonic() - doctor_started
            if "CUDA libraries" not in doctor or "all checks passed" not in doctor:
                raise SmokeFailure(f"doctor did not pass:\n{doctor}")
            run_step([*command, "stop", "--port", str(port)], env, 60)
            code = server.wait(30)
            if code != 0:
                raise SmokeFailure(f"the server ended with status {code} after "
                                   f"'vramguard stop':\n{log.read_text(errors='replace')}")
        finally:
            peak = rss.stop()
            if server.poll() is None:
                server.kill()
                server.wait()
    return {"command": " ".join(command), "time_to_ready_s": round(ready_s, 2),
            "peak_rss_bytes": peak, "label": label, "doctor_s": round(doctor_s, 2),
            "doctor": doctor.splitlines(),
            "own_models": {name: {**answer, "add_s": added_s.get(name)}
                           for name, answer in own.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--bundle", type=Path, help="the bundle folder (dist/vramguard)")
    target.add_argument("--venv", action="store_true", help="run `python -m app` instead")
    parser.add_argument("--ready-timeout", type=float, default=300)
    parser.add_argument("--json", type=Path, help="write the measurements here")
    args = parser.parse_args(argv)
    if args.venv:
        command = [sys.executable, "-m", "app"]
    else:
        executable = args.bundle / ("vramguard.exe" if sys.platform == "win32" else "vramguard")
        if not executable.is_file():
            print(f"smoke: no bundle at {executable}", file=sys.stderr)
            return 1
        command = [str(executable.resolve())]
    try:
        result = smoke(command, args.ready_timeout)
    except (SmokeFailure, subprocess.TimeoutExpired) as exc:
        print(f"smoke: FAILED: {exc}", file=sys.stderr)
        return 1
    if args.json:
        args.json.write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(f"smoke: passed - ready in {result['time_to_ready_s']} s, peak RSS "
          f"{result['peak_rss_bytes'] / 1024**2:.0f} MiB, top label {result['label']!r}, "
          f"doctor {result['doctor_s']} s, own models "
          + ", ".join(f"{name} {answer['label']!r}"
                      for name, answer in result["own_models"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
