"""Architecture figures of a source tree (issue 31's before/after measures).

- **circles inside packages**: strongly connected components of two or more modules among the
  modules of one package (imports anywhere in a file, ``TYPE_CHECKING`` ones too);
- **arrows that climb back up**: imports from one package into another that the layer order of
  docs/structure.md puts above it (``LAYERS``: lower index = lower layer);
- **files over 400 lines**, **functions over 80 lines** (``def`` to its last line).

    python scripts/arch_metrics.py [SRC_DIR]        # default: src/tailserve of this checkout
    git worktree add /tmp/old COMMIT && python scripts/arch_metrics.py /tmp/old/src/tailserve
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

# docs/structure.md's layers, bottom up; packages on one line are one layer.
LAYERS = [
    {"kv", "cache"},
    {"core"},
    {"executors.simulated", "executors.pytorch"},
    {"policies", "workloads", "metrics"},
    {"assemble"},
    {"sim"},
    {"cluster", "report", "llm", "fidelity", "validate"},
    {"server", "bench", "tune"},
    {"router"},
    {"cli"},
]


def package_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "executors":
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else ""


def layer_of(package: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return i
    return None


def imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in found if n.startswith("tailserve.")}


def sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of size >= 2."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def measure(root: Path) -> dict:
    src = root.parent
    modules = {".".join(p.relative_to(src).with_suffix("").parts): p for p in root.rglob("*.py")}
    modules = {(m[: -len(".__init__")] if m.endswith(".__init__") else m): p for m, p in modules.items()}
    graph: dict[str, set[str]] = defaultdict(set)
    climbs = []
    for mod, path in modules.items():
        pkg = package_of(mod)
        for name in imports(path):
            target = name if name in modules else name.rsplit(".", 1)[0]
            if target not in modules or target == mod:
                continue
            other = package_of(target)
            if other == pkg:
                graph[mod].add(target)
            else:
                lo, hi = layer_of(pkg), layer_of(other)
                if lo is not None and hi is not None and hi > lo:
                    climbs.append(f"{mod} -> {target}")
    circles = sccs(graph)
    long_files, long_funcs = [], []
    for mod, path in sorted(modules.items()):
        text = path.read_text()
        n = text.count("\n")
        if n > 400:
            long_files.append(f"{mod} ({n})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 80:
                    long_funcs.append(f"{mod}.{node.name} ({length})")
    return {
        "circles inside packages": circles,
        "arrows that climb back up": sorted(climbs),
        "files > 400 lines": long_files,
        "functions > 80 lines": long_funcs,
    }


def main() -> int:
    root = (
        Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "src" / "tailserve"
    )
    for name, items in measure(root).items():
        print(f"{name}: {len(items)}")
        for item in items:
            print(f"    {item if isinstance(item, str) else ' <-> '.join(item)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
