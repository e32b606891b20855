"""The package's layering rule, checked on the source: every import goes down a layer, and no
import circle exists, between packages or between the modules of one package.

Layers, bottom to top (``docs/architecture.md`` draws them)::

    errors                                       typed errors
    config, sampling_params, outputs             plain data
    native                                       C++ sources, their build, huge pages
    attention, structured                        attention backends, grammars
    layers, metrics, sample                      building blocks, statistics, samplers
    models                                       model definitions
    quant                                        weight schemes (they quantize models)
    loading                                      files in and out, checkpoints written
    runner                                       one forward per step
    speculative                                  proposers
    distributed                                  process groups, shards, workers
    engine                                       requests, blocks, scheduling, the step
    compress, server                             applications of the engine
    bench                                        measures them (perplexity from compress)
    cli                                          the command line
    __main__, the package's __init__             entry points

A module may import modules of lower layers and modules of its own package (without circles).
Imports inside functions and under ``TYPE_CHECKING`` count too: a reader follows them the same.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "foudre"

LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    ("config", "sampling_params", "outputs"),
    ("native",),
    ("attention", "structured"),
    ("layers", "metrics", "sample"),
    ("models",),
    ("quant",),
    ("loading",),
    ("runner",),
    ("speculative",),
    ("distributed",),
    ("engine",),
    ("compress", "server"),
    ("bench",),
    ("cli",),
    ("__main__", ""),
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path) -> Iterable[str]:
    """Every ``foudre`` module that ``path`` imports, resolved to the deepest module that exists
    (``from foudre.x import y`` names ``foudre.x.y`` when ``y`` is a submodule)."""
    this = module_name(path, root)
    package = this.split(".") if path.name == "__init__.py" else this.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            named = [f"{module}.{alias.name}" for alias in node.names]
            # ``from package import submodule`` runs the package's ``__init__`` too: both count
            # (an ``__init__`` that imports nothing cannot close a circle)
            subs = [t for t in named if _exists(t, root)]
            targets = [module, *subs] if not subs or _imports(module, root) else subs
            targets = [t for t in targets if t != this]
        else:
            continue
        for target in targets:
            if target == root.name or target.startswith(root.name + "."):
                yield _deepest(target, root)


def _exists(module: str, root: Path) -> bool:
    rel = Path(*module.split(".")[1:])
    base = root / rel
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(package: str, root: Path) -> bool:
    """Whether ``package``'s ``__init__`` imports anything."""
    init = root / Path(*package.split(".")[1:]) / "__init__.py"
    if not init.is_file():
        return False
    tree = ast.parse(init.read_text(), str(init))
    return any(isinstance(node, ast.Import | ast.ImportFrom) for node in ast.walk(tree))


def _deepest(module: str, root: Path) -> str:
    parts = module.split(".")
    while len(parts) > 1 and not _exists(".".join(parts), root):
        parts.pop()
    return ".".join(parts)


def top_package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def import_graph(root: Path) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        graph[module_name(path, root)] = set(imported_modules(path, root))
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in graph.items():
        src = top_package(module)
        assert src in RANK, f"{module}: package {src!r} has no layer; add it to LAYERS"
        for target in targets:
            dst = top_package(target)
            if dst == src:
                continue
            if RANK[dst] >= RANK[src]:
                bad.append(f"{module} -> {target}")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        src = top_package(module)
        out.setdefault(src, set()).update(top_package(t) for t in targets if top_package(t) != src)
    return out


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Circles between modules, a package's ``__init__`` included: a module that imports its own
    package (``from foudre.quant import cpu_qmatmul`` inside ``foudre.quant``) closes a circle
    when that ``__init__`` imports the module back."""
    return cycles(graph)


def test_every_import_goes_down_a_layer() -> None:
    assert upward_imports(import_graph(ROOT)) == []


def test_no_circles_between_packages() -> None:
    assert cycles(package_graph(import_graph(ROOT))) == []


def test_no_circles_between_modules() -> None:
    assert module_cycles(import_graph(ROOT)) == []


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "foudre"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # an upward import, even under TYPE_CHECKING or inside a function
        (
            {
                "layers/__init__.py": "",
                "layers/a.py": "def f():\n    from foudre.engine import b\n",
                "engine/__init__.py": "",
                "engine/b.py": "",
            },
            ["foudre.layers.a -> foudre.engine.b"],
        ),
        (
            {
                "models/__init__.py": "",
                "models/m.py": "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from foudre.runner.r import X\n",
                "runner/__init__.py": "",
                "runner/r.py": "X = 1\n",
            },
            ["foudre.models.m -> foudre.runner.r"],
        ),
        # sideways, within one layer
        (
            {"server/__init__.py": "from foudre import compress\n", "compress/__init__.py": ""},
            ["foudre.server -> foudre.compress"],
        ),
    ],
)
def test_a_planted_upward_import_is_found(
    tmp_path: Path, files: dict[str, str], expected: list[str]
) -> None:
    root = _plant(tmp_path, {"__init__.py": "", **files})
    assert upward_imports(import_graph(root)) == expected


def test_a_planted_circle_is_found(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "from .a import A\n",
            "engine/a.py": "from foudre.engine.b import B\nA = 1\n",
            "engine/b.py": "from . import c\nB = 1\n",
            "engine/c.py": "from foudre.engine.a import A\n",
        },
    )
    graph = import_graph(root)
    assert upward_imports(graph) == []
    # ``from . import c`` runs ``engine/__init__``, which imports ``a``: the package is in it
    assert module_cycles(graph) == [
        ["foudre.engine", "foudre.engine.a", "foudre.engine.b", "foudre.engine.c"]
    ]


def test_a_module_importing_its_own_package_closes_a_circle(tmp_path: Path) -> None:
    """``quant/__init__`` -> ``api`` -> ``from foudre.quant import kernels`` is a circle through
    the package's ``__init__``; ``import foudre.quant.kernels as kernels`` is not."""
    files = {
        "__init__.py": "",
        "quant/__init__.py": "from foudre.quant.api import f\n",
        "quant/api.py": "from foudre.quant import kernels\nf = 1\n",
        "quant/kernels.py": "",
    }
    graph = import_graph(_plant(tmp_path, files))
    assert module_cycles(graph) == [["foudre.quant", "foudre.quant.api"]]
    files["quant/api.py"] = "import foudre.quant.kernels as kernels\nf = 1\n"
    assert module_cycles(import_graph(_plant(tmp_path / "fixed", files))) == []
