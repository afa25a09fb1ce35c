"""The import rules of docs/structure.md, checked: each package imports only the tailserve
packages its row allows, so the layers cannot be crossed silently (core never reaches up into
the assembly or an executor, the KV managers stay free-standing, and of the executors only the
simulator's driver, ``executors/simulated/driver.py``, wraps the live engine)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC / "tailserve"

# package -> the tailserve packages it may import (docs/structure.md, one row each)
ALLOWED: dict[str, set[str]] = {
    "kv": set(),
    "cache": set(),
    "core": {"kv"},
    "executors.simulated": {"core", "cache"},
    "executors.pytorch": {"core", "cache"},
    "policies": {"core", "kv", "executors.simulated"},
    "workloads": {"core"},
    "metrics": {"core"},
    "assemble": {"core", "kv", "policies", "executors.simulated", "executors.pytorch"},
    "sim": {"assemble", "core", "kv", "policies", "executors.simulated", "workloads", "metrics"},
    "cluster": {"assemble", "sim", "core", "kv", "policies", "executors.simulated", "metrics"},
    "report": {"sim", "metrics", "policies", "executors.simulated"},
    "llm": {"assemble", "sim", "core", "kv", "policies", "executors.simulated", "executors.pytorch"},
    "server": {"llm", "core", "executors.simulated", "executors.pytorch"},
    "router": {"cluster", "server", "workloads"},
    "bench": {"sim", "llm", "core", "policies", "executors.simulated", "workloads"},
    "tune": {"sim", "cluster", "core", "policies", "executors.simulated", "workloads", "metrics"},
    "fidelity": {
        "assemble",
        "llm",
        "core",
        "kv",
        "policies",
        "executors.simulated",
        "executors.pytorch",
        "workloads",
        "metrics",
    },
    "validate": {"assemble", "core", "kv", "policies", "executors.simulated"},
    "engines": {"core", "policies"},
}
# The routing code is shared with the real router: pure Python, nothing of the simulator. Beside
# each other it may import the one text-to-field converter, itself standard library only.
ROUTING = {"routing", "routers", "prefix_routers", "approx_tree", "router_registry"}
CONVERTER = "tailserve.core.config_flags"


def package_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "executors":
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else ""


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.startswith("tailserve.")}


def modules() -> list[Path]:
    """Modules inside a package (top-level ones such as ``tailserve/__init__.py`` re-export)."""
    return sorted(p for p in ROOT.rglob("*.py") if p.parent not in (ROOT, ROOT / "executors"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_its_row_allows(package):
    crossings = []
    for path in modules():
        module = ".".join(path.relative_to(SRC).with_suffix("").parts)
        if package_of(module) != package:
            continue
        for name in imports_of(path):
            other = package_of(name)
            if other != package and other not in ALLOWED[package]:
                crossings.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not crossings, "\n".join(crossings)


def test_every_package_has_a_rule():
    packages = {package_of(".".join(p.relative_to(SRC).with_suffix("").parts)) for p in modules()}
    assert packages - set(ALLOWED) <= {"cli", "data"}  # the CLI may import anything


def test_routing_code_is_pure():
    for name in ROUTING:
        for imported in imports_of(ROOT / "cluster" / f"{name}.py"):
            if imported == CONVERTER:
                continue
            assert imported.split(".")[-1] in ROUTING, f"cluster/{name}.py imports {imported}"
    assert not imports_of(ROOT / "core" / "config_flags.py"), "the converter imports tailserve modules"


def _edges(package: str) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (anywhere in the file,
    ``TYPE_CHECKING`` too)."""
    here = {p.stem for p in (ROOT / package).glob("*.py") if p.stem != "__init__"}
    prefix = f"tailserve.{package}."
    edges: dict[str, set[str]] = {}
    for name in here:
        found: set[str] = set()
        for node in ast.walk(ast.parse((ROOT / package / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found.update(n.split(".")[2] for n in names if n.startswith(prefix))
        edges[name] = (found & here) - {name}
    return edges


@pytest.mark.parametrize("package", ["core", "policies"])
def test_no_import_cycle_inside(package):
    """core: the scheduler names the policy hooks it calls (``PolicyHooks``) instead of importing
    ``Policy``, and nothing in core imports the engine back. policies: a policy's parts (the SLO
    policy's admission, burst, fair-share and yield rules; SGLang's ``PrefillAdder`` and queue
    order) are handed what they need instead of importing the policy back. Both form a DAG."""
    edges = _edges(package)
    done: set[str] = set()
    cycles: list[str] = []

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycles.append(" -> ".join([*path[path.index(name) :], name]))
            return
        if name in done:
            return
        for other in sorted(edges[name]):
            visit(other, [*path, name])
        done.add(name)

    for name in sorted(edges):
        visit(name, [])
    assert not cycles, f"import cycle in {package}: {cycles[0]}"


# ---- the KV managers own their prefix caches (issue 31) --------------------------------------
_KV_RECEIVERS = {"kv", "kv_cache", "_kv"}  # how code outside kv/ names a KV manager
_PREFIX_METHODS = {
    "match_prefix",
    "allocate_with_prefix",
    "register_computed",
    "share",
    "hold",
    "release",
    "free",
}
_CLASS_TESTS = (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)


def _receiver(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _kv_leaks(rel: str, node: ast.AST) -> list[str]:
    """What ``node`` (in module ``rel``, outside kv/) does to a KV manager that it should not."""
    found = []
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        receiver, method = _receiver(node.func.value), node.func.attr
        if rel != "core/scheduler.py" and receiver in _KV_RECEIVERS and method in _PREFIX_METHODS:
            found.append(f"{rel}:{node.lineno} calls {ast.unparse(node.func)}")
    is_class_test = (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("isinstance", "issubclass")
    ) or (isinstance(node, ast.Compare) and any(isinstance(op, _CLASS_TESTS) for op in node.ops))
    if is_class_test and "KVCacheManager" in ast.unparse(node):
        found.append(f"{rel}:{node.lineno} tests {ast.unparse(node)}")
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and _receiver(target.value) in _KV_RECEIVERS:
                found.append(f"{rel}:{node.lineno} assigns {ast.unparse(target)}")
    return found


def test_kv_managers_own_their_prefix_caches():
    """Outside kv/, nothing attaches to a KV manager (no attribute assignments), nothing but the
    scheduler calls its prefix-cache or reference methods (policies ask through ``Scheduler``),
    and nothing asks which manager class it is (capabilities instead: ``prefix_caching``,
    ``shares_prefixes``, ``can_drop_cached``)."""
    leaks = []
    for path in modules():
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith("kv/"):
            for node in ast.walk(ast.parse(path.read_text())):
                leaks += _kv_leaks(rel, node)
    assert not leaks, "\n".join(leaks)
