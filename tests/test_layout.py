"""The package's layout as a graph: every import between fp8dist's modules, at module level or inside a function,
with the package ``__init__`` each import runs, read from the source (nothing is imported; imports under
``if TYPE_CHECKING:`` never run and do not count). The FP8 backends never depend on a sharding engine nor read its
name, the library never imports the CLI, and nothing imports itself back in a cycle of any kind."""

from __future__ import annotations

import ast
from pathlib import Path

import fp8dist

PACKAGE = Path(fp8dist.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``: imports there never run."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def _packages_run(target: str, importer: str, modules: dict[str, Path]) -> set[str]:
    """The sub-package ``__init__``s importing ``target`` runs: every package on its path, but the root (the public
    facade every import passes) and the packages the importer itself is inside (already running)."""
    parts = target.split(".")
    return {p for p in (".".join(parts[:i]) for i in range(2, len(parts)))
            if p in modules and not (importer == p or importer.startswith(p + "."))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The fp8dist modules ``name`` imports, lazily or not: ``from X import y`` names module X.y when that is a
    module, else X; and the package ``__init__``s each import runs on its way."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    skipped = _type_checking_blocks(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    found |= {p for m in list(found) for p in _packages_run(m, name, modules)}
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _edges(graph: dict[str, set[str]], source: str, target: str) -> list[tuple[str, str]]:
    inside = lambda m, p: m == p or m.startswith(p + ".")  # noqa: E731
    return sorted((a, b) for a, bs in graph.items() for b in bs if inside(a, source) and inside(b, target))


def test_the_graph_reads_real_imports():
    """The reader sees what is there: known edges, module-level and lazy, and the package ``__init__`` an import
    runs, are found (so an empty answer below means no such import, not a blind reader)."""
    graph = _graph()
    assert "fp8dist.accounting.rows" in graph["fp8dist.accounting.precision_report"]  # module level, relative
    assert "fp8dist.pipeline.api" in graph["fp8dist.accounting.row_dtypes"]  # inside a function
    assert "fp8dist.cli.common" in graph["fp8dist.cli.train"]
    assert {"fp8dist.checkpoint", "fp8dist.accounting"} <= graph["fp8dist"]
    # importing fp8dist.strategies.local_shards runs fp8dist/strategies/__init__.py first
    assert {"fp8dist.strategies.local_shards", "fp8dist.strategies"} <= graph["fp8dist.pipeline.meta_init"]
    # ... but a module inside a package does not run its own package's __init__ again
    assert "fp8dist.strategies" not in graph["fp8dist.strategies.fsdp"]


def test_the_reader_counts_package_inits_and_skips_type_checking(tmp_path):
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import x\n"
    (tmp_path / "a.py").write_text(source + "def f():\n    from .pkg.c import y\n")
    modules = {"fp8dist.a": tmp_path / "a.py", "fp8dist.b": tmp_path / "b.py", "fp8dist.pkg": tmp_path / "p.py",
               "fp8dist.pkg.c": tmp_path / "c.py"}
    assert _imports("fp8dist.a", tmp_path / "a.py", modules) == {"fp8dist.pkg", "fp8dist.pkg.c"}


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_fp8_backends_and_sharding_strategies_do_not_import_each_other():
    graph = _graph()
    assert _edges(graph, "fp8dist.fp8", "fp8dist.strategies") == []
    assert _edges(graph, "fp8dist.strategies", "fp8dist.fp8") == []


AXES = {"strategies": "STRATEGIES", "fp8": "BACKENDS", "memory_levels": "LEVELS"}
"""Each axis's folder and its registry (config/axis.py)."""
_DESCRIBES_AN_AXIS = ("strategy", "engine", "fp8", "backend", "memory", "level")


def _axis_names() -> dict[str, set[str]]:
    from fp8dist.config import axis

    import fp8dist.fp8, fp8dist.memory_levels, fp8dist.strategies  # noqa: E401,F401  (the built-ins register)
    return {folder: set(getattr(axis, registry)) for folder, registry in AXES.items()}


AXIS_OPTIONS = ("strategy", "fp8", "memory")
"""The options that choose an axis value: their defaults (``strategy: StrategyName = "fsdp"`` in config/options.py,
each written once) name a value by nature."""


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of string statements (module, class and function docstrings, the attribute docstrings under fields) and
    of an axis option's default."""
    found = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return found | {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)
                    and isinstance(n.target, ast.Name) and n.target.id in AXIS_OPTIONS}


def _beside_axis_names(tree: ast.AST, names: set[str]) -> set[int]:
    """ids of the constants that stand where an axis value would: in a tuple, list, set or dict's keys with another
    axis name, or in a comparison whose text names a strategy, an engine, a backend or a level. "none" is a value
    of other options too (activation_checkpointing, a dtype's word): it counts as the strategy's name only there."""
    found = set()
    for node in ast.walk(tree):
        items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) and any(
                isinstance(e, ast.Constant) and e.value in names - {"none"} for e in items):
            found |= {id(e) for e in items}
        if isinstance(node, ast.Compare) and any(w in ast.unparse(node) for w in _DESCRIBES_AN_AXIS):
            for side in (node.left, *node.comparators):
                found |= {id(side), *(id(e) for e in getattr(side, "elts", ()))}
    return found


