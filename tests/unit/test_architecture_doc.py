"""docs/architecture.md is the map of the code: every path it names exists, and every
package under app/ is on it (a new package without a line there fails here)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
TOP = ("app", "tray", "tests", "bench", "docs", "clients", "deploy", "packaging",
       "installer", "assets", ".ci", "build.ps1", "pyproject.toml")
# A path in backticks, e.g. `app/engine/batcher.py`, `app/gates/`, `tests/unit/<package>/`.
PATH = re.compile(r"`((?:" + "|".join(re.escape(t) for t in TOP) + r")(?:/[^`\s]*)?)`")


def named_paths(text: str) -> list[str]:
    """Every backticked repository path in the text, with a trailing `(...)` or `:name`
    dropped and placeholders such as `<package>` kept for the caller."""
    found = []
    for match in PATH.finditer(text):
        path = match.group(1).split("::")[0].split(":")[0].rstrip("/")
        found.append(path)
    return found


def exists(path: str) -> bool:
    if "<" in path:  # a pattern: tests/unit/<package> means some folder there
        head = path.split("<")[0].rstrip("/")
        return (ROOT / head).is_dir() and any((ROOT / head).iterdir())
    if any(ch in path for ch in "*?["):
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def test_every_path_the_map_names_exists():
    paths = named_paths(DOC.read_text(encoding="utf-8"))
    assert len(paths) > 40  # the map names the module of every step
    assert [path for path in paths if not exists(path)] == []


def test_every_app_package_is_on_the_map():
    named = set(named_paths(DOC.read_text(encoding="utf-8")))
    packages = sorted(f"app/{init.parent.name}" for init in (ROOT / "app").glob("*/__init__.py"))
    missing = [package for package in packages
               if not any(path == package or path.startswith(package + "/") for path in named)]
    assert missing == []


def test_the_checks_can_fail():
    assert not exists("app/no_such_module.py")
    assert named_paths("see `app/engine/batcher.py` and `app/gates/`, not app/x") == [
        "app/engine/batcher.py", "app/gates"]


def gate_modules() -> list[str]:
    """The modules of the ASGI layers ``gates()`` builds, in its order (read from the
    source: the classes it wraps in ``Middleware`` and where ``server.py`` imports them)."""
    server = ROOT / "app" / "http" / "server.py"
    tree = ast.parse(server.read_text(encoding="utf-8"))
    home = {alias.asname or alias.name: node.module for node in tree.body
            if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
    gates = next(node for node in tree.body
                 if isinstance(node, ast.FunctionDef) and node.name == "gates")
    calls = sorted((node for node in ast.walk(gates) if isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name) and node.func.id == "Middleware"),
                   key=lambda node: (node.lineno, node.col_offset))
    names = [call.args[0].id for call in calls if isinstance(call.args[0], ast.Name)]
    return [home[name] for name in names]


def test_the_maps_gate_rows_follow_gates():
    text = DOC.read_text(encoding="utf-8")
    modules = gate_modules()
    assert len(modules) >= 5
    places = []
    for module in modules:
        if module.startswith("starlette"):
            needle = "Starlette's `CORSMiddleware`"
        else:
            needle = f"`{module.replace('.', '/')}.py`"
        assert needle in text, needle
        places.append(text.index(needle))
    assert places == sorted(places)
