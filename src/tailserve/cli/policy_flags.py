"""Policy flags on the command line by their engine's names (``--max-num-batched-tokens 512
--no-enable-chunked-prefill``), for the commands that take one policy (simulate, serve, run)."""

from __future__ import annotations

import typing

from tailserve.cli.base import CliError


def parse_policy_flags(extra: list[str], policy: str | None = None) -> dict[str, str]:
    """``--max-num-batched-tokens 512 --no-enable-chunked-prefill`` -> {name: value}.

    With ``policy``, each name is checked against that policy's flags (and the engine-wide
    ones): an unknown one is an unrecognized argument of the command, and a flag that takes a
    value but has none says so, instead of failing later on a converted ``true``."""
    flags: dict[str, str] = {}
    bare: set[str] = set()  # flags given without a value
    i = 0
    while i < len(extra):
        token = extra[i]
        if not token.startswith("--"):
            raise CliError(f"unrecognized argument {token}")
        name, eq, value = token[2:].partition("=")
        if not eq:
            if name.startswith("no-"):
                name, value = name[3:], "false"
            elif i + 1 < len(extra) and not extra[i + 1].startswith("--"):
                value = extra[i + 1]
                i += 1
            else:
                value = "true"
                bare.add(name.replace("-", "_"))
        flags[name.replace("-", "_")] = value
        i += 1
    if policy is not None:
        _check_policy_flags(policy, flags, bare)
    return flags


def _check_policy_flags(policy: str, flags: dict[str, str], bare: set[str]) -> None:
    from tailserve.policies.registry import ENGINE_FLAGS, get_policy_cls, policy_flags, resolve_policy_name

    name = resolve_policy_name(policy)
    known = {**policy_flags(get_policy_cls(name)), **ENGINE_FLAGS}
    for flag in flags:
        option = "--" + flag.replace("_", "-")
        if flag not in known:
            raise CliError(
                f"unrecognized argument {option} (not an option of this command, nor a flag of "
                f"policy {name}; `tailserve policies` lists each policy's flags)"
            )
        kind = known[flag]
        if flag in bare and kind is not bool and bool not in typing.get_args(kind):
            kinds = [k for k in typing.get_args(kind) or (kind,) if k is not type(None)]
            kind_name = " or ".join(getattr(k, "__name__", str(k)) for k in kinds)
            raise CliError(f"policy flag {option} needs a value ({kind_name}), e.g. {option} VALUE")
