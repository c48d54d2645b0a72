"""The package's shape: no import cycles between modules, and no layer importing a higher one.

Both checks read the source with ``ast`` and execute nothing. Every ``import`` and ``from ...
import`` counts, at module level and inside functions alike: a function-level import only
delays a cycle to the first call, it does not remove it.

How an import statement becomes edges of the module graph:

- ``import meshlm.a.b`` -> ``meshlm.a.b``;
- ``from meshlm.a import b`` -> ``meshlm.a.b`` when that is a module, else ``meshlm.a`` (the
  package's ``__init__``, which defines or re-exports ``b``);
- relative imports are resolved against the importing module's package first.

Layers (lowest first): a module may import from its own top-level package and from any lower
layer, never from its own layer's other packages or from a higher one. The order is the design
of ``meshlm/`` (see README "Layout"): errors at the bottom; optional kernels; single-device math, the optimizer
rule and data; then parallelism, precision and the run config; checkpoints; then the things a
user runs (training, generation, conversion, adaptation); evaluation, which scores and
generates with what those load; the command line on top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1]

LAYERS = (
    ("errors",),
    ("kernels",),
    ("models", "optim", "data"),
    ("parallel", "precision", "config"),
    ("checkpoint",),
    ("hf", "training", "inference", "adapt"),
    ("planning", "rl"),
    ("evaluation",),
    ("demo", "cli"),
    ("__main__",),
)
"""Top-level parts of ``meshlm`` (sub-packages and modules), lowest layer first."""


def module_files(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """{dotted module name: (file, is_package)} for every .py file under ``root / package``."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[".".join(parts)] = (path, is_package)
    return modules


def resolve(name: str, modules) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules``."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imported_modules(module: str, path: Path, is_package: bool, modules) -> dict[str, int]:
    """{imported module of ``modules``: line of the first such import} for one file."""
    found: dict[str, int] = {}

    def add(target: str | None, line: int) -> None:
        if target is not None and target != module:
            found.setdefault(target, line)

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(resolve(alias.name, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                add(submodule if submodule in modules else resolve(source, modules), node.lineno)
    return found


def import_graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    """{module: {imported module: line}} over every module of ``package``."""
    modules = module_files(root, package)
    return {name: imported_modules(name, path, is_package, modules) for name, (path, is_package) in modules.items()}


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (as a closed path of modules) per strongly connected component with more than
    one module, or a module importing itself (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = counter
                    counter += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
    return [cycle_through(graph, set(component)) for component in components]


def cycle_through(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A closed path inside a strongly connected ``component``, from its first module back to it."""
    first = min(component)
    paths, seen = [[first]], {first}
    while paths:
        path = paths.pop(0)
        for successor in sorted(graph[path[-1]]):
            if successor == first:
                return path + [first]
            if successor in component and successor not in seen:
                seen.add(successor)
                paths.append(path + [successor])
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{module} (line {graph[module][following]})"
                       for module, following in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def top_level_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_of(part: str) -> int:
    for level, parts in enumerate(LAYERS):
        if part in parts:
            return level
    raise AssertionError(f"meshlm.{part} is in no layer; add it to LAYERS in tests/test_layout.py")


def layer_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports from a module's own layer (another part) or from a higher layer."""
    violations = []
    for module, imports in sorted(graph.items()):
        source = top_level_part(module)
        if source is None:  # meshlm/__init__.py re-exports the public API from below
            continue
        for target, line in sorted(imports.items()):
            destination = top_level_part(target)
            if destination is None or destination == source:
                continue
            if layer_of(destination) >= layer_of(source):
                violations.append(f"{module} (line {line}) imports {target}: meshlm.{destination} is not below "
                                  f"meshlm.{source}")
    return violations


def test_meshlm_has_no_import_cycles():
    graph = import_graph(PACKAGE_ROOT, "meshlm")
    assert len(graph) > 100, "the scan found too few modules: is PACKAGE_ROOT right?"
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in meshlm/ (move the shared piece to a module both sides import):\n" + \
        "\n".join(describe(cycle, graph) for cycle in cycles)


def test_every_layer_imports_only_lower_layers():
    graph = import_graph(PACKAGE_ROOT, "meshlm")
    parts = {top_level_part(module) for module in graph} - {None}
    assert parts == {part for layer in LAYERS for part in layer}, "LAYERS must name every part of meshlm/"
    violations = layer_violations(graph)
    assert not violations, "imports against the layer order:\n" + "\n".join(violations)


def write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_through_a_function_level_import_is_found_and_named(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import helper\n",
        "pkg/b.py": "def helper():\n    from pkg.sub import c\n    return c\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from .. import a\n",  # relative, back to pkg.a
        "pkg/d.py": "import pkg.a\n",  # imports into the cycle, is not part of it
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg.sub.c": 2}
    assert graph["pkg.sub.c"] == {"pkg.a": 1}
    cycles = find_cycles(graph)
    assert cycles == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
    assert describe(cycles[0], graph) == "pkg.a (line 1) -> pkg.b (line 2) -> pkg.sub.c (line 1) -> pkg.a"


def test_an_acyclic_package_and_a_re_exporting_init_have_no_cycle(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "from pkg.a import VALUE\n",
        "pkg/a.py": "VALUE = 1\n",
        "pkg/b.py": "from pkg import VALUE\nfrom pkg.a import VALUE as SAME\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg": 1, "pkg.a": 2}
    assert find_cycles(graph) == []


@pytest.mark.parametrize("source, target, allowed", [
    ("meshlm.parallel.mesh", "meshlm.models.config", True),
    ("meshlm.models.config", "meshlm.parallel.mesh", False),   # upward
    ("meshlm.training.trainer", "meshlm.inference.generate", False),  # same layer, other part
    ("meshlm.checkpoint.files", "meshlm.checkpoint.folders", True),  # within one part
])
def test_the_layer_rule(source, target, allowed):
    violations = layer_violations({source: {target: 7}, target: {}})
    assert (violations == []) == allowed, violations
