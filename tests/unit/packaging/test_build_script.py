"""build.ps1 checked as text (no PowerShell can run here): it tokenizes, its brackets
balance, every variable it reads is set (it runs under Set-StrictMode), every native
step is judged by its exit code alone, each torch flavour has its own venv and local
version, and it names the torch versions pyproject.toml pins. The Windows workflow,
which cannot run here either, is checked for the steps it must have."""

from __future__ import annotations

import re
import tomllib

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
    params = set(re.findall(r"\[(?:switch|string|int)\]\s*(\$\w+)", text))
    assigned = set(re.findall(r"(\$[\w:]+)\s*(?:\+)?=", text)) | params
    assigned |= set(re.findall(r"param\(\[string\](\$\w+), \[scriptblock\](\$\w+)\)", text)[0])
    read = {value for kind, value in found if kind == "var"
            and not value.startswith(("${env:", "$env:"))}
    assert read - assigned - AUTOMATIC == set()


def outside_steps(text: str) -> str:
    """The script without the script blocks given to Invoke-Step."""
    while (start := text.find("Invoke-Step \"")) >= 0:
        depth = 0
        for end in range(text.index("{", start), len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                break
        text = text[:start] + text[end + 1:]
    return text


def test_native_steps_are_judged_by_exit_code_not_by_stderr():
    """Windows PowerShell 5.1 under "Stop", with output redirected, ends the script at a
    native tool's first stderr line (a pip warning): the helper relaxes that for the
    native step and judges it by $LASTEXITCODE."""
    text = SCRIPT.read_text(encoding="utf-8")
    assert '$ErrorActionPreference = "Stop"' in text and "Set-StrictMode -Version Latest" in text
    helper = re.search(r"function Invoke-Step \{(.*?)\n\}", text, re.S)
    assert helper, "no Invoke-Step helper"
    body = helper.group(1)
    relaxed = body.index('$ErrorActionPreference = "Continue"')
    assert relaxed < body.index("& $Command 2>&1") < body.index("if ($LASTEXITCODE -ne 0)")
    rest = outside_steps(text.replace(helper.group(0), ""))
    for native in ("& $Python", "& $VenvPython", "py -3.11", "makensis"):
        assert native in text
        assert not re.search(rf"^\s*{re.escape(native)}", rest, re.M), native
    for step in ("packaging\\build.py", "installer\\build_installer.py", "--cpu-only",
                 "py -3.11 -m venv", 'pip install -e ".[package]"'):
        assert step in text


def test_each_torch_flavour_has_its_own_venv_and_its_local_version_pinned():
    """torch==2.14.1 is satisfied by 2.14.1+cpu: a shared venv let flavours leak."""
    text = SCRIPT.read_text(encoding="utf-8")
    assert '$Flavour = if ($Cpu) { "cpu" } else { "cu130" }' in text
    assert '$Venv = Join-Path $Root ".venv-build-$Flavour"' in text
    assert '"torch==$TorchVersion+$Flavour"' in text
    assert '"torchvision==$TorchvisionVersion+$Flavour"' in text
    assert '$TorchIndex = "https://download.pytorch.org/whl/$Flavour"' in text


def test_the_readme_gives_the_invocation_the_execution_policy_allows():
    """Windows' default execution policy runs no script; -ExecutionPolicy Bypass on the
    command line allows this one run without changing the machine's policy."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "powershell -ExecutionPolicy Bypass -File .\\build.ps1" in readme
    assert "powershell -ExecutionPolicy Bypass -File .\\build.ps1" in SCRIPT.read_text()


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
    # The CUDA flavour matches the wheels this machine tests with (CUDA 13.0: cu130).
    import torch

    if torch.version.cuda:
        assert f'else {{ "cu{torch.version.cuda.replace(".", "")}" }}' in text


def workflow_steps(job: str = "build") -> list[dict[str, str]]:
    import yaml

    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "windows.yml").read_text())
    assert workflow["jobs"][job]["runs-on"] == "windows-latest"
    return workflow["jobs"][job]["steps"]


def step_running(steps: list[dict[str, str]], *needles: str) -> int:
    """The index of the first step whose command contains every needle."""
    for index, step in enumerate(steps):
        if all(needle in step.get("run", "") for needle in needles):
            return index
    raise AssertionError(f"no workflow step runs all of {needles}")


def test_the_workflow_builds_the_way_the_readme_says_in_several_parts():
    steps = workflow_steps()
    build = steps[step_running(steps, "build.ps1")]
    # cmd's "powershell" is Windows PowerShell 5.1, output redirected: the case that broke.
    assert build["shell"] == "cmd"
    assert re.search(r"^powershell -NoProfile -ExecutionPolicy Bypass -File \.\\build\.ps1 "
                     r"(-Python \"[^\"]+\" )?-Cpu .*-PartSizeMB \d+", build["run"])
    step_running(steps, "vramguard-*-setup.part*.bin", "throw")
    step_running(steps, ".venv-build-cpu\\Scripts\\python.exe packaging\\smoke.py")


def test_the_workflow_stops_upgrades_over_autostart_and_meets_a_busy_port():
    steps = workflow_steps()
    install = step_running(steps, '"/S", "/AUTOSTART"', "no autostart after /AUTOSTART")
    stop = step_running(steps, "vramguard-desktop.exe", "/readyz", ") stop",
                        "Get-Process vramguard, vramguard-desktop", "after vramguard stop")
    upgrade = step_running(steps, '-ArgumentList "/S" -Wait', "the upgrade dropped autostart",
                           "the old copy was not stopped")
    files = step_running(steps, "files.sha256", "Get-FileHash")
    busy = step_running(steps, "TcpListener", "8765", "vramguard-desktop.exe",
                        "Port 8765 is used by another program", "against a busy port")
    doctor = step_running(steps, ") doctor")
    uninstall = step_running(steps, "uninstall.exe", "/REMOVEDATA", "autostart entry")
    assert install < stop <= upgrade < files < busy < uninstall and doctor < uninstall


def test_build_ps1_takes_the_python_to_build_with():
    """Issue 27, item 7e: -Python names the interpreter that makes the build venv; without
    it the py launcher's 3.11, as before."""
    text = SCRIPT.read_text(encoding="utf-8")
    assert '[string]$Python = ""' in text
    assert re.search(r"if \(\$Python\) \{\s*Invoke-Step [^{]*\{ & \$Python -m venv \$Venv \}",
                     text)
    assert "$VenvPython = Join-Path $Venv" in text


def test_the_workflow_builds_with_its_python_and_once_the_release_way():
    """-Python with setup-python's interpreter in both jobs; the release build uses the
    defaults build.ps1 ships with (CUDA, LZMA, 1.5 GiB parts) and checks it got parts."""
    for job in ("build", "release-build"):
        steps = workflow_steps(job)
        assert any(step.get("id") == "python" and "setup-python" in step.get("uses", "")
                   for step in steps)
        step_running(steps, "build.ps1", '-Python "${{ steps.python.outputs.python-path }}"')
    release = workflow_steps("release-build")
    build = release[step_running(release, "build.ps1")]["run"]
    assert not re.search(r"-Cpu|-Compressor|-PartSizeMB", build), build
    step_running(release, "vramguard-*-setup.part*.bin", "throw")


def test_the_workflow_shows_the_first_day_items_on_windows():
    """Issue 27: the launcher's log (item 3), two launches 0.5 s apart giving one server
    (item 4), a launcher ended from Task Manager taking its server (the job object) and
    `vramguard stop` ending the server before its launcher (item 6)."""
    steps = workflow_steps()
    install = step_running(steps, '"/S", "/AUTOSTART"')
    twice = step_running(steps, "Start-Process $desktop", "Start-Sleep -Milliseconds 500",
                         "--launched-by", "$servers.Count -ne 1", "$launchers.Count -ne 1")
    log = step_running(steps, "vramguard-tray*.log", "throw")
    killed = step_running(steps, "Stop-Process -Id $launchers[0].ProcessId -Force",
                          "the server outlived its launcher")
    order = step_running(steps, ") stop", "$server.ExitTime -gt $launcher.ExitTime",
                         "$launcher.ExitCode -ne 0")
    uninstall = step_running(steps, "uninstall.exe")
    assert install < twice <= log <= killed < order < uninstall
