"""An engine's ``--config FILE.yaml``: a YAML of its own flags, put before the line's flags so the
command line wins over the file and the file over the defaults — vLLM's
(``FlexibleArgumentParser._pull_args_from_config`` / ``load_config_file``,
vllm/utils/argparse_utils.py:479-636@v0.32.0) and SGLang's (``ConfigArgumentMerger``,
sglang/srt/utils/server_args_config_parser.py@v0.5.23).

Each key becomes the words its engine makes of it — a list ``--key a b``, a mapping ``--key JSON``
(a JSON flag: vLLM's ``speculative-config: {method: mtp, ...}``), anything else ``--key VALUE``;
``true`` a bare ``--key``, ``false`` vLLM's ``--no-key`` where its parser has one and nothing for
SGLang's ``store_true`` switches — and is read as that flag, shown ``FILE:key``. A key the command
line also gives is a no-op that names the flag that won. A file that is not there is a warning on
the ``--config`` row and an unread path (``tailserve simulate`` then stops: the file's flags would
be missing); one that is not a YAML mapping, or not ``.yaml`` / ``.yml`` (both engines refuse it),
is one ``ValueError`` line.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from tailserve.engines.command import GivenFlag, Launch, read_flags
from tailserve.engines.flag_spec import EngineVersion


def with_config_file(
    flags: list[GivenFlag], launch: Launch, version: EngineVersion
) -> tuple[list[GivenFlag], list[GivenFlag], str | None, list[str]]:
    """(the file's flags, the command line's flags, the path when it is not there, the keys
    the engine's reader drops: vLLM 0.8.5 reads only true switches). The file's come first:
    the engines put them before the line's, whose later values win."""
    named = [flag for flag in flags if flag.option == "--config"]
    if not version.config_file or not named or named[-1].value is None:
        return [], flags, None, []
    text = named[-1].value
    path = Path(os.path.expanduser(text))
    if path.suffix not in (".yaml", ".yml"):
        raise ValueError(
            f"--config {text}: {version.engine} reads a .yaml or .yml file of its flags, not {path.suffix or 'this'}"
        )
    if not path.is_file():
        return [], flags, text, []
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"--config {text}: not YAML: {str(e).splitlines()[0]}") from None
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise ValueError(
            f"--config {text}: not a mapping of the engine's flags (got {type(config).__name__})"
        )
    known = version.known_options()
    found: list[GivenFlag] = []
    dropped: list[str] = []
    for key, value in config.items():
        words = _words(str(key), value, known, version.config_file)
        if not words:
            if version.config_file == "vllm-0.8":
                dropped.append(f"{path.name}:{key}")
            continue  # ``false`` for a switch without a --no- spelling: nothing added
        _, read = read_flags(replace(launch, env=(), words=tuple(words)), version)
        found.extend(replace(flag, typed=f"{path.name}:{key}") for flag in read)
    return found, flags, None, dropped


def _words(key: str, value: Any, known: frozenset[str], reader: str) -> list[str]:
    """The words the engine makes of one key (vLLM's ``load_config_file``, 0.8.5's
    ``_load_config_file``, SGLang's ``_convert_config_to_args``)."""
    option = "--" + key
    if isinstance(value, bool):
        if value:
            return [option]
        # vLLM 0.11+: the parser's own --no- spelling of a switch that defaults on
        # (BooleanOptionalAction); SGLang's switches are store_true and vLLM 0.8.5 reads only
        # true switches (utils.py:1497-1500@v0.8.5): false adds nothing
        return ["--no-" + key] if reader == "vllm" and "--" + key.replace("_", "-") in known else []
    if reader == "vllm-0.8":
        return [option, str(value)]  # every other value as its text (a mapping as Python's repr)
    if isinstance(value, list):
        return [option, *map(str, value)] if value else []
    if isinstance(value, dict):
        return [option, json.dumps(value)]
    return [option, str(value)]
