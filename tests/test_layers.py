"""The import graph of `pipeline/` flows one way: no cycles (imports inside functions included),
and each module imports only from its own layer or the layers above it (docs/architecture.md)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pipeline"

# The package's folders are its layers, in order; a folder imports only from its own layer and the ones
# before it. Folders of one layer are wings that never import each other (counting on the meta device,
# measuring on a GPU and simulating share `training/`, not code of one another).
LAYERS = (
    ("core",),
    ("inputs",),
    ("formulas",),
    ("training",),
    ("fit",),
    ("activations", "measure", "simulate"),
    ("estimate",),
    ("validate",),
    ("publish", "serve"),
    ("cli", "__main__", "__init__"),
)
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}
# simulate/ has layers of its own, the same way: the memory (tracker, allocator replay), what the device does
# that meta tensors do not (kernel rules; values answered without data), the step and the installation it runs
# in, the Trainer clients, the several-GPU wing, and the entry points. Its folders on one row are wings.
SIMULATE_LAYERS = (
    ("memory",),
    ("kernels", "values"),
    ("trace", "step", "adapters", "predict", "crashes"),
    ("clients",),
    ("distributed",),
    ("api", "cli", "peaks", "__init__"),
)
SIMULATE_RANK = {unit: rank for rank, units in enumerate(SIMULATE_LAYERS) for unit in units}
SIMULATE_WINGS = ("memory", "kernels", "values", "clients", "distributed")
# Formulas and fits are pure: a formula or a coefficient file is usable without torch or transformers.
PURE = ("formulas", "fit")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (functions included), absolute names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:
                base = module_name(path).split(".")[: -node.level + (1 if path.name == "__init__.py" else 0)]
                found.add(".".join(base + [node.module]))
            else:
                found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = {t for t in imports(path) if t in modules and t != name}
        edges[name] = targets
    return edges


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle)


def test_every_module_has_a_layer():
    assert {unit(m) for m in graph()} - set(RANK) == set()


def test_imports_go_down_the_layers():
    upward = [f"{source} imports {target}" for source, targets in graph().items() for target in targets
              if RANK[unit(target)] > RANK[unit(source)]]
    assert upward == []


def test_wings_never_import_each_other():
    crossing = [f"{source} imports {target}" for source, targets in graph().items() for target in targets
                if unit(source) != unit(target) and RANK[unit(source)] == RANK[unit(target)] != RANK["cli"]]
    assert crossing == []


def simulate_unit(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def simulate_edges() -> list[tuple[str, str]]:
    return [(source, target) for source, targets in graph().items() for target in targets
            if unit(source) == unit(target) == "simulate"]


def test_simulate_has_layers_of_its_own():
    assert {simulate_unit(m) for m in graph() if unit(m) == "simulate"} == set(SIMULATE_RANK)
    upward = [f"{s} imports {t}" for s, t in simulate_edges()
              if SIMULATE_RANK[simulate_unit(t)] > SIMULATE_RANK[simulate_unit(s)]]
    crossing = [f"{s} imports {t}" for s, t in simulate_edges() if simulate_unit(s) != simulate_unit(t)
                and simulate_unit(s) in SIMULATE_WINGS and simulate_unit(t) in SIMULATE_WINGS
                and SIMULATE_RANK[simulate_unit(s)] == SIMULATE_RANK[simulate_unit(t)]]
    assert upward == [] and crossing == []


def test_the_root_holds_only_the_entry_point():
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py", "cli.py"]
    assert {unit(module_name(p)) for p in PACKAGE.rglob("*.py")} <= set(RANK)


@pytest.mark.parametrize("pure", PURE)
def test_knowledge_needs_no_torch(pure):
    paths = [p for p in PACKAGE.rglob("*.py") if unit(module_name(p)) == pure]
    heavy = {t for p in paths for t in imports(p) if t.split(".")[0] in ("torch", "transformers")}
    assert paths and not heavy


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
