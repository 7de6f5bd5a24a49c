"""Imports point down the request path, never up.

Layers, lowest first: the basics (errors, units, config, the schemas, preprocessing and
the pure image functions that follow it, ``app/imaging``'s decoding, pixels and checks,
which an own model's check runs an image through; this computer's files in
``app/host``, the metric registry) ← memory and models ←
engine ← imaging ←
the request's context (scope, state, counts, live feed), gates and routes ← the server's
assembly and the metrics collector ← the command line and the cluster. A module may
import its own layer or lower ones. Besides: the command line may launch the tray; the
tray imports only the schemas, units and host files of the app; nothing but the cluster
imports ``app.cluster``; ``clients/`` import nothing of ``app/``. Read from the source
with ``ast`` (imports inside functions count too), so nothing is imported to check.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (layer, module prefixes); the longest matching prefix decides.
LAYERS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (0, ("app", "app.errors", "app.units", "app.config", "app.schemas", "app.preprocessing",
         "app.schemas_oip", "app.host", "app.observe.registry", "app.vocabulary",
         "app.imaging.decoding", "app.imaging.pixels", "app.imaging.checks")),
    (1, ("app.memory", "app.models")),
    (2, ("app.engine",)),
    (3, ("app.imaging",)),
    (4, ("app.http.scope", "app.http.stats", "app.http.state", "app.http.live_feed",
         "app.gates", "app.api", "app.ui")),
    (5, ("app.http", "app.observe")),
    (6, ("app.cli", "app.cluster", "app.__main__")),
)
TRAY_MAY_IMPORT = ("app.schemas", "app.units", "app.host", "app.vocabulary")


def layer_of(module: str) -> int:
    best, found = -1, None
    for layer, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), layer
    if found is None:
        raise LookupError(f"{module} is in no layer: add it to LAYERS")
    return found


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) for every import of the file, absolute names only."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from app.cli import doctor` imports app.cli.doctor;
                yield node.lineno, f"{node.module}.{alias.name}"  # resolve() drops a name


def resolve(name: str, known: set[str]) -> str | None:
    """The module a dotted name refers to (the longest known prefix), or None."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def named(files: list[Path]) -> list[tuple[str, Path]]:
    return [(module_name(path), path) for path in files]


def violations(files: list[tuple[str, Path]], rule) -> list[str]:
    """Every import in ``files`` (module name, source) that ``rule`` refuses, with why."""
    known = {module_name(path) for path in sources("app") + sources("tray")}
    found = []
    for importer, path in files:
        for line, name in imports(path):
            target = resolve(name, known)
            if target is not None and target != importer:
                why = rule(importer, target)
                if why:
                    found.append(f"{importer}:{line} imports {target}: {why}")
    return sorted(set(found))


def app_rule(importer: str, target: str) -> str | None:
    if target.startswith("tray"):
        return None if importer.startswith("app.cli") else "only the command line starts the tray"
    if target.startswith("app.cluster") and not importer.startswith("app.cluster"):
        return "the appliance never imports the cluster"
    if layer_of(target) > layer_of(importer):
        return f"layer {layer_of(target)} above {importer}'s {layer_of(importer)}"
    return None


def tray_rule(importer: str, target: str) -> str | None:
    if target.startswith("tray") or target.startswith(TRAY_MAY_IMPORT):
        return None
    return "the tray reads the server over HTTP: only schemas, units and host files"


def test_every_app_module_has_a_layer():
    for path in sources("app"):
        layer_of(module_name(path))


def test_app_imports_point_down_the_request_path():
    assert violations(named(sources("app")), app_rule) == []


def test_the_tray_imports_only_schemas_units_and_host_files():
    assert violations(named(sources("tray")), tray_rule) == []


def test_the_clients_import_nothing_of_the_app():
    found = [f"{path.relative_to(ROOT)}:{line} imports {name}"
             for path in sources("clients") for line, name in imports(path)
             if name == "app" or name.startswith(("app.", "tray"))]
    assert found == []


@pytest.mark.parametrize(("importer", "planted", "expected"), [
    ("app/engine/batcher.py", "from app.http.server import create_app", "layer 5"),
    ("app/memory/guard.py", "import app.engine.residency", "layer 2"),
    ("app/gates/host_origin.py", "from app.cluster import proxy", "never imports the cluster"),
    ("app/schemas.py", "from app.memory.guard import MemoryGuard", "layer 1"),
])
def test_a_planted_upward_import_is_caught(tmp_path, importer, planted, expected):
    source = ROOT / importer
    copy = tmp_path / source.name
    copy.write_text(source.read_text(encoding="utf-8") + f"\n{planted}\n", encoding="utf-8")
    found = violations([(module_name(source), copy)], app_rule)
    assert len(found) == 1 and expected in found[0], found


def test_a_planted_tray_import_is_caught(tmp_path):
    source = ROOT / "tray" / "text.py"
    copy = tmp_path / "text.py"
    copy.write_text(source.read_text(encoding="utf-8") + "\nfrom app.engine import oom\n",
                    encoding="utf-8")
    found = violations([("tray.text", copy)], tray_rule)
    assert len(found) == 1 and "only schemas, units and host files" in found[0], found
