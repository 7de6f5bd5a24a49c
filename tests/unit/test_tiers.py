"""The tiers hold: no test in a fast folder (``unit/``, ``inprocess/``) is marked ``slow``,
and every folder of tests/ that holds test files is a tier tests/conftest.py knows. Read
from the files themselves (``ast``), without running pytest."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def _conftest_value(name: str) -> object:
    """A module-level constant of tests/conftest.py (``TIER_MARKERS``, ``FAST_TIERS``),
    evaluated from its source: the tiers are defined there, once."""
    tree = ast.parse((TESTS / "conftest.py").read_text())
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == name):
            if (isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                    and node.value.func.id == "frozenset"):  # frozenset({...})
                return frozenset(ast.literal_eval(node.value.args[0]))
            return ast.literal_eval(node.value)
    raise AssertionError(f"tests/conftest.py defines no {name}")


FAST_TIERS = _conftest_value("FAST_TIERS")
TIER_MARKERS = _conftest_value("TIER_MARKERS")


def _names_slow(node: ast.AST) -> bool:
    """Whether a decorator or a ``pytestmark`` value is or holds ``pytest.mark.slow``
    (also called, as in ``pytest.mark.slow(reason=...)``, or inside a list)."""
    return any(isinstance(part, ast.Attribute) and part.attr == "slow" and (
        (isinstance(part.value, ast.Attribute) and part.value.attr == "mark")
        or (isinstance(part.value, ast.Name) and part.value.id == "mark"))
        for part in ast.walk(node))


def slow_marks(source: str) -> list[str]:
    """Where a module marks tests slow: a ``pytestmark`` that holds ``slow``, and each test
    function or class decorated with it (with a parameter's ``marks=`` too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if (any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets)
                    and node.value is not None and _names_slow(node.value)):
                found.append(f"line {node.lineno}: pytestmark")
        elif (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
              and any(_names_slow(decorator) for decorator in node.decorator_list)):
            found.append(f"line {node.lineno}: {node.name}")
    return found


def test_the_tiers_are_read_from_the_conftest():
    assert {"unit", "inprocess"} == FAST_TIERS
    assert isinstance(TIER_MARKERS, dict) and "live" in TIER_MARKERS
    assert all("slow" in markers for markers in TIER_MARKERS.values())


@pytest.mark.parametrize("tier", sorted(FAST_TIERS))
def test_no_test_in_a_fast_folder_is_marked_slow(tier):
    files = sorted((TESTS / tier).rglob("test_*.py"))
    assert files, f"tests/{tier}/ holds no tests"
    marked = {str(path.relative_to(TESTS)): where for path in files
              if (where := slow_marks(path.read_text()))}
    assert not marked, (f"slow tests in the fast tier (move them to tests/live/, where the "
                        f"path marks them): {marked}")


def test_every_folder_with_tests_is_a_tier():
    folders = {path.relative_to(TESTS).parts[0] for path in TESTS.rglob("test_*.py")
               if len(path.relative_to(TESTS).parts) > 1}
    assert folders - (set(FAST_TIERS) | set(TIER_MARKERS)) == set()
    assert not list(TESTS.glob("test_*.py")), "a test file outside every tier"


@pytest.mark.parametrize("planted", [
    pytest.param("@pytest.mark.slow\ndef test_x():\n    pass\n", id="decorator"),
    pytest.param("@pytest.mark.slow  # why\nasync def test_x():\n    pass\n", id="async"),
    pytest.param("@pytest.mark.slow(reason='model')\ndef test_x():\n    pass\n", id="called"),
    pytest.param("from pytest import mark\n@mark.slow\ndef test_x():\n    pass\n", id="mark"),
    pytest.param("pytestmark = pytest.mark.slow\n", id="pytestmark"),
    pytest.param("pytestmark = [pytest.mark.anyio, pytest.mark.slow]\n", id="in-a-list"),
    pytest.param("import pytest as p\npytestmark: list = [p.mark.slow]\n", id="annotated"),
    pytest.param("class TestX:\n    @pytest.mark.slow\n    def test_x(self):\n        pass\n",
                 id="method"),
    pytest.param("@pytest.mark.parametrize('n', [pytest.param(1, marks=pytest.mark.slow)])\n"
                 "def test_x(n):\n    pass\n", id="param-marks"),
])
def test_the_scan_finds_a_planted_slow_mark(planted):
    assert slow_marks(planted)


@pytest.mark.parametrize("clean", [
    pytest.param("pytestmark = pytest.mark.anyio\n", id="anyio"),
    pytest.param("@pytest.mark.skipif(True, reason='slow machine')\ndef test_slow_path():\n"
                 "    pass\n", id="the-word-elsewhere"),
    pytest.param("def test_x():\n    slow = 1\n", id="a-variable"),
])
def test_the_scan_leaves_other_marks_alone(clean):
    assert slow_marks(clean) == []


def test_no_two_test_files_share_a_name():
    """The test folders are not packages: pytest imports each file under its bare name, so
    a second tests/…/test_x.py stops the whole run at collection (CI stopped so once),
    while running either folder alone passes."""
    seen: dict[str, Path] = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a name"
        seen[path.name] = path


def test_every_test_that_starts_servers_is_in_one_lane_and_the_bundle_in_another():
    """The lanes pytest-xdist's two workers run (tests/conftest.py): every live, desktop
    and cluster test in one, so that no two of them ever run at once; the packaging tier
    in the other; a fast test's unit is its file."""
    # Loaded by path: under xdist, ``import conftest`` finds whichever tier's conftest
    # is first on sys.path (tests/desktop/conftest.py was seen).
    spec = importlib.util.spec_from_file_location("suite_conftest", TESTS / "conftest.py")
    assert spec is not None and spec.loader is not None
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    lane_of = suite.lane_of

    assert lane_of("tests/live/test_api.py::test_x[a::b]") == "servers"
    assert lane_of("tests/desktop/test_desktop.py::test_y") == "servers"
    assert lane_of("tests/cluster/test_cluster.py::test_z") == "servers"
    assert lane_of("tests/packaging/test_installer.py::test_w") == "packaging"
    assert lane_of("tests/unit/tray/test_tray_app.py::test_v") == \
        "tests/unit/tray/test_tray_app.py"
    assert lane_of("tests/inprocess/test_oip.py::test_u") == "tests/inprocess/test_oip.py"
    assert set(_conftest_value("LANES")) == set(TIER_MARKERS)  # every slow tier has a lane
