"""build.ps1 checked as text (no PowerShell can run here): it tokenizes, its brackets
balance, every variable it reads is set (it runs under Set-StrictMode), every native
step is checked, and it names the torch versions pyproject.toml pins."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version

from live_server import ROOT

SCRIPT = ROOT / "build.ps1"
PAIRS = {")": "(", "}": "{", "]": "["}
AUTOMATIC = {"$true", "$false", "$null", "$LASTEXITCODE", "$PSScriptRoot", "$_"}


def tokens(text: str) -> list[tuple[str, str]]:
    """(kind, text) for PowerShell's comments, strings, variables and brackets."""
    pattern = re.compile(r"""
        (?P<block><\#.*?\#>) | (?P<comment>\#[^\n]*) |
        (?P<dq>"(?:`.|[^"`])*") | (?P<sq>'[^']*') |
        (?P<var>\$\{[^}]+\}|\$[A-Za-z_][\w:]*) | (?P<bracket>[(){}\[\]]) | (?P<other>.)
        """, re.S | re.X)
    found = []
    for match in pattern.finditer(text):
        kind = match.lastgroup
        assert kind is not None
        if kind == "dq":  # variables inside double-quoted strings are read too
            found += [("var", v) for v in re.findall(r"\$[A-Za-z_][\w:]*", match.group())]
        found.append((kind, match.group()))
    return found


def test_build_ps1_tokenizes_and_its_brackets_balance():
    text = SCRIPT.read_text(encoding="utf-8")
    assert text.count('"') % 2 == 0 or "`\"" in text
    stack: list[str] = []
    for kind, value in tokens(text):
        if kind != "bracket":
            continue
        if value in PAIRS:
            assert stack and stack.pop() == PAIRS[value], f"unbalanced {value}"
        else:
            stack.append(value)
    assert not stack, f"unclosed {stack}"


def test_every_variable_read_is_set_first():
    text = SCRIPT.read_text(encoding="utf-8")
    found = tokens(text)
    params = set(re.findall(r"\[(?:switch|string)\]\s*(\$\w+)", text))
    assigned = set(re.findall(r"(\$\w+)\s*(?:\+)?=", text)) | params
    assigned |= set(re.findall(r"param\(\[string\](\$\w+), \[scriptblock\](\$\w+)\)", text)[0])
    read = {value for kind, value in found if kind == "var"
            and not value.startswith(("${env:", "$env:"))}
    assert read - assigned - AUTOMATIC == set()


def test_native_steps_are_checked_and_strict_mode_is_on():
    text = SCRIPT.read_text(encoding="utf-8")
    assert '$ErrorActionPreference = "Stop"' in text and "Set-StrictMode -Version Latest" in text
    assert "if ($LASTEXITCODE -ne 0)" in text
    # Every call of the build Python happens inside an Invoke-Step block.
    for line in text.splitlines():
        if "& $Python" in line and "Invoke-Step" not in line:
            assert line.startswith("        ")  # the body of an Invoke-Step script block
    for step in ("packaging\\build.py", "installer\\build_installer.py", "--cpu-only",
                 "py -3.11 -m venv", 'pip install -e ".[package]"'):
        assert step in text


def test_build_ps1_names_the_versions_pyproject_pins():
    text = SCRIPT.read_text(encoding="utf-8")
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "dependencies"]
    pins = dict(re.fullmatch(r"(torch|torchvision)==([\d.]+)", dependency).groups()
                for dependency in dependencies
                if re.fullmatch(r"(torch|torchvision)==[\d.]+", dependency))
    assert set(pins) == {"torch", "torchvision"}
    assert f'$TorchVersion = "{pins["torch"]}"' in text
    assert f'$TorchvisionVersion = "{pins["torchvision"]}"' in text
    # The CUDA flavour matches the wheels this machine tests with (e.g. 2.14.1+cu130).
    local = version("torch").partition("+")[2]
    if local.startswith("cu"):
        assert f"https://download.pytorch.org/whl/{local}" in text


def test_the_workflow_runs_build_ps1_and_the_smoke_test():
    import yaml

    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "windows.yml").read_text())
    steps = workflow["jobs"]["build"]["steps"]
    assert workflow["jobs"]["build"]["runs-on"] == "windows-latest"
    commands = "\n".join(step.get("run", "") for step in steps)
    assert "./build.ps1" in commands and "packaging\\smoke.py" in commands
    assert "/S" in commands and "uninstall.exe" in commands
