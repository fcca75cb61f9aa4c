"""Outside ``strategies/``, ``presets.py`` and the tests no code keys a decision on a strategy's name: the facts
the launcher, the studies and ``pick`` need are the strategies' class attributes, read through the registry, so
a new strategy touches its module, one registry line, one preset and one test.

The scan (an ast walk of ``parambox/``) flags the three forms a name-keyed decision takes: a comparison with a
registered name (``strategy == "easgd"``, ``name in ("weight-avg", "diloco")``), a set of names, and a table keyed
by names only. A benchmark or study that *chooses* which strategies to run (its subject) lists them in a tuple,
under labels of its own or as run configs (whose ``options`` table is keyed by name), which the scan leaves
alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

from parambox.strategies import STRATEGIES

PACKAGE = Path(__file__).resolve().parent.parent / "parambox"

# (file, name, why): where a registered name is not a strategy's identity in a decision.
ALLOWED = {
    # perfmodel's exchange kinds (a ring allreduce; pushes and pulls behind a barrier) share their words with
    # the strategies that use them; a setup's kind is its `Pattern`, not its name.
    ("perfmodel/simulate.py", "allreduce"),
    ("perfmodel/simulate.py", "box-sync"),
    # The EASGD paper's own settings for the methods it compares (EAMSGD at lr 0.03 with momentum): part of
    # the claim `reproduce easgd-tau` re-measures, not a fact about parambox's strategy.
    ("studies/reproduce.py", "eamsgd"),
}


def _names(node: ast.AST) -> set[str]:
    """The registered names among ``node``'s string constants (a constant, or a literal collection's)."""
    if isinstance(node, ast.Constant):
        return {node.value} & set(STRATEGIES) if isinstance(node.value, str) else set()
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_names(e) for e in node.elts)) if node.elts else set()
    return set()


def _is_run(node: ast.AST) -> bool:
    return isinstance(node, ast.Dict) and any(
        isinstance(k, ast.Constant) and k.value == "strategy" for k in node.keys
    )


def name_keyed(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every name-keyed decision in ``tree``."""
    # a config's "options" table is keyed by strategy name: the run's own format
    options_tables = {
        id(v)
        for node in ast.walk(tree)
        if isinstance(node, ast.Dict)
        for k, v in zip(node.keys, node.values)
        if isinstance(k, ast.Constant) and k.value == "options"
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators):
                if isinstance(op, ast.Eq | ast.NotEq):
                    hits = _names(node.left) | _names(right) if isinstance(right, ast.Constant) else set()
                    hits |= _names(node.left) if isinstance(node.left, ast.Constant) else set()
                elif isinstance(op, ast.In | ast.NotIn) and not isinstance(right, ast.Constant):
                    hits = _names(right)
                else:
                    hits = set()
                out += [(node.lineno, n) for n in hits]
        elif isinstance(node, ast.Set) and all(_names(e) for e in node.elts):  # a set of names only
            out += [(node.lineno, n) for n in _names(node)]
        elif isinstance(node, ast.Dict) and id(node) not in options_tables and all(node.keys):
            keys = [_names(k) for k in node.keys]
            # every key a registered name: a table of facts about strategies, unless its values are the runs
            # of a study (each a config with its "strategy")
            if all(keys) and not all(_is_run(v) for v in node.values):
                out += [(node.lineno, n) for k in keys for n in k]
    return out


def test_no_code_outside_strategies_keys_a_decision_on_a_strategy_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("strategies/") or rel == "presets.py":
            continue
        for line, name in name_keyed(ast.parse(path.read_text(), rel)):
            if (rel, name) not in ALLOWED:
                found.append(f"{rel}:{line}: {name!r}")
    assert found == [], "strategy names outside strategies/ (use a class attribute):\n" + "\n".join(found)


def test_the_scan_sees_branches_sets_and_tables_but_not_a_list_of_runs():
    code = """
if strategy == "easgd": pass
family = "local" if s in ("weight-avg", "diloco") else "sync"
LOCAL = {"weight-avg"}
EXCHANGE = {"easgd": "box", "diloco": "allreduce"}
RUNS = ("easgd", "downpour")          # a study's subject
SETUPS = {"easgd-tau4": ("easgd", {}), "ddp": None}
if "diloco" in results: pass
if {"weight-avg", "post-local-sgd"} <= set(results): pass   # setup labels
RUNS = {"easgd": {"strategy": "easgd"}, "hybrid": {"strategy": "hybrid", "options": {"hybrid": {"tau": 4}}}}
"""
    found = sorted(name_keyed(ast.parse(code)))
    assert found == [
        (2, "easgd"),
        (3, "diloco"),
        (3, "weight-avg"),
        (4, "weight-avg"),
        (5, "diloco"),
        (5, "easgd"),
    ]
