"""Every module under ``moecc/`` imports on its own, first, and no modules import each other in a circle.

One fresh interpreter (a subprocess) imports the heavy libraries once, then forks a child per module; the child
holds no moecc module when it imports the one under test, as a fresh interpreter would, without paying for torch's
import fifty times. A cycle can hide from that behind imports inside functions, so the import graph (those
included) is checked for cycles too."""
from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import moecc

_IMPORT_EACH = r"""
import importlib, os, sys, traceback
import peft, torch, transformers  # noqa: F401  (loaded once, before any moecc module)
assert not any(name == "moecc" or name.startswith("moecc.") for name in sys.modules)
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            print(f"--- import {name} failed:", flush=True)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    if os.waitpid(pid, 0)[1] != 0:
        failed.append(name)
print("failed:", " ".join(failed))
"""


def _module_names() -> list[str]:
    return ["moecc"] + sorted(info.name for info in pkgutil.walk_packages(moecc.__path__, "moecc."))


def test_every_module_imports_alone_in_a_fresh_interpreter():
    names = _module_names()
    assert {"moecc.experts.native", "moecc.paradigms.base", "moecc.bench.plan"} <= set(names)
    result = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *names], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("failed:"), result.stdout[-4000:] + result.stderr[-4000:]


def _imports(path: Path, name: str, package: str, modules: set[str]) -> set[str]:
    """The moecc modules ``name`` (in ``package``) imports anywhere in its source, but its own packages (which
    Python imports first whatever the module does)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            parts = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            base = ".".join(parts + ([node.module] if node.module else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules
            found |= submodules or {base}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {m for m in found & modules if m != name and not name.startswith(m + ".")}


def _import_graph() -> dict[str, set[str]]:
    root = Path(moecc.__file__).parent
    paths = {}
    for path in root.rglob("*.py"):
        parts = ("moecc",) + path.relative_to(root).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {name: _imports(path, name, name if path.name == "__init__.py" else name.rsplit(".", 1)[0], set(paths))
            for name, path in paths.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph``, or None (depth-first search, colouring nodes on the current path)."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycle_even_through_imports_inside_functions():
    graph = _import_graph()
    assert "moecc.bench.timing" in graph["moecc.bench.rates"] and "moecc.bench.plan" not in graph["moecc.bench.rates"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