def axis_names_outside_their_folders(package: Path = PACKAGE) -> list[tuple[str, int, str]]:
    """Every string constant equal to an axis value's name (a strategy, an FP8 backend, a memory level) in a module
    outside that axis's folder: ``(path, line, name)``. Docstrings aside, and prose: a message is a longer string."""
    axes = _axis_names()
    names = set().union(*axes.values())
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        tree = ast.parse(path.read_text())
        skipped, beside = _docstrings(tree), _beside_axis_names(tree, names)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names):
                continue
            if id(node) in skipped or node.value == "none" and id(node) not in beside:
                continue
            if any(node.value in values and relative.startswith(folder + "/") for folder, values in axes.items()):
                continue
            found.append((relative, node.lineno, node.value))
    return sorted(found)


def test_no_axis_value_is_named_outside_its_own_folder():
    """A tool asks the strategy, backend or level object; it never tests a name (``strategy == "deepspeed"``), so
    a new value is one file (tests/test_extension.py)."""
    assert axis_names_outside_their_folders() == []


def test_the_axis_name_finder_finds_names(tmp_path):
    (tmp_path / "tool.py").write_text('"""fsdp in a docstring is prose."""\nif cfg.strategy == "deepspeed":\n'
                                      '    x = ("none", "ddp")\nmode = "none"\nmsg = "use strategy=\'fsdp\'"\n'
                                      'strategy: str = "fsdp"\nother: str = "fsdp"\n')
    (tmp_path / "fp8").mkdir()
    (tmp_path / "fp8" / "te.py").write_text('NAME = "te"\nOTHER = "lean"\n')
    assert axis_names_outside_their_folders(tmp_path) == [("fp8/te.py", 2, "lean"), ("tool.py", 2, "deepspeed"),
                                                          ("tool.py", 3, "ddp"), ("tool.py", 3, "none"),
                                                          ("tool.py", 7, "fsdp")]


CORE = ("fp8dist.pipeline", "fp8dist.config", "fp8dist.strategies", "fp8dist.fp8", "fp8dist.memory_levels",
        "fp8dist.plan")
"""wrap_model and what it runs: the pipeline, its config, the three axes, the plan and its advisors."""
TOOLS = ("fp8dist.checkpoint", "fp8dist.accounting", "fp8dist.bench", "fp8dist.cli", "fp8dist.train")
"""What stands around the pipeline and uses it."""


def test_the_pipeline_imports_no_tool():
    """Tools import the pipeline, never the other way round: wrap_model runs without checkpointing, accounting,
    the bench, the CLI or the training job (lazily or not)."""
    graph = _graph()
    assert [edge for core in CORE for tool in TOOLS for edge in _edges(graph, core, tool)] == []


def test_the_library_never_imports_the_cli():
    graph = _graph()
    users = sorted(a for a, bs in graph.items() for b in bs
                   if (b == "fp8dist.cli" or b.startswith("fp8dist.cli.")) and not a.startswith("fp8dist.cli")
                   and a != "fp8dist.__main__")
    assert users == []


TOP_LEVEL = ["__init__.py", "__main__.py", "accounting", "bench", "checkpoint", "cli", "config", "fp8", "integrations",
             "launch", "memory_levels", "numerics", "pipeline", "plan", "runtime", "strategies", "train"]
"""The architecture at a glance: config and the runtime services, the three axes, the plan with its speed model,
the pipeline, the numerics probe, the tools around them and the integrations with other trainers (README's Layout
section says what each holds; tests/test_layers.py's STACK their order)."""


def test_the_top_level_shows_the_architecture_in_at_most_15_folders():
    """Every module lives in a folder that says what it is part of; no loose helper at the top: beside the package's
    ``__init__.py`` and ``__main__.py`` (``python -m fp8dist``), at most 15 folders: the 14 of the import stack
    (tests/test_layers.py's STACK) and ``launch`` (the shipped launch scripts)."""
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert entries == TOP_LEVEL
    assert len([e for e in entries if e not in ("__init__.py", "__main__.py")]) <= 15
    for folder in TOP_LEVEL:
        if "." not in folder and folder != "launch":
            assert (PACKAGE / folder / "__init__.py").is_file(), folder


def test_every_public_name_is_fp8dists_own():
    """``fp8dist.__all__`` names objects defined in fp8dist (nothing re-exported from elsewhere by accident)."""
    for name in fp8dist.__all__:
        value = getattr(fp8dist, name)
        assert name == "__version__" and isinstance(value, str) or value.__module__.startswith("fp8dist"), name
