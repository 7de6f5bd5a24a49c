"""The `vramguard` command line: its options and which command runs what."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from app import __version__
from app.cli.models_command import add_models_parser, run_models
from app.cli.serve_options import add_setting_options
from app.config import ConfigError, Settings, config_file_in_use, load_settings

COMMON = ("model", "weights", "device")  # settings every command takes as options


def _add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, metavar="PATH", help="TOML config file "
                        "(default: the per-user config.toml, or VRAMGUARD_CONFIG).")


def _add_common(parser: argparse.ArgumentParser) -> None:
    _add_config(parser)
    add_setting_options(parser, COMMON)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vramguard", description="Local image "
                                     "classification that never runs out of GPU memory.")
    parser.add_argument("--version", action="version", version=f"vramguard {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", help="Run the HTTP server (no tray icon).",
        usage="vramguard serve [--config PATH] [--SETTING VALUE ...]",
        description="Run the HTTP server (no tray icon). Every setting is an option; each "
        "is also the environment variable VRAMGUARD_<NAME> (VRAMGUARD_CLASSIFY_BURST=200) "
        "and the line '<name> = value' in the config file (classify_burst = 200); an "
        "option wins over both. Lists are comma-separated (--cors-origins "
        "http://localhost:3000,http://localhost:5173); sizes take units (--max-body-bytes "
        "64MiB).")
    _add_config(serve)
    add_setting_options(serve.add_argument_group("settings"))
    serve.add_argument("--launched-by", type=int, help=argparse.SUPPRESS)  # set by `run`

    tray = commands.add_parser("tray", help="Show the tray icon for a running server.")
    _add_common(tray)
    add_setting_options(tray, ("port",))
    run = commands.add_parser("run", help="Start the server and the tray icon (the desktop "
                              "shortcut); without a display, just the server.")
    _add_common(run)
    add_setting_options(run, ("port",))
    run.add_argument("--keep-server", action="store_true",
                     help="Keep the server running when the tray ends (Quit, or the "
                     "launcher being ended); stop it later with `vramguard stop`.")

    doctor = commands.add_parser("doctor", help="Check torch, the GPU and the model.")
    _add_common(doctor)
    stop = commands.add_parser("stop", help="Stop the running vramguard (all of this user's, "
                               "or the one on --port); the installer uses it.")
    _add_common(stop)
    stop.add_argument("--port", type=int, help="Stop only the server on this port.")
    stop.add_argument("--timeout-s", type=float, default=30.0,
                      help="How long to let it finish queued work before ending it.")
    _add_classify(commands)
    add_models_parser(commands, _add_models_dir)
    return parser


def _add_models_dir(parser: argparse.ArgumentParser) -> None:
    _add_config(parser)
    add_setting_options(parser, ("models_dir",))


def _add_classify(commands: Any) -> None:
    """`vramguard classify` (a client of the appliance: ``app.cli_classify``, imported only
    when it runs, so that the server starts without its imports)."""
    parser = commands.add_parser(
        "classify", help="Tag image files and folders through the running vramguard "
        "(started for the run if none is).",
        description="Tag image files and folders: one result per image on stdout as it "
        "arrives, progress on stderr. Folders give their image files (jpg, png, webp, bmp, "
        "gif, tif); named files are sent whatever their name. Exit status: 0, or 1 with "
        "--strict when an image failed or could not be read; 1 when no vramguard could be "
        "reached or started; 2 for a usage error (an unknown model too); 130 after "
        "Ctrl-C.")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="Image files and folders.")
    parser.add_argument("-r", "--recursive", action="store_true",
                        help="Also tag the images in the folders' subfolders.")
    parser.add_argument("--model", help="Model to use (GET /v1/models lists them); the "
                        "appliance's default if omitted.")
    parser.add_argument("--top-k", type=_top_k, default=5, metavar="K",
                        help="Classes per image (1-1000, default 5).")
    formats = parser.add_mutually_exclusive_group()
    formats.add_argument("--json", action="store_true",
                         help="One JSON object per line: path, model, predictions, cached.")
    formats.add_argument("--csv", action="store_true",
                         help="CSV with a header: path, model, label_N and score_N, error.")
    parser.add_argument("--embed", action="store_true",
                        help="Also each image's features (1280 numbers for the default "
                        "model), for finding similar images.")
    parser.add_argument("--strict", action="store_true",
                        help="Exit with status 1 if any image failed or could not be read.")
    parser.add_argument("--url", help="The appliance's address (default: the running "
                        "vramguard, found as every client finds it).")


def _top_k(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 1000:
        raise argparse.ArgumentTypeError("K is 1 to 1000")
    return value


# options that are not settings
CLI_ONLY = ("command", "config", "timeout_s", "launched_by", "keep_server", "action", "path",
            "name")


def _settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {key: value for key, value in vars(args).items()
                                 if key not in CLI_ONLY}
    return load_settings(args.config, **overrides)


def windowed_main(argv: list[str]) -> int:
    """The windowed program's entry (no console): an exception that escapes is logged and
    ends it with status 1, instead of reaching PyInstaller's modal traceback dialog."""
    try:
        return main(argv or ["run"])
    except Exception:
        logging.getLogger("vramguard").exception("vramguard stopped because of an "
                                                 "unexpected problem")
        return 1


def main(argv: list[str] | None = None) -> int:
    """The console program. A reader that stops early (``vramguard models list | head -1``)
    ends it quietly with status 1, not a traceback."""
    try:
        return _command(argv)
    except BrokenPipeError:
        # Python's advice: stdout to devnull, so that the flush at exit raises nothing more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _command(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "classify":  # a client of the appliance: no settings of its own
        from app.cli.classify import run_classify  # vramguard_client ships with vramguard

        return run_classify(args)
    try:
        settings = _settings(args)
    except ConfigError as exc:
        print(f"vramguard: {exc}", file=sys.stderr)
        return 2
    if args.command == "models":
        return run_models(args, settings)
    from app.cli.process_control import serve, stop, tray_command

    if args.command == "serve":
        return serve(settings, args.launched_by)
    if args.command == "stop":
        return stop(settings, args.port, args.timeout_s)
    if args.command in ("tray", "run"):
        return tray_command(settings, start_server=args.command == "run", argv=argv,
                            keep_server=getattr(args, "keep_server", False))
    from app.cli.doctor import run_doctor

    return run_doctor(settings, config_file_in_use(args.config))
