"""Command-line options made from the settings, so that each setting of `Settings` is an
option of `vramguard serve` without a line of its own here.

The rule: the setting `max_batch_size` is `--max-batch-size VALUE`, with the setting's
description as its help; a true/false setting is a pair, `--cache` / `--no-cache`; a list
setting is comma-separated (`--models a,b`). Values go to `Settings` as they were typed,
so the settings check them as they check VRAMGUARD_* variables and the config file, and
a refusal names the setting. An option not given is None: no override.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Union, get_args, get_origin

from pydantic import ByteSize

from app.config import Settings

METAVARS: dict[Any, str] = {int: "N", float: "N", ByteSize: "SIZE", Path: "PATH"}


def comma_separated(text: str) -> list[str]:
    """``--models a,b``: the names, without blanks."""
    return [name.strip() for name in text.split(",") if name.strip()]


def option_name(setting: str) -> str:
    """``max_batch_size`` → ``--max-batch-size``."""
    return "--" + setting.replace("_", "-")


def _value_type(annotation: Any) -> Any:
    """The type a setting holds, without its ``| None``."""
    if get_origin(annotation) in (Union, types.UnionType):
        kinds = [kind for kind in get_args(annotation) if kind is not type(None)]
        if len(kinds) == 1:
            return kinds[0]
    return annotation


def add_setting_options(parser: argparse._ActionsContainer,
                        names: Iterable[str] | None = None) -> None:
    """Add the options of the settings ``names`` (every setting when None), in the order
    `Settings` lists them."""
    wanted = set(Settings.model_fields) if names is None else set(names)
    for name, field in Settings.model_fields.items():
        if name not in wanted:
            continue
        kind = _value_type(field.annotation)
        flag, text = option_name(name), field.description
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=text)
        elif get_origin(kind) is list:
            parser.add_argument(flag, type=comma_separated, metavar="A,B", help=text)
        else:
            parser.add_argument(flag, metavar=METAVARS.get(kind, "TEXT"), help=text)
