"""The layout read from the imports: no circle between modules, `infer` never reaching up into `train`, no
source file past ~400 lines. Imports inside functions count as much as those at the top: a lazy import is still
a dependency, and hiding a circle inside a function is how circles are usually kept."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("heads", "infer", "train", "shipped")
MAX_LINES = 420


def _modules() -> dict[str, Path]:
    """`selfspec.<package>.<module>` -> its file, for every source module of the checkout."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(("selfspec", *parts))] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (`from selfspec.x import y` counts y when y is itself a module),
    leaving out imports only a type checker runs."""
    tree = ast.parse(path.read_text())
    type_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                 for stmt in block.body for node in ast.walk(stmt)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {name: _imports(path, modules) for name, path in modules.items()}
    for name in graph:  # a package's __init__ is not an edge back from its own modules
        graph[name].discard(name)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the list of modules around it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_the_graph_sees_imports():
    graph = _graph()
    assert "selfspec.heads.config" in graph["selfspec.heads.medusa"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle():
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_infer_does_not_import_train():
    upward = sorted(f"{name} imports {dep}" for name, deps in _graph().items() if name.startswith("selfspec.infer")
                    for dep in deps if dep.startswith("selfspec.train"))
    assert not upward, upward


@pytest.mark.parametrize("package", PACKAGES)
def test_no_long_source_file(package):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / package).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these into modules of at most {MAX_LINES} lines: {long}"


REGISTRY = ("heads/family.py", "heads/families/")  # where a drafter family is declared


def _family_switches(source: str) -> list[str]:
    """Lines that branch on a drafter family outside its declaration: a config's `kind` compared or looked up
    in a collection, a family name compared as a string, or a recipe config told apart by its class name."""
    from selfspec.heads.families import KINDS

    names = "|".join(KINDS)
    pattern = re.compile(rf'kind\s*(==|!=)\s*"({names})"|kind\s+(not\s+)?in\s*[(\[{{][^)\]}}]*"({names})"'
                         rf'|_KINDS\b|type\([^)]*\)\.__name__\s*==')
    return [line.strip() for line in source.splitlines() if pattern.search(line.split("#")[0])]


def test_family_switch_finder_sees_switches():
    assert _family_switches('if heads.config.kind == "dflash":')
    assert _family_switches('if kind in ("eagle", "eagle3"):')
    assert _family_switches('if type(cfg).__name__ == "MedusaConfig":')
    assert _family_switches('if c.kind in DYNAMIC_TREE_KINDS:')
    assert not _family_switches('if self.loss == "kl":  # a "dflash" comment')


def test_no_drafter_family_switch_outside_the_registry():
    """A family is declared once (heads/families/<kind>.py); the layers read its declaration, so a new family
    touches no other file (docs/adding-a-drafter.md)."""
    found = {str(p.relative_to(ROOT)): hits for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))
             if not str(p.relative_to(ROOT)).startswith(REGISTRY) and (hits := _family_switches(p.read_text()))}
    assert not found, found


LOOP = ("selfspec.infer.generate", "selfspec.infer.decode_step")  # the decode loop and its step
DRAFTERS = ("selfspec.infer.drafter", "selfspec.infer.proposers", "selfspec.infer.eagle", "selfspec.infer.dflash",
            "selfspec.infer.peagle", "selfspec.infer.prompt_lookup", "selfspec.infer.draft_model",
            "selfspec.infer.feature_drafter", "selfspec.infer.mtp")


def test_drafters_never_import_the_decode_loop():
    graph = _graph()
    assert set(DRAFTERS) <= set(graph)
    reached = sorted(f"{name} imports {dep}" for name in DRAFTERS for dep in graph[name] if dep in LOOP)
    assert not reached, reached


def _probes(source: str) -> list[str]:
    """getattr/hasattr calls in the loop's source: the loop reads a drafter only through its interface."""
    return [line.strip() for line in source.splitlines() if re.search(r"\b(getattr|hasattr)\(\s*self\.(proposer|"
                                                                       r"drafter)|\b(getattr|hasattr)\(\s*(state\.)?"
                                                                       r"(proposer|drafter)\b", line)]


def test_the_loop_never_probes_a_drafter():
    assert _probes('together = getattr(self.proposer, "drafts_rows", False)')
    assert _probes('if hasattr(drafter, "observe"):')
    modules = _modules()
    found = {name: hits for name in LOOP if (hits := _probes(modules[name].read_text()))}
    assert not found, found
