<#
.SYNOPSIS
    Build vramguard for Windows: the bundle (dist\vramguard) and its installer
    (dist\installer\vramguard-<version>-setup.exe and its .partN.bin files).

.DESCRIPTION
    A thin wrapper: it makes a build environment, installs torch from PyTorch's own
    index (PyPI's Windows torch has no CUDA), and runs packaging\build.py and
    installer\build_installer.py, where all the build logic lives.
    Needs Python 3.11 (the "py" launcher's, or the one -Python names) and, for the
    installer, NSIS 3 (winget install NSIS.NSIS).
    Windows' default execution policy runs no script; start this one with
    powershell -ExecutionPolicy Bypass -File .\build.ps1, which allows this one run
    and changes no setting.

.PARAMETER Python
    The python.exe (3.11) that makes the build environment; by default the py
    launcher's 3.11. The Windows workflow passes the one setup-python installed.

.PARAMETER Cpu
    Build with CPU-only torch: a much smaller bundle that never uses the GPU.

.PARAMETER NoInstaller
    Stop after the bundle; do not compile the installer.

.PARAMETER Compressor
    lzma (smallest download, the default) or zlib (several times faster to build).

.PARAMETER PartSizeMB
    Most MiB of the bundle in each installer file (default: the installer's 1.5 GiB).
    The CI uses small parts so that even the CPU build comes in several.

.EXAMPLE
    powershell -ExecutionPolicy Bypass -File .\build.ps1
    powershell -ExecutionPolicy Bypass -File .\build.ps1 -Cpu -NoInstaller
    powershell -ExecutionPolicy Bypass -File .\build.ps1 -Python C:\Python311\python.exe
#>
[CmdletBinding()]
param(
    [string]$Python = "",
    [switch]$Cpu,
    [switch]$NoInstaller,
    [ValidateSet("lzma", "zlib")]
    [string]$Compressor = "lzma",
    [int]$PartSizeMB = 0
)

$ErrorActionPreference = "Stop"
Set-StrictMode -Version Latest

# torch and torchvision: the same versions as pyproject.toml (a test checks they agree).
$TorchVersion = "2.14.1"
$TorchvisionVersion = "0.29.1"
# Each flavour has its own venv and pins its local version: "torch==2.14.1" alone is
# satisfied by 2.14.1+cpu, so a shared venv shipped whichever flavour it had first.
$Flavour = if ($Cpu) { "cpu" } else { "cu130" }
$TorchIndex = "https://download.pytorch.org/whl/$Flavour"

$Root = $PSScriptRoot
$Venv = Join-Path $Root ".venv-build-$Flavour"
$VenvPython = Join-Path $Venv "Scripts\python.exe"

# Runs a native program and judges it by its exit code alone. Windows PowerShell 5.1
# turns each line such a program writes to stderr into an error when output is
# redirected, and "Stop" would end the build at pip's first warning.
function Invoke-Step {
    param([string]$What, [scriptblock]$Command)
    Write-Host "==> $What"
    $ErrorActionPreference = "Continue"
    $global:LASTEXITCODE = $null
    & $Command 2>&1 | ForEach-Object { "$_" }
    if ($null -eq $LASTEXITCODE) {
        throw "build.ps1: '$What' did not start"
    }
    if ($LASTEXITCODE -ne 0) {
        throw "build.ps1: '$What' failed (exit code $LASTEXITCODE)"
    }
}

Push-Location $Root
try {
    if (-not (Test-Path $VenvPython)) {
        if ($Python) {
            Invoke-Step "Create the build environment with $Python" { & $Python -m venv $Venv }
        }
        else {
            Invoke-Step "Create the build environment (Python 3.11)" { py -3.11 -m venv $Venv }
        }
    }
    Invoke-Step "Update pip" { & $VenvPython -m pip install --upgrade pip }
    Invoke-Step "Install torch $TorchVersion+$Flavour from $TorchIndex" {
        & $VenvPython -m pip install "torch==$TorchVersion+$Flavour" "torchvision==$TorchvisionVersion+$Flavour" --index-url $TorchIndex
    }
    Invoke-Step "Install vramguard and PyInstaller" { & $VenvPython -m pip install -e ".[package]" }

    $BuildArgs = @("packaging\build.py")
    if ($Cpu) { $BuildArgs += "--cpu-only" }
    Invoke-Step "Build and check the bundle" { & $VenvPython @BuildArgs }

    if ($NoInstaller) {
        Write-Host "Bundle: $(Join-Path $Root 'dist\vramguard')"
        return
    }
    $Makensis = Get-Command makensis -ErrorAction SilentlyContinue
    if (-not $Makensis) {
        $Candidate = Join-Path ${env:ProgramFiles(x86)} "NSIS\makensis.exe"
        if (-not (Test-Path $Candidate)) {
            throw "build.ps1: NSIS not found. Install it (winget install NSIS.NSIS) or use -NoInstaller."
        }
        $env:PATH = "$(Split-Path $Candidate);$env:PATH"
    }
    $InstallerArgs = @("installer\build_installer.py", "--bundle", "dist\vramguard",
        "--out", "dist\installer", "--compressor", $Compressor,
        "--icon", "build\pyinstaller\vramguard.ico")
    # The comma binds tighter than "*" in PowerShell: the product needs its brackets.
    if ($PartSizeMB) { $InstallerArgs += @("--part-size", ($PartSizeMB * 1MB)) }
    Invoke-Step "Compile the installer" { & $VenvPython @InstallerArgs }
    Write-Host "Installer: $(Join-Path $Root 'dist\installer') (ship the setup and its .bin parts together)"
}
finally {
    Pop-Location
}
