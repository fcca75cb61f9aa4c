"""The import graph of ``parambox/`` follows the layers of the design: no import runs back up, and every
import cycle stays inside one folder.

The layers, top to bottom (the design, ``DESIGN.md``: "api and commands on top, then run/, then
studies/bench/perfmodel, training, workload, strategies, box, runtime"):

- the package itself (``parambox/__init__.py``, the public API), ``__main__``, ``cli``, ``api/``, ``commands/``
- ``run/``
- ``studies/``, then ``bench/``, then ``perfmodel/``, then ``report/``: the design puts them in one layer; inside
  it each one uses only those after it (studies run benchmarks and predictions and draw pages; benchmarks check
  predictions), so a cycle among them is caught as an arrow back up.
- ``training/`` and ``optim.py``: the loop and the optimizer wrapper a user's own loop uses, the same layer.
- ``config.py`` and ``presets.py``: the run's typed config gathers each component's config (the box's, the
  cluster's, the strategies', the workload's names), so it sits above all of them and below the loop that reads
  it; presets are functions that return configs, beside it.
- ``workload/``, ``models/``, ``data/``: a run's model, data, loss; models and data are the workload's parts.
- ``strategies/``
- ``box/``
- ``runtime/``
- ``errors.py`` and ``numerics.py``: base modules below every layer; they import nothing of parambox, and every
  layer raises user errors and checks finiteness.

Imports inside functions count: a lazy import is still an arrow. ``if TYPE_CHECKING:`` imports count too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "parambox"

# (module prefix, layer): higher layers may import lower ones and their own.
LAYERS = {
    "parambox": 100,
    "parambox.__main__": 100,
    "parambox.cli": 100,
    "parambox.api": 100,
    "parambox.commands": 100,
    "parambox.run": 90,
    "parambox.studies": 84,
    "parambox.bench": 83,
    "parambox.perfmodel": 82,
    "parambox.report": 81,
    "parambox.training": 70,
    "parambox.optim": 70,
    "parambox.config": 65,
    "parambox.presets": 65,
    "parambox.workload": 60,
    "parambox.models": 60,
    "parambox.data": 60,
    "parambox.strategies": 50,
    "parambox.box": 40,
    "parambox.runtime": 30,
    "parambox.errors": 10,
    "parambox.numerics": 10,
}

# Arrows back up that stay, each with its reason: (importer, imported).
ALLOWED_BACK = {
    # `bench api` measures the public entry point itself: its subject is `parambox.train`, so it must call it.
    ("parambox.bench.api", "parambox"),
}


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def _edges(mods) -> list[tuple[str, str, int]]:
    """(importer, imported module, line) for every import of parambox, at any depth of the file."""

    def resolve(name: str) -> str:
        while name not in mods:
            name = name.rpartition(".")[0]
        return name

    edges = []
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    full = ".".join(base + ([node.module] if node.module else []))
                else:
                    full = node.module or ""
                # `from pkg import mod` imports the module pkg.mod, `from mod import name` the module mod
                targets = [f"{full}.{a.name}" if f"{full}.{a.name}" in mods else full for a in node.names]
            else:
                continue
            for target in targets:
                if target == "parambox" or target.startswith("parambox."):
                    edges.append((name, resolve(target), node.lineno))
    return edges


def _layer(module: str) -> int:
    prefix = module
    while prefix not in LAYERS:
        prefix = prefix.rpartition(".")[0]
        assert prefix, f"{module} has no layer: add its folder to LAYERS"
    return LAYERS[prefix]


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else "parambox"


def _cycles(edges) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for a, b, _ in edges:
        if a != b:
            graph.setdefault(a, set()).add(b)
            graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(component)
    return out


def test_no_import_runs_back_up():
    mods = _modules()
    back = [
        f"{a} (line {line}) imports {b}"
        for a, b, line in _edges(mods)
        if _layer(b) > _layer(a) and (a, b) not in ALLOWED_BACK
    ]
    assert back == [], "imports that run back up the layers:\n" + "\n".join(back)


def test_every_import_cycle_stays_inside_one_folder():
    crossing = [sorted(c) for c in _cycles(_edges(_modules())) if len({_folder(m) for m in c}) > 1]
    assert crossing == [], f"import cycles across folders: {crossing}"


def test_the_check_sees_lazy_relative_and_from_imports(tmp_path, monkeypatch):
    """The scanner itself: an import inside a function, a relative one and a `from pkg import module` are arrows."""
    pkg = tmp_path / "parambox"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "strategies").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "strategies" / "__init__.py").write_text("from ..runtime import world\n")
    (pkg / "runtime" / "world.py").write_text("def f():\n    from parambox import strategies\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    mods = _modules()
    edges = {(a, b) for a, b, _ in _edges(mods)}
    assert ("parambox.strategies", "parambox.runtime.world") in edges
    assert ("parambox.runtime.world", "parambox.strategies") in edges
    assert [sorted(c) for c in _cycles(_edges(mods))] == [["parambox.runtime.world", "parambox.strategies"]]
