"""The layout read from the imports: no circle between modules, `infer` never reaching up into `train`, no
source file past ~400 lines. Imports inside functions count as much as those at the top: a lazy import is
still a dependency, and hiding a circle inside a function is how circles are usually kept."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("heads", "infer", "train", "shipped")
MAX_LINES = 500  # formatted by ruff format at 110 columns


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
    those only a type checker runs included: a type-only circle still ties the two modules together."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
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
                return stack[stack.index(dep) :] + [dep]
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
    upward = sorted(
        f"{name} imports {dep}"
        for name, deps in _graph().items()
        if name.startswith("selfspec.infer")
        for dep in deps
        if dep.startswith("selfspec.train")
    )
    assert not upward, upward


@pytest.mark.parametrize("package", PACKAGES)
def test_no_long_source_file(package):
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / package).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these into modules of at most {MAX_LINES} lines: {long}"


REGISTRY = ("heads/family.py", "heads/families/")  # where a drafter family is declared


def _family_switches(source: str) -> list[str]:
    """Lines that branch on a drafter family outside its declaration: a config's `kind` compared or looked up
    in a collection, a family name compared as a string, or a recipe config told apart by its class name."""
    from selfspec.heads.families import KINDS

    names = "|".join(KINDS)
    pattern = re.compile(
        rf'kind\s*(==|!=)\s*"({names})"|kind\s+(not\s+)?in\s*[(\[{{][^)\]}}]*"({names})"'
        rf"|_KINDS\b|type\([^)]*\)\.__name__\s*=="
    )
    return [line.strip() for line in source.splitlines() if pattern.search(line.split("#")[0])]


def test_family_switch_finder_sees_switches():
    assert _family_switches('if heads.config.kind == "dflash":')
    assert _family_switches('if kind in ("eagle", "eagle3"):')
    assert _family_switches('if type(cfg).__name__ == "MedusaConfig":')
    assert _family_switches("if c.kind in DYNAMIC_TREE_KINDS:")
    assert not _family_switches('if self.loss == "kl":  # a "dflash" comment')


def test_no_drafter_family_switch_outside_the_registry():
    """A family is declared once (heads/families/<kind>.py); the layers read its declaration, so a new family
    touches no other file (docs/adding-a-drafter.md)."""
    found = {
        str(p.relative_to(ROOT)): hits
        for package in PACKAGES
        for p in sorted((ROOT / package).rglob("*.py"))
        if not str(p.relative_to(ROOT)).startswith(REGISTRY)
        and (hits := _family_switches(_joined(p.read_text())))
    }
    assert not found, found


LOOP = ("selfspec.infer.core.generate", "selfspec.infer.core.decode_step")  # the decode loop and its step
# shared by the methods: the chunked vocabulary losses, the per-step soft-label loss; DFlash's own loss module
# and Medusa-1's method (Medusa-2 extends it) are their family's
METHODS_SHARED = {"selfspec.train.methods.chunked_loss", "selfspec.train.methods.step_loss"}
METHODS_OWN = {
    "selfspec.train.methods.dflash": {"selfspec.train.methods.dflash_loss"},
    "selfspec.train.methods.medusa2": {"selfspec.train.methods.medusa"},
}


def _joined(source: str) -> str:
    """The source with each call the formatter wrapped over lines on one line, for the line-based checks."""
    return re.sub(r"\s+\)", ")", re.sub(r"\(\s+", "(", source))


def _in(package: str, graph: dict[str, set[str]]) -> list[str]:
    return sorted(name for name in graph if name.startswith(package + "."))


def test_drafters_never_import_the_decode_loop():
    graph = _graph()
    drafters = _in("selfspec.infer.drafters", graph)
    assert "selfspec.infer.drafters.eagle" in drafters
    reached = sorted(f"{name} imports {dep}" for name in drafters for dep in graph[name] if dep in LOOP)
    assert not reached, reached


def test_methods_never_import_another_familys_method():
    graph = _graph()
    methods = _in("selfspec.train.methods", graph)
    assert "selfspec.train.methods.eagle" in methods
    reached = sorted(
        f"{name} imports {dep}"
        for name in methods
        for dep in graph[name]
        if dep in methods and dep not in METHODS_SHARED | METHODS_OWN.get(name, set())
    )
    assert not reached, reached


def test_heads_never_import_infer_or_train():
    upward = sorted(
        f"{name} imports {dep}"
        for name, deps in _graph().items()
        if name.startswith("selfspec.heads")
        for dep in deps
        if dep.startswith(("selfspec.infer", "selfspec.train"))
    )
    assert not upward, upward


def test_the_launch_folder_shadows_no_other_module(tmp_path):
    """`accelerate launch train/eagle.py` puts train/ first on sys.path, so each module and package in it
    could hide an installed or standard module of the same name; none may have one."""
    folder = ROOT / "train"
    names = sorted(
        {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
        | {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
    )
    assert {"eagle", "medusa", "loop", "data"} <= set(names)
    find = "import importlib.util, sys; print([n for n in sys.argv[1:] if importlib.util.find_spec(n)])"
    found = subprocess.run(
        [sys.executable, "-c", find, *names], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert found == "[]", f"train/ would shadow {found}"


def _probes(source: str) -> list[str]:
    """getattr/hasattr calls in the loop's source: the loop reads a drafter only through its interface."""
    return [
        line.strip()
        for line in source.splitlines()
        if re.search(
            r"\b(getattr|hasattr)\(\s*self\.(proposer|"
            r"drafter)|\b(getattr|hasattr)\(\s*(state\.)?"
            r"(proposer|drafter)\b",
            line,
        )
    ]


def test_the_loop_never_probes_a_drafter():
    assert _probes('together = getattr(self.proposer, "drafts_rows", False)')
    assert _probes('if hasattr(drafter, "observe"):')
    modules = _modules()
    found = {name: hits for name in LOOP if (hits := _probes(_joined(modules[name].read_text())))}
    assert not found, found
