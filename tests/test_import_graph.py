"""The import rule: no cycle between the packages of zerokl.

The graph is built from the source, not from what a run happened to import: every
``import`` / ``from ... import`` of every module, those inside functions included (an
import moved into a function hides a cycle from Python, not from this test). A node is a
package (``zerokl.kernels``, ``zerokl.kernels.model``, ``zerokl.services.routing``, ...);
the modules directly in the root package ``zerokl`` are nodes of their own: the root holds
the command-line application (one module a command, above everything), the shared
vocabulary (``zerokl.vocab``) and the tokenizer (below everything), not one layer.

The rule is also per file, over the whole tree (the numerics library, the services, the
application): no cycle between modules, function-level imports counted. The library's
top (its front door ``zerokl/kernels/__init__.py``, the fingerprint, whose golden cases include
the model's forward, and ``zerokl.kernels.verify``, which checks the fingerprint) sits above
``zerokl.kernels.model``: a node of its own (``LIBRARY_TOP``), the rest of the package below it.
"""
from __future__ import annotations

import ast
import functools
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """module name -> (file, is a package's __init__), over the packages pyproject installs."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs, out = setup["package-dir"], {}
    for pkg in setup["packages"]:
        top = max((p for p in dirs if pkg == p or pkg.startswith(p + ".")), key=len)
        folder = ROOT / dirs[top] / pkg[len(top):].lstrip(".").replace(".", "/")
        for f in folder.glob("*.py"):
            out[pkg if f.name == "__init__.py" else f"{pkg}.{f.stem}"] = (f, f.name == "__init__.py")
    return out


MODULES = _modules()


# The modules of zerokl.kernels above zerokl.kernels.model (see the module docstring): the
# package-level graph names them apart from the ops layer, which never imports the model.
LIBRARY_TOP = {"zerokl.kernels", "zerokl.kernels.fingerprint", "zerokl.kernels.verify"}
TOP_NODE = "zerokl.kernels:top"


def node(module: str) -> str:
    """The graph node of a module: its package, or itself for a module of the root package
    (the numerics library's top is TOP_NODE)."""
    if module in LIBRARY_TOP:
        return TOP_NODE
    if MODULES[module][1]:
        return module
    package = module.rpartition(".")[0]
    return module if package == "zerokl" else package


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def statements(module: str) -> list[tuple[int, list[str]]]:
    """(line, absolute names) of every import statement of `module`, those inside functions included.
    `from pkg import name` names the submodule pkg.name when there is one, else pkg itself (a name its
    __init__ defines); relative imports resolved; names outside zerokl (grpc, torch) kept as written."""
    path, is_pkg = MODULES[module]
    here = module if is_pkg else module.rpartition(".")[0]
    out = []
    for imp in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(imp, ast.Import):
            names = [a.name for a in imp.names]
        elif isinstance(imp, ast.ImportFrom):
            base = imp.module or ""
            if imp.level:
                parts = here.split(".")
                base = ".".join(parts[:len(parts) - imp.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in imp.names]
        else:
            continue
        out.append((imp.lineno, names))
    return out


def _imports(module: str) -> list[tuple[str, int]]:
    """(zerokl module imported, line) for every import statement of `module` (see :func:`statements`); a
    package's parents, which Python also runs, are not counted (every submodule import would otherwise
    reach its package's __init__)."""
    return [(t, line) for line, names in statements(module) for t in {t for t in map(_resolve, names) if t}]


@functools.lru_cache(maxsize=None)
def import_edges() -> dict[str, dict[str, list[str]]]:
    """node -> node it imports -> where ("module:line"), for every import between two nodes."""
    edges: dict[str, dict[str, list[str]]] = {}
    for module in sorted(MODULES):
        for target, line in _imports(module):
            a, b = node(module), node(target)
            if a != b:
                edges.setdefault(a, {}).setdefault(b, []).append(f"{module}:{line}")
    return edges


@functools.lru_cache(maxsize=None)
def module_edges(prefix: str) -> dict[str, dict[str, list[str]]]:
    """module -> module it imports -> lines, between the modules (files) named `prefix` or under it."""
    inside = lambda m: m == prefix or m.startswith(prefix + ".")   # noqa: E731
    edges: dict[str, dict[str, list[str]]] = {}
    for module in sorted(filter(inside, MODULES)):
        for target, line in _imports(module):
            if inside(target) and target != module:
                edges.setdefault(module, {}).setdefault(target, []).append(f"{module}:{line}")
    return edges


def cycles(edges: dict[str, dict[str, list[str]]], nodes: set[str] | None = None) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan); nodes: every node by default."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(nodes if nodes is not None else {node(m) for m in MODULES}):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_the_tree():
    edges = import_edges()
    assert {"zerokl.kernels", "zerokl.kernels.model", "zerokl.services.routing", "zerokl.vocab",
            "zerokl.cli"} <= {node(m) for m in MODULES}
    # imports inside functions count (the CLI imports its commands lazily)
    assert "zerokl.services.inference" in edges["zerokl.cli"]
    assert "zerokl.kernels" in edges["zerokl.kernels.model"]
    files = module_edges("zerokl.kernels")
    assert "zerokl.kernels.ops" in files["zerokl.kernels.model.model"]            # a module, not its package
    assert "zerokl.kernels.triton" in files["zerokl.kernels.backend"]             # a function-level import


def test_no_import_cycle_between_packages():
    edges = import_edges()
    found = cycles(edges)
    where = [f"{a} -> {b}: {', '.join(edges[a][b][:4])}" for c in found for a in c for b in c if b in edges.get(a, {})]
    assert not found, "import cycles between packages:\n" + "\n".join(where)


def test_no_import_cycle_between_files():
    """Per module, not per package, function-level imports included, over the whole tree (the numerics
    library, the services and the command-line application): an import moved into a function hides a
    cycle from Python (the module is then whole when the function runs), not from the layering. Break a
    cycle by moving what the lower module needs down."""
    edges = module_edges("zerokl")
    assert "zerokl.kernels.ops" in edges["zerokl.kernels.model.model"]                 # the library's files
    assert "zerokl.services.engine.engine" in edges["zerokl.services.inference.server"]   # the services'
    found = cycles(edges, set(MODULES))
    where = [f"{a} -> {b}: {', '.join(edges[a][b][:4])}" for c in found for a in c for b in c if b in edges.get(a, {})]
    assert not found, "import cycles between modules:\n" + "\n".join(where)


def test_the_vocabulary_imports_nothing_of_zerokl():
    edges = import_edges()
    for leaf in ("zerokl.vocab", "zerokl.tokenizer"):
        assert leaf not in edges, f"{leaf} must stay below every package: {edges.get(leaf)}"


def test_the_numerics_library_is_below_the_model_and_its_backends():
    edges = import_edges()
    assert "zerokl.kernels.model" not in edges.get("zerokl.kernels", {})      # the ops layer; the top is above
    assert "zerokl.kernels.model" in edges[TOP_NODE]                          # the fingerprint's model case
    assert "zerokl.kernels" not in edges.get("zerokl.kernels.triton", {})   # kernels dispatch to triton, never back
    assert not any(t.startswith("zerokl.services") for t in edges.get("zerokl.kernels.model", {}))



def test_the_engine_imports_neither_grpc_nor_the_service_runtime():
    """The engine (the package of the process that owns the device) reports in its own terms; the replica's
    front maps them to gRPC statuses. Every import of every module under zerokl.services.engine counts,
    those inside functions too."""
    engine = [m for m in sorted(MODULES) if m == "zerokl.services.engine" or m.startswith("zerokl.services.engine.")]
    assert {"zerokl.services.engine.core", "zerokl.services.engine.child"} <= set(engine)
    found = [f"{module}:{lineno} imports {name}" for module in engine for lineno, names in statements(module)
             for name in names
             if name.split(".")[0] == "grpc" or name.split(".")[0].startswith("grpc_")
             or name == "zerokl.services.runtime" or name.startswith("zerokl.services.runtime.")]
    assert not found, "the engine must not import grpc or the service runtime:\n" + "\n".join(found)
