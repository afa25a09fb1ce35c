"""The cli package's shape: defaults read from the config dataclasses, command modules that
import only the shared modules, ``python -m tailserve.cli`` as the console script."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tailserve.cli
from tailserve.bench.predict_spec import PredictSpec
from tailserve.cli.app import build_parser
from tailserve.cli.options import deployment_from, workload_from
from tailserve.executors.simulated.deployment import Deployment
from tailserve.llm.engine_args import EngineArgs
from tailserve.sim.workload_spec import WorkloadSpec
from tailserve.tune.recommend import TuneConfig

CLI_DIR = Path(tailserve.cli.__file__).parent


def _parse(*argv: str):
    args, _ = build_parser().parse_known_args(list(argv))
    return args


@pytest.mark.parametrize("command", ["simulate", "compare"])
def test_workload_and_deployment_defaults_are_the_dataclasses(command: str) -> None:
    args = _parse(command)
    assert workload_from(args) == WorkloadSpec()
    assert deployment_from(args) == Deployment.of(Deployment().model, Deployment().hardware)


def test_tune_overrides_only_its_own_two_defaults() -> None:
    args = _parse("tune")
    assert workload_from(args) == WorkloadSpec(name="chat", num_requests=1000)
    defaults = TuneConfig.__dataclass_fields__
    assert (args.rel_tol, args.flat_tol, args.max_rate) == tuple(
        defaults[name].default for name in ("rel_tol", "flat_tol", "max_rate")
    )


@pytest.mark.parametrize("command", ["compare", "simulate", "tune"])
def test_help_shows_the_workload_defaults_the_command_runs_with(command: str, capsys) -> None:
    args = _parse(command)
    with pytest.raises(SystemExit):
        tailserve.cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())

    def shown(flag: str) -> str:
        found = re.search(rf"{flag} [A-Z_]+ .*?\(default: ([^)]*)\)", text)
        assert found is not None, f"{command} --help: {flag} shows no default"
        return found.group(1)

    assert shown("--rate") == str(args.rate) and shown("--num-requests") == str(args.num_requests)
    spec = WorkloadSpec()  # options that default to None run with WorkloadSpec's own
    assert (shown("--input-len"), shown("--turns")) == (
        str(spec.input_len.value),
        "{}:{}".format(*spec.turns),
    )


def test_bench_predict_defaults_are_predict_spec(capsys) -> None:
    from tailserve.bench.predict import spec_for_server
    from tailserve.cli.bench import predict_overrides

    # No --predict-* flag given: nothing overrides a stand-in server's deployment, and any other
    # server's prediction is PredictSpec's, as the help says.
    assert predict_overrides(_parse("bench")) == {}
    assert spec_for_server({}, None)[0] == PredictSpec()
    with pytest.raises(SystemExit):
        tailserve.cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    spec = PredictSpec()
    for flag, value in (("model", spec.model), ("tp", spec.tp), ("policy", spec.policy)):
        assert re.search(rf"--predict-{flag} [A-Z_]+ .*?\(default: [^)]*, else {value}\)", text), flag


def test_serve_and_run_defaults_are_engine_args() -> None:
    engine = EngineArgs()
    serve = _parse("serve")
    assert (serve.executor, serve.policy, serve.dtype, serve.device, serve.seed) == (
        engine.executor, engine.policy, engine.dtype, engine.device, engine.seed,
    )  # fmt: skip
    assert (serve.hardware, serve.sim_model, serve.tp, serve.calibration) == (
        engine.hardware, engine.sim_model, engine.tensor_parallel_size, engine.calibration,
    )  # fmt: skip
    run = _parse("run", "--prompts", "p.txt")
    assert (run.policy, run.dtype, run.device, run.seed) == (
        engine.policy,
        engine.dtype,
        engine.device,
        engine.seed,
    )
    # bench --predict predicts the default stand-in server unless told otherwise.
    assert PredictSpec() == PredictSpec(engine.sim_model, engine.hardware, engine.tensor_parallel_size)


def test_text_options_change_the_spec() -> None:
    spec = workload_from(_parse("simulate", "--workload", "random", "--input-len", "uniform:10:20"))
    assert spec.input_len != WorkloadSpec().input_len
    assert workload_from(_parse("simulate", "--workload", "multi-turn", "--turns", "3:4")).turns == (3, 4)


def _cli_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "tailserve.cli":
                names.update(alias.name for alias in node.names)
            elif node.module.startswith("tailserve.cli."):
                names.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[2] for a in node.names if a.name.startswith("tailserve.cli."))
    return names


def _defines_parser(path: Path) -> bool:
    """A command module adds its subcommand (``add_parser``); every other module is shared."""
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name in ("add_parser", "add_parsers") for n in tree.body)


def test_command_modules_import_only_shared_modules() -> None:
    commands = {p.stem for p in CLI_DIR.glob("*.py") if _defines_parser(p)}
    assert {"compare", "simulate", "tune", "serve", "bench", "explain"} <= commands
    for name in commands:
        other_commands = (_cli_imports(CLI_DIR / f"{name}.py") & commands) - {name}
        assert not other_commands, f"cli/{name}.py imports command modules {sorted(other_commands)}"


@pytest.mark.parametrize("module", ["tailserve", "tailserve.cli"])
def test_python_dash_m_is_the_command(module: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", module, "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().startswith("tailserve ")
