"""The dependency directions the README's "Architecture" states, read from the source.

Every ``import`` of an ``hf_blockbatch`` module is collected with :mod:`ast`, including the ones
inside functions: a deferred import is still a dependency, and hiding a cycle behind one is what
these checks are meant to catch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_blockbatch"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the hf_blockbatch modules it imports (absolute imports; the package uses no others)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: relative import; this check reads absolute ones only"
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            targets.update(n for n in names if n == "hf_blockbatch" or n.startswith("hf_blockbatch."))
        graph[_module_name(path)] = targets
    return graph


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _imports()


def test_the_import_reader_sees_deferred_imports(graph):
    """The checks below would pass vacuously if the reader missed imports inside functions."""
    assert "hf_blockbatch.tasks" in graph["hf_blockbatch.eval.runner"]  # load_task imports it on use
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_eval_depends_on_tasks_never_the_reverse(graph):
    back = sorted((m, t) for m, ts in graph.items() if _package(m) == "hf_blockbatch.tasks" for t in ts
                  if _package(t) == "hf_blockbatch.eval")  # fmt: skip
    assert not back, f"tasks imports eval (the contract, scoring and sandbox live in tasks): {back}"


def test_training_modules_form_no_cycle(graph):
    training = {m: {t for t in ts if t.startswith("hf_blockbatch.training.")} for m, ts in graph.items()
                if m.startswith("hf_blockbatch.training.")}  # fmt: skip
    assert _cycle(training) is None, _cycle(training)


def test_no_cycle_between_the_application_packages(graph):
    """eval, tasks and training sit above the decoding core and below the CLI: no cycle among them."""
    apps = {"hf_blockbatch.eval", "hf_blockbatch.tasks", "hf_blockbatch.training"}
    packages: dict[str, set[str]] = {}
    for m, ts in graph.items():
        if _package(m) in apps:
            packages.setdefault(_package(m), set()).update(_package(t) for t in ts if _package(t) in apps - {_package(m)})
    assert _cycle(packages) is None, _cycle(packages)


def test_the_decoding_core_imports_no_model_class(graph):
    """generation is model-agnostic: the models import its mixin (as transformers' models inherit
    GenerationMixin), never the other way round."""
    core = sorted((m, t) for m, ts in graph.items() if _package(m) == "hf_blockbatch.generation" for t in ts
                  if _package(t) == "hf_blockbatch.models")  # fmt: skip
    assert not core, core
