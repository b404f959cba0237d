"""The import graph of `pipeline/` flows one way: no cycles (imports inside functions included),
and each module imports only from its own layer or the layers above it (docs/architecture.md)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pipeline"

# Top-level module or subpackage of pipeline/ -> layer; a module imports from layers <= its own.
LAYERS = {
    "plumbing": ("errors", "io", "paths", "provenance", "vocabulary", "arguments"),
    "inputs": ("registry", "configs", "modeling"),
    "measuring": ("adapters", "step", "autocast", "activations", "clients", "memory", "sweep", "simulate"),
    "knowledge": ("devices", "formulas", "features", "hook_features", "coefficients", "formula_fit", "formula_peak",
                  "formula_regression", "line_fit", "peak_constants", "fit", "adapter_terms"),
    "answers": ("estimate", "validate", "validate_settings"),
    "outputs": ("figures", "dataset", "publish", "serve"),
    "entry": ("cli", "__main__", "__init__"),
}
RANK = {unit: rank for rank, units in enumerate(LAYERS.values()) for unit in units}
# Knowledge is pure: a formula or a coefficient file is usable without torch or transformers.
PURE = ("devices", "formulas", "features", "hook_features", "coefficients", "adapter_terms")


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


@pytest.mark.parametrize("pure", PURE)
def test_knowledge_needs_no_torch(pure):
    paths = [p for p in PACKAGE.rglob("*.py") if unit(module_name(p)) == pure]
    heavy = {t for p in paths for t in imports(p) if t.split(".")[0] in ("torch", "transformers")}
    assert paths and not heavy


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
