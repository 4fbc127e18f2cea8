"""The package's folders are layers (docs/architecture.md, *Layers*): a module
imports from its own folder and from layers below it, never up, and no group of
modules imports itself round a cycle. Every import counts, annotation-only and
function-local ones too, since each is a dependency a reader has to follow."""

import mlx_engine

import ast
from pathlib import Path

PACKAGE = Path(mlx_engine.__file__).parent

# Bottom to top; a folder (or top-level module) imports only those before it.
LAYERS = [
    "errors",
    "declare",
    "results",
    "loading",
    "structured",
    "tools",
    "caches",
    "pricing",
    "decode",
    "draft",
    "heads",
    "drafters",
    "runtime",
    "embeddings",
    "kits",
    "request",
    "distributed",
    "api",
    "server",
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("mlx_engine",) + path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (``from pkg import module`` names the module)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts and ".".join(parts) != name:
                out.add(".".join(parts))
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package itself (re-exports everything)


def test_every_folder_is_a_declared_layer():
    layers = {_layer(m) for m in _graph()} - {None, "__main__"}
    assert layers <= set(LAYERS), f"add {sorted(layers - set(LAYERS))} to LAYERS and docs/architecture.md"


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for module, targets in _graph().items():
        here = _layer(module)
        if here is None:
            continue
        for target in targets:
            there = _layer(target)
            if there is None and here == "server":
                continue  # the server stands on the public API: ``import mlx_engine``
            if there is None or (there != here and LAYERS.index(there) > LAYERS.index(here)):
                upward.append(f"{module} -> {target}")
    assert not upward, upward


def test_no_import_cycle_between_modules():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


# The server's folders, bottom to top (docs/architecture.md, *The HTTP server*); its
# top-level modules (app.py, __main__.py) wire them and stand above all four.
SERVER_LAYERS = ["web", "hosting", "core", "apis"]


def _server_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["mlx_engine", "server"]:
        return None
    if len(parts) > 3:  # in a folder of the server: -1 for one that is not a declared layer
        return SERVER_LAYERS.index(parts[2]) if parts[2] in SERVER_LAYERS else -1
    return len(SERVER_LAYERS)  # the server's own top-level modules


def test_server_folders_are_layers():
    upward = []
    for module, targets in _graph().items():
        here = _server_layer(module)
        if here is None or here == len(SERVER_LAYERS):
            continue
        assert here >= 0, f"add {module.split('.')[2]} to SERVER_LAYERS and docs/architecture.md"
        for target in targets:
            there = _server_layer(target)
            if there is not None and there > here:
                upward.append(f"{module} -> {target}")
    assert not upward, upward
