"""Imports point one way: down the layer order, never up.

The layers, lowest first (a module may import from its own layer and the ones
before it, never from one after it):

1. **base** — ``qnorm.fixedpoint`` and the utilities everything may use:
   ``qnorm._lazy``, ``qnorm.errors``, ``qnorm.extras``, ``qnorm.data``, ``qnorm.qformat``,
   ``qnorm.analysis``, ``qnorm.targets`` (target descriptions: data),
   ``qnorm.metrics`` (error in LSB) and ``qnorm.cli_args`` (argparse types with no
   qnorm imports, shared by ``qnorm.cli`` and ``qnorm.train.cli``);
2. **ops** — the golden integer ops;
3. **nn** — the QAT layers and the registry of norm / neuron kinds;
4. **passes, deploy** — model rewrites and the frozen, proven-exact graph;
5. **compilers** — TVM kernels, whole-model graphs, FPGA projects;
6. **verify** — the bit-exactness harness and its backends, with
   ``qnorm.report`` (error tables of the golden ops against their float ops);
7. **train** — data, the model zoo, training, checkpoints (compiling a checkpoint
   joins its format with the compiler, so it lives here, above compilers);
8. **export** — QONNX (exports checkpoints) with ``qnorm.custom_op``, its domain;
9. **demo** — ``make demo``: trains, compiles and measures everything below;
10. **cli** — the ``qnorm`` command, on top.

The walk reads every module under qnorm/ and compilers/ with ``ast`` (nothing is
imported), so it sees imports inside functions and ``importlib.import_module``
calls with a constant name (a literal, or a module-level string constant) as well.
Within a layer, modules do not import each other back either: the import graph has
no cycle (a package counts as its ``__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("qnorm", "compilers")

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "base",
        (
            "qnorm.fixedpoint", "qnorm._lazy", "qnorm.errors", "qnorm.extras", "qnorm.data", "qnorm.qformat", "qnorm.analysis",
            "qnorm.targets", "qnorm.metrics", "qnorm.cli_args",
        ),
    ),
    ("ops", ("qnorm.ops",)),
    ("nn", ("qnorm.nn",)),
    ("passes/deploy", ("qnorm.passes", "qnorm.deploy")),
    ("compilers", ("compilers",)),
    ("verify", ("qnorm.verify", "qnorm.report", "qnorm.report_softmax", "qnorm.report_activation", "qnorm.report_lanes16")),
    ("train", ("qnorm.train",)),
    ("export", ("qnorm.export", "qnorm.custom_op")),
    ("demo", ("qnorm.demo",)),
    ("cli", ("qnorm.cli",)),
)  # fmt: skip
# The bare package ``qnorm`` holds nothing but its docstring: importing it is importing the base.
PACKAGE_ROOTS = {"qnorm": 0}


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the longest prefix that names ``module`` or a package above it."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), index)
    if best is None:
        return PACKAGE_ROOTS.get(module)
    return best[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` assignments (import_module is often given one)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node.value.value
    return found


def _is_import_module(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return name == "import_module"


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module) for every import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    constants = _string_constants(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            # ``from a import b`` imports the module a.b when there is one, else a name of a.
            found += [
                (node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
                for alias in node.names
            ]
        elif isinstance(node, ast.Call) and _is_import_module(node) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append((node.lineno, arg.value))
            elif isinstance(arg, ast.Name) and arg.id in constants:
                found.append((node.lineno, constants[arg.id]))
    return list(dict.fromkeys((line, name) for line, name in found if name.split(".")[0] in PACKAGES))


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in source_modules() if layer_of(m) is None]
    assert not unplaced, f"modules with no layer in tests/test_layers.py's LAYERS: {unplaced}"


def test_no_import_points_up_the_layer_order() -> None:
    modules = source_modules()
    known = set(modules)
    upward = []
    for module, path in modules.items():
        own = layer_of(module)
        for line, target in imports_of(module, path, known):
            theirs = layer_of(target)
            if own is not None and theirs is not None and theirs > own:
                upward.append(
                    f"{path.relative_to(REPO)}:{line}: {module} ({LAYERS[own][0]}) imports "
                    f"{target} ({LAYERS[theirs][0]})"
                )
    assert not upward, "imports pointing up the layer order:\n" + "\n".join(upward)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (an imported name of a module counts as that module)."""
    modules = source_modules()
    known = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for _, target in imports_of(module, path, known):
            while target and target not in known:  # qnorm.ops.NORMS -> qnorm.ops
                target = target.rpartition(".")[0]
            if target and target != module:
                graph[module].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


def test_no_module_imports_itself_back() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_is_found_and_named() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_walk_sees_lazy_and_dynamic_imports(tmp_path: Path) -> None:
    """The checker itself: an import inside a function and an import_module by a
    constant name are both found, a relative import resolved."""
    source = (
        "import importlib\n"
        "_NN = 'qnorm.nn'\n"
        "def f():\n"
        "    from qnorm.train import models\n"
        "    return importlib.import_module(_NN), importlib.import_module('compilers.tvm')\n"
        "from .. import fixedpoint\n"
    )
    path = tmp_path / "probe.py"
    path.write_text(source)
    found = [name for _, name in imports_of("qnorm.ops.probe", path, {"qnorm.train.models"})]
    assert sorted(found) == ["compilers.tvm", "qnorm", "qnorm.nn", "qnorm.train.models"]


@pytest.mark.parametrize(
    ("module", "layer"),
    [("qnorm", "base"), ("qnorm.ops.layernorm", "ops"), ("qnorm.nn.kinds", "nn"), ("compilers.tvm.graph", "compilers"),
     ("qnorm.train.models", "train"), ("qnorm.cli", "cli"), ("qnorm.cli_args", "base")],
)  # fmt: skip
def test_layer_of_takes_the_longest_prefix(module: str, layer: str) -> None:
    index = layer_of(module)
    assert index is not None and LAYERS[index][0] == layer
