"""Policy flags on the command line by their engine's names (``--max-num-batched-tokens 512
--no-enable-chunked-prefill``), for the commands that take one policy (simulate, serve, run).

They are generated, not written: every field of every registered policy's config dataclass is an
argparse option, in one group per policy (``vllm options``, ``sglang options``, ...) whose help
shows the field's type, its comment (or ``metadata["help"]``) and that policy's default; the
registry's engine-wide flags (``--block-size``, ...) are one more group. A policy added to the
registry appears with its flags without any change here.

A flag several policies share (``--max-num-seqs``) is one option: it parses to the same value
whichever policy is chosen, and it is listed under each of its policies with that policy's
default. Options default to ``argparse.SUPPRESS``, so only the flags given reach the chosen
policy; once ``--policy`` is known, a flag its config lacks is one error line naming the policy
and the flags it takes (``policy_flags_from``). Values are converted as argparse reads them, by
the one converter of config fields (``core/config_flags.py``): ``--max-num-seqs 1e3`` is 1000,
``--max-running-requests none`` unsets an optional one, a bool takes ``--flag``, ``--no-flag``
or ``--flag false``. Names with underscores (``--max_num_seqs``) work as in vLLM.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
from collections.abc import Callable
from typing import Any

from tailserve.cli.base import CliError
from tailserve.core.config_flags import (
    base_kind,
    convert,
    field_choices,
    field_kinds,
    is_bool,
    kind_name,
    number_tuple_item,
)

DEST = "policy_flag:"  # the namespace attribute of a policy flag is DEST + its field name

EPILOG = (
    "Policy flags follow with the engine's own names, e.g. --max-num-batched-tokens 512 "
    "--no-enable-chunked-prefill (vllm), --chunked-prefill-size 1024 (sglang), "
    "--max-batch-prefill-tokens 4096 (tgi); each policy's group above lists its flags; a flag "
    "of another policy than --policy's is an error. A default that depends on the GPU and the "
    "context length is shown by `tailserve policies --hardware H`."
)

# (memory GiB, context) pairs a default is probed at: one that changes is "per GPU and context".
_PROBES = ((24.0, 4096), (80.0, 8192), (80.0, 131072), (141.0, 32768), (192.0, 131072))
PER_DEVICE = "per GPU and context: tailserve policies --hardware H"


class _Bare:
    """The value of a flag given without one."""


class PolicyFlag(argparse.Action):
    """One policy flag: ``--flag VALUE`` / ``--flag=VALUE``, and for a bool also ``--flag``
    (true) and ``--no-flag`` (false). Hidden from the usage line and the plain options list:
    each policy's group shows it (``_Shown``)."""

    def __init__(self, option_strings: list[str], dest: str, kind: Any, choices: Any = None) -> None:
        super().__init__(
            option_strings, dest, nargs="?", const=_Bare, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
        self.kind, self.values = kind, choices
        half = len(option_strings) // 2  # a bool's second half: its --no- spellings
        self.negatives = set(option_strings[half:]) if is_bool(kind) else set()

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        option = option_string or self.option_strings[0]
        if option in self.negatives:
            if values is not _Bare:
                raise argparse.ArgumentError(None, f"policy flag {option} takes no value")
            values = False
        elif values is _Bare:
            if not is_bool(self.kind):
                raise argparse.ArgumentError(
                    None,
                    f"policy flag {option} needs a value ({kind_name(self.kind)}), e.g. {option} VALUE",
                )
            values = True
        else:
            try:
                values = convert(values, self.kind, self.values)
            except ValueError as e:
                raise argparse.ArgumentError(None, f"argument {option}: {e}") from None
        setattr(namespace, self.dest, values)


class _Shown(argparse.Action):
    """A policy flag as its policy's group lists it (never parsed: ``PolicyFlag`` is). Its help
    is written when help is shown: reading the config's source is for ``--help`` only."""

    def __init__(
        self, option_strings: list[str], dest: str, describe: Callable[[], str], **kwargs: Any
    ) -> None:
        self._describe = describe
        super().__init__(option_strings, dest, **kwargs)

    @property  # type: ignore[override]
    def help(self) -> str:
        return self._describe()

    @help.setter
    def help(self, value: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - never registered
        raise AssertionError("a listed copy of a policy flag is never parsed")


# Policy flags a command has an option of its own for: ``serve --max-queued-requests`` answers 503
# in the server, before any policy sees the request (SGLang's flag of that name is not applied there).
# ``--pipeline-parallel-size`` is the deployment's (its stages price the steps), which hands it
# to the policy (assemble/build.py).
COMMAND_OWNS = frozenset({"max_queued_requests", "pipeline_parallel_size"})


def option(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_policy_flags(p: argparse.ArgumentParser, default_policy: str) -> None:
    """``--policy`` (its help: the registry's names) and every policy's flags, one group each;
    the command then reads ``args.policy_flags`` (set by ``main`` through ``policy_flags_from``)."""
    from tailserve.cli.base import policy_help
    from tailserve.policies.registry import ENGINE_FLAG_HELP, ENGINE_FLAGS, POLICIES

    chosen = p.add_argument_group("policy", "the scheduling policy; its flags follow, in its group below")
    chosen.add_argument("--policy", default=default_policy, help=policy_help())
    p.epilog = EPILOG
    p.set_defaults(takes_policy_flags=True)
    kinds: dict[str, Any] = {}  # flag -> its type, the same for every policy that has it
    choices: dict[str, Any] = {}
    listed: list[tuple[argparse._ArgumentGroup, str, Callable[[], str]]] = []  # (group, flag, help)
    for name, cls in POLICIES.items():
        group = p.add_argument_group(f"{name} options", f"--policy {name}: {cls.summary}")
        choices.update(field_choices(cls.config_cls))
        for flag, kind in field_kinds(cls.config_cls).items():
            _same_kind(kinds, flag, kind, name)
            listed.append((group, flag, functools.partial(_policy_help, cls, flag)))
    own = {s for a in p._actions for s in a.option_strings}  # serve's --max-model-len is its own
    engine = p.add_argument_group("engine options", "every policy: its engine's value unless given")
    for flag, kind in ENGINE_FLAGS.items():
        if option(flag) in own:
            continue
        _same_kind(kinds, flag, kind, "the engine-wide flags")
        listed.append((engine, flag, functools.partial(_help, ENGINE_FLAG_HELP.get(flag, ""), flag)))
    for flag in [f for f in kinds if option(f) in own]:
        if flag not in COMMAND_OWNS:
            raise TypeError(f"policy flag {option(flag)} is also an option of {p.prog}")
        del kinds[flag]  # the command's own option applies instead
        listed = [item for item in listed if item[1] != flag]
    for flag, kind in kinds.items():
        p.add_argument(*_spellings(flag, kind), dest=DEST + flag, action=PolicyFlag, kind=kind,
                       choices=choices.get(flag))  # fmt: skip
    for group, flag, describe in listed:
        kind = kinds[flag]
        shown = [option(flag), "--no-" + option(flag)[2:]] if is_bool(kind) else [option(flag)]
        nargs = 0 if is_bool(kind) else None
        group._group_actions.append(
            _Shown(shown, DEST + flag, describe, nargs=nargs, metavar=_metavar(kind, choices.get(flag)))
        )


def _same_kind(kinds: dict[str, Any], flag: str, kind: Any, owner: str) -> None:
    if kinds.setdefault(flag, kind) != kind:
        raise TypeError(
            f"flag {flag} of {owner} is {kind_name(kind)}, another policy's is {kind_name(kinds[flag])}"
        )


def _spellings(flag: str, kind: Any) -> list[str]:
    names = [option(flag), "--" + flag] if "_" in flag else [option(flag)]
    return names + ["--no-" + n[2:] for n in names] if is_bool(kind) else names


def _metavar(kind: Any, choices: Any) -> str | None:
    if is_bool(kind):
        return None
    inner, optional = base_kind(kind)
    text = (
        "{" + ",".join(map(str, choices)) + "}"
        if choices
        else {int: "INT", float: "FLOAT"}[item] + ",..."
        if (item := number_tuple_item(inner)) is not None
        else {int: "INT", float: "FLOAT"}.get(inner, "TEXT")
    )
    return f"{text}|none" if optional else text


def _policy_help(cls: Any, flag: str) -> str:
    return _help(field_help(cls.config_cls).get(flag, ""), default=_defaults(cls)[flag])


def _help(text: str, flag: str = "", default: str | None = None) -> str:
    """``text (default: D)``; an engine-wide ``flag``'s default is each policy's."""
    default = _engine_default(flag) if default is None else default
    text = text.replace("%", "%%")
    return f"{text} (default: {default})" if text else f"(default: {default})"


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "none"
    if value == "":
        return "''"
    return str(value)


@functools.cache
def _defaults(cls: Any) -> dict[str, str]:
    """Each flag's default as help shows it: the config's own, or ``PER_DEVICE`` when
    ``default_config`` sets it from the GPU or the context length (probed at a few)."""
    from tailserve.core.device import DeviceInfo

    base = {
        f.name: f.default if f.default is not dataclasses.MISSING
        else f.default_factory() if f.default_factory is not dataclasses.MISSING
        else dataclasses.MISSING
        for f in dataclasses.fields(cls.config_cls)
    }  # fmt: skip
    varies = {name for name, value in base.items() if value is dataclasses.MISSING}
    for memory, context in _PROBES:
        try:
            config = cls.default_config(DeviceInfo(f"probe-{memory:g}GiB", memory), context)
        except Exception:  # a policy that needs more than a device to set its defaults: only help
            continue
        varies |= {name for name, value in base.items() if getattr(config, name) != value}
    return {name: PER_DEVICE if name in varies else _show(value) for name, value in base.items()}


def _engine_default(flag: str) -> str:
    """An engine-wide flag's default: each policy's ``default_<flag>`` (``--block-size``: 16, but
    1 for sglang and tgi), else what ``ENGINE_FLAG_DEFAULTS`` says."""
    from tailserve.policies.registry import ENGINE_FLAG_DEFAULTS, POLICIES

    values: dict[Any, list[str]] = {}
    for name, cls in POLICIES.items():
        if hasattr(cls, f"default_{flag}"):
            values.setdefault(getattr(cls, f"default_{flag}"), []).append(name)
    if not values:
        return ENGINE_FLAG_DEFAULTS.get(flag, "none")
    common, *others = sorted(values, key=lambda v: -len(values[v]))
    rest = "; ".join(f"{', '.join(values[v])}: {_show(v)}" for v in others)
    return _show(common) + (f"; {rest}" if rest else "")


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """Each field's help: ``metadata["help"]``, else the comments on its line and the comment
    lines just above it, else a string literal just below it (the dataclass's source)."""
    found = {f.name: f.metadata["help"] for f in dataclasses.fields(cls) if "help" in f.metadata}
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return found
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, a line of its own)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = (tok.string.lstrip("#").strip(), tok.line.lstrip().startswith("#"))
    body = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)).body
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        line, above = node.lineno - 1, []
        while line in comments and comments[line][1]:
            above.insert(0, comments[line][0])
            line -= 1
        end = node.end_lineno or node.lineno
        trailing = [comments[n][0] for n in range(node.lineno, end + 1) if n in comments]
        after = body[i + 1] if i + 1 < len(body) else None
        if (
            isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            trailing.append(" ".join(after.value.value.split()))
        text = " ".join(t for t in [*above, *trailing] if t)
        if text:
            found.setdefault(node.target.id, text)
    return found


def flag_owners(flag: str) -> list[str]:
    """The registered policies whose config has ``flag``."""
    from tailserve.policies.registry import POLICIES

    return [name for name, cls in POLICIES.items() if flag in field_kinds(cls.config_cls)]


def policy_flags_from(args: argparse.Namespace) -> dict[str, Any]:
    """The policy flags given (typed, in the order given), checked against ``--policy``: a flag
    its config lacks is one error line naming the policy and the flags it takes."""
    from tailserve.policies.registry import (
        ENGINE_FLAGS,
        POLICIES,
        get_policy_cls,
        parse_policy_list,
        policy_flags,
        resolve_policy_name,
    )

    given = {key[len(DEST) :]: value for key, value in vars(args).items() if key.startswith(DEST)}
    if ":" in args.policy or "," in args.policy:
        # The spec ``compare --policies`` takes (``sglang:chunked_prefill_size=512``), for one
        # policy: its flags join the options given (a flag set both ways must agree).
        specs = parse_policy_list(args.policy)
        if len(specs) != 1:
            raise CliError(
                f"--policy takes one policy, got {len(specs)} in {args.policy!r} (tailserve compare "
                "--policies runs several side by side)"
            )
        spec = specs[0]
        in_spec = {**spec.flags, **spec.engine_flags}
        for flag, value in in_spec.items():
            if flag in given and given[flag] != value:
                raise CliError(
                    f"--policy {args.policy} sets {flag}={value} and {option(flag)} {given[flag]} "
                    "differs: give it once"
                )
        args.policy = spec.name
        given = {**in_spec, **given}
    name = resolve_policy_name(args.policy)
    own = policy_flags(get_policy_cls(name))
    wrong = [flag for flag in given if flag not in own and flag not in ENGINE_FLAGS]
    if wrong:
        owners = [p for p in POLICIES if any(p in flag_owners(f) for f in wrong)]
        # (Not the ones a command owns, --pipeline-parallel-size: not policy flags on the line.)
        takes = ", ".join(option(f) for f in own if f not in COMMAND_OWNS) or "no flags of its own"
        everyone = ", ".join(option(f) for f in ENGINE_FLAGS)
        raise CliError(
            f"unrecognized argument{'s' if len(wrong) > 1 else ''} {', '.join(map(option, wrong))} "
            f"({'flags' if len(wrong) > 1 else 'a flag'} of {', '.join(owners)}, not of policy {name}; "
            f"{name} takes {takes}; every "
            f"policy takes {everyone})"
        )
    return given
