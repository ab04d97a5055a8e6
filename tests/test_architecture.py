"""The import graph of ``qfuse/`` against the layers written in ``docs/architecture.md``: no
module imports one of a higher layer, and no modules import each other around a loop. Imports
inside functions count: a lazy import is still an arrow."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qfuse"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the qfuse modules it imports. ``from a import b`` is an arrow to ``a.b`` when
    that is a module (importing a submodule runs its package's ``__init__``, which is no arrow
    of the importer's), else to ``a``."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                         for a in node.names]
            else:
                continue
            targets |= {resolve(n) for n in names if n.split(".")[0] == "qfuse"}
        edges[module] = targets - {None, module}
    return edges


def _layers() -> list[list[str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (.+?) \|", text, flags=re.M)
    assert rows, "docs/architecture.md has no layer table"
    assert [int(n) for n, _ in rows] == list(range(1, len(rows) + 1)), "layers out of order"
    return [re.findall(r"`([\w.]+)`", cell) for _, cell in rows]


def _layer_of(module: str, layers: list[list[str]]) -> int | None:
    best, level = -1, None
    for i, names in enumerate(layers):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, level = len(name), i
    return level


def test_every_module_has_a_layer():
    layers = _layers()
    missing = sorted(m for m in _modules() if _layer_of(m, layers) is None)
    assert not missing, f"modules in no layer of docs/architecture.md: {missing}"


def test_no_import_runs_up_a_layer():
    layers = _layers()
    edges = _imports(_modules())
    upward = sorted(
        f"{a} (layer {_layer_of(a, layers) + 1}) imports {b} (layer {_layer_of(b, layers) + 1})"
        for a, targets in edges.items()
        for b in targets
        if _layer_of(b, layers) > _layer_of(a, layers)
    )
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    edges = _imports(_modules())
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


def test_the_check_finds_a_cycle_and_an_upward_import():
    """The graph reader sees lazy imports (a check that could not fail would prove nothing)."""
    modules = _modules()
    edges = _imports(modules)
    assert "qfuse.flows.swap" in edges["qfuse.flows.convert"]
    assert "qfuse.kernels.gemm.launch" in edges["qfuse.kernels.gemm.opaque"]
    layers = _layers()
    assert _layer_of("qfuse.flows.qat.lower", layers) > _layer_of("qfuse.kernels.gemm", layers)
