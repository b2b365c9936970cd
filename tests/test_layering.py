"""The layers docs/architecture.md draws, checked on the import graph built from the source.

Every import counts: at the top of a module, under ``if TYPE_CHECKING:``, inside a function
(a late import is still a dependency, and a cycle hidden that way still couples the two sides).
``from . import x`` and ``from .. import y`` are resolved. An import names the module it reaches:
``from pagedkv.memory.block_pool import BlockPool`` is an edge to ``pagedkv.memory.block_pool``;
``from pagedkv.memory import KVCacheManager`` one to the package ``pagedkv.memory`` (its
``__init__``); ``from pagedkv import envs`` one to the module ``pagedkv.envs``.

A *unit* is a subpackage (``pagedkv.memory``, with everything below it) or a top-level module
(``pagedkv.envs``); ``pagedkv`` itself (its ``__init__``: the public API) is the unit "pagedkv".
The checks:

- no cycle between modules, and none between units;
- every import from one unit into another is a row of ``ALLOWED`` below, which is the table of
  ``docs/architecture.md``: users (cli, server, sim, bench) -> engine -> memory; engine -> runner ->
  models -> ops; shared facts (shapes, units, errors, env vars, KV events) at the bottom;
- the units marked pure Python import no torch or triton, anywhere, and only pure units (this is
  what lets the simulator, the sizing tool and the memory tests run without a model; the
  subprocess tests in test_memory_core.py / test_model_shape.py check the same at run time).

A new package or top-level module needs a row here, with the reason; an import the table does not
allow is either a layering mistake or a new row to argue for in review.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest


def _repo_root() -> Path:
    here = Path(__file__).resolve().parent
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "pagedkv").is_dir():
            return folder
    raise RuntimeError(f"no repository root (pyproject.toml beside pagedkv/) above {here}")


ROOT = _repo_root()
PACKAGE = "pagedkv"

# Facts every layer may read: pure Python, importing nothing of pagedkv but each other.
FACTS = frozenset({"errors", "units", "envs", "model_shape", "block_size", "weight_quant", "kv_events"})

# unit -> (the units it may import, why). Mirrors docs/architecture.md's table of packages.
ALLOWED: dict[str, tuple[frozenset[str], str]] = {
    # -- users of the engine ----------------------------------------------------------------
    "pagedkv": (frozenset({"llm", "lora", "outputs", "sampling_params"}),
                "the public API: LLM (loaded lazily), SamplingParams, RequestOutput, LoRARequest"),
    "cli": (FACTS | {"bench_cli", "chat_cli", "server", "sim", "llm", "engine", "memory", "sampling_params",
                     "progress", "pagedkv"},
            "the `pagedkv` command dispatches to its subcommands; `pagedkv kv-cache clear|info` works on a "
            "disk tier's folder without an engine (memory.tiers.disk_store / disk_files)"),
    "bench_cli": (FACTS | {"benchmark", "engine", "models", "progress", "sampling_params", "workloads"},
                  "`pagedkv bench`: builds the engine from its flags and runs pagedkv.benchmark; resolves "
                  "--model first (models.loader.resolve_model_path) so a bad path fails before a long start"),
    "chat_cli": (FACTS | {"engine", "sampling_params"}, "`pagedkv chat` drives an LLMEngine"),
    "server": (FACTS | {"engine", "lora", "outputs", "sampling_params", "pagedkv"},
               "the HTTP server talks to the engine (requests in, outputs and KV events out); LoRARequest "
               "and LoRAError are request types of the public API; __version__ from pagedkv"),
    "sim": (FACTS | {"memory", "workloads"},
            "the simulator drives the real, torch-free memory core (sim/paged.py) on workload shapes"),
    "llm": (FACTS | {"engine", "lora", "outputs", "progress", "sampling_params"},
            "LLM: the offline API over one LLMEngine"),
    "benchmark": (FACTS | {"sampling_params", "workloads"},
                  "turns workloads into token ids and times an engine it is given (pure Python)"),
    # -- the engine and what it wires --------------------------------------------------------
    "engine": (FACTS | {"memory", "runner", "models", "ops", "lora", "speculative", "sampling", "outputs",
                        "sampling_params", "distributed"},
               "the one wiring point: builds the model and runner (build.py: models, ops.kv_format), the "
               "memory core, the speculative decoder, LoRA; never the other way round"),
    "speculative": (FACTS | {"memory", "runner", "sampling"},
                    "proposals and their verification; the draft model has its own runner and memory core; "
                    "it never imports the engine (the engine holds it)"),
    "sampling": (FACTS | {"sampling_params", "outputs"},
                 "logits -> tokens (sampler, rejection sampler, grammar bitmasks): used by engine and "
                 "speculative alike, so neither imports the other for it"),
    "lora": (FACTS | {"models"},
             "adapters wrap the model's linear layers (reads models' config and weight names)"),
    "memory": (frozenset({"errors", "kv_events", "model_shape", "units"}),
               "the paging core: pure Python, no torch, no environment (its settings are passed in); knows "
               "shapes, errors and KV events"),
    "runner": (FACTS | {"models", "ops", "lora", "distributed"},
               "owns the tensors: runs the model (models) with the kernels (ops) and LoRA slots"),
    "models": (FACTS | {"ops", "paths", "progress", "sampling_params", "distributed"},
               "pure model code over the ops' kernels; caches converted files under paths.cache_root(); "
               "reads generation_config.json's sampling defaults by SamplingParams' names"),
    "ops": (FACTS | {"paths", "progress"},
            "kernels and their native build (cached under paths.cache_root()); imports no model"),
    "distributed": (FACTS,
                    "tensor parallelism's bottom: a rank's group (collectives) and the rules that split a "
                    "model (group.py); the launcher of the ranks; imports no model or runner"),
    # -- shared facts and helpers (pure Python) ----------------------------------------------
    "outputs": (FACTS, "RequestOutput / CompletionOutput: what a request returns"),
    "sampling_params": (FACTS, "SamplingParams: what a request asks for"),
    "workloads": (FACTS, "workload shapes for benchmarks and the simulator"),
    "progress": (frozenset({"envs"}), "start-up phase lines on stderr (PAGEDKV_QUIET)"),
    "paths": (frozenset({"envs"}), "pagedkv's cache folder (PAGEDKV_CACHE_DIR)"),
    "model_shape": (frozenset({"errors", "units"}), "model dimensions and KV bytes, read by every layer"),
    "block_size": (frozenset({"model_shape"}),
                   "the block-size choice (auto: model, context, the device's measured kernel preference) and "
                   "its warnings, made alike by the engine and `pagedkv size`"),
    "weight_quant": (frozenset({"errors"}), "the linear-weight formats (pure)"),
    "kv_events": (frozenset(), "KV cache event types, shared by memory (records), engine and server (publishes)"),
    "errors": (frozenset(), "PagedKVError, the base of every error raised on purpose"),
    "units": (frozenset(), "byte sizes and their spelling"),
    "envs": (frozenset(), "every environment variable pagedkv reads"),
}

# Units that are pure Python: no torch (nor triton) anywhere in them, and only pure units below.
PURE = frozenset({"memory", "sim", "benchmark", "outputs", "sampling_params", "workloads", "progress", "paths"}
                 | FACTS)
TORCH = ("torch", "triton")
# What tests and benchmarks use and the package must never import: their helpers ship beside it.
TEST_ONLY = ("pagedkv_testing", "tests", "conftest")


# -- the graph --------------------------------------------------------------------------------

def find_modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``root/package`` (a package by its
    ``__init__``'s name)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterable[tuple[str, tuple[str, ...]]]:
    """(imported module, names imported from it) for every import in ``tree``, wherever it is."""
    base = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                parts = base.split(".")
                if node.level - 1 > len(parts) - 1:
                    raise ValueError(f"{module}: relative import beyond the top package")
                anchor = parts[: len(parts) - (node.level - 1)]
                target = ".".join(anchor + ([target] if target else []))
            yield target, tuple(alias.name for alias in node.names)


def module_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (itself excluded)."""
    modules = find_modules(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for target, names in _imports(tree, name, path.name == "__init__.py"):
            if target != package and not target.startswith(package + "."):
                continue
            reached = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            if not reached:  # names defined in the module (or package) itself
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                reached = [target]
            graph[name].update(r for r in reached if r != name)
    return graph


def unit_of(module: str, package: str = PACKAGE) -> str:
    """``pagedkv.memory.block_pool`` -> "memory"; ``pagedkv.envs`` -> "envs"; ``pagedkv`` -> "pagedkv"."""
    return module.split(".")[1] if module != package else package


def unit_graph(graph: Mapping[str, set[str]], package: str = PACKAGE) -> dict[str, dict[str, set[str]]]:
    """Unit -> unit it imports -> the modules that do (the evidence for a failure message)."""
    units: dict[str, dict[str, set[str]]] = {unit_of(m, package): {} for m in graph}
    for module, targets in graph.items():
        a = unit_of(module, package)
        for target in targets:
            b = unit_of(target, package)
            if a != b:
                units[a].setdefault(b, set()).add(f"{module} -> {target}")
    return units


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                    found.append(sorted(component))
    return sorted(found)


def disallowed(units: Mapping[str, Mapping[str, set[str]]],
               allowed: Mapping[str, tuple[frozenset[str], str]]) -> list[str]:
    """One line per unit -> unit import the table does not allow (with the modules that do it)."""
    problems = []
    for a, targets in sorted(units.items()):
        if a not in allowed:
            problems.append(f"{a}: no row in ALLOWED (a new package or top-level module: add its row and why)")
            continue
        for b, evidence in sorted(targets.items()):
            if b not in allowed[a][0]:
                problems.append(f"{a} -> {b} is not allowed: {sorted(evidence)}")
    return problems


def outside_imports(root: Path, package: str, units: Iterable[str] | None, tops: Iterable[str]) -> list[str]:
    """``module: import`` for every import of a top-level name in ``tops`` by the modules of
    ``units`` (None: every unit)."""
    wanted, tops = None if units is None else set(units), set(tops)
    found = []
    for name, path in find_modules(root, package).items():
        if wanted is not None and unit_of(name, package) not in wanted:
            continue
        for target, _ in _imports(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            if target.split(".")[0] in tops:
                found.append(f"{name}: {target}")
    return found


def torch_imports(root: Path, package: str, units: Iterable[str]) -> list[str]:
    """``module: import`` for every torch/triton import in the given units' modules."""
    return outside_imports(root, package, units, TORCH)


# -- the checks on pagedkv ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return module_graph(ROOT, PACKAGE)


def test_no_module_cycles(graph: dict[str, set[str]]) -> None:
    found = cycles(graph)
    assert not found, f"import cycles between modules (every import counts, TYPE_CHECKING too): {found}"


def test_no_package_cycles(graph: dict[str, set[str]]) -> None:
    units = unit_graph(graph)
    found = cycles({a: set(bs) for a, bs in units.items()})
    detail = {a: {b: sorted(units[a][b]) for b in units[a] if b in c} for c in found for a in c}
    assert not found, f"import cycles between packages: {found}; the imports: {detail}"


def test_imports_between_packages_follow_the_layers(graph: dict[str, set[str]]) -> None:
    problems = disallowed(unit_graph(graph), ALLOWED)
    assert not problems, "imports outside the layers of docs/architecture.md:\n" + "\n".join(problems)


def test_the_table_has_no_stale_rows(graph: dict[str, set[str]]) -> None:
    units = set(unit_graph(graph))
    assert set(ALLOWED) <= units, f"rows for units that no longer exist: {sorted(set(ALLOWED) - units)}"
    named = {b for targets, _ in ALLOWED.values() for b in targets}
    assert named <= units, f"rows name units that do not exist: {sorted(named - units)}"
    assert all(why for _, why in ALLOWED.values())


def test_pure_units_import_no_torch_and_only_pure_units(graph: dict[str, set[str]]) -> None:
    assert not torch_imports(ROOT, PACKAGE, PURE), torch_imports(ROOT, PACKAGE, PURE)
    for unit in sorted(PURE):
        impure = ALLOWED[unit][0] - PURE
        assert not impure, f"{unit} is pure Python but its row allows {sorted(impure)}"


def test_the_package_imports_no_test_helper() -> None:
    found = outside_imports(ROOT, PACKAGE, None, TEST_ONLY)
    assert not found, f"pagedkv imports test-only code (pagedkv_testing, tests): {found}"


# -- the checks can fail ------------------------------------------------------------------------

def _write(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


SYNTHETIC = {
    "pkg/__init__.py": "from pkg.api import run\n",
    "pkg/api.py": "def run():\n    from pkg.core import engine  # late, still an edge\n",
    "pkg/facts.py": "",
    "pkg/core/__init__.py": "from . import engine\n",
    "pkg/core/engine.py": ("from typing import TYPE_CHECKING\nfrom ..facts import *\nfrom .store import Store\n"
                           "if TYPE_CHECKING:\n    from pkg.api import run\n"),
    "pkg/core/store.py": "import pkg.facts\nfrom pkg.core import engine\n",
    "pkg/io/__init__.py": "",
    "pkg/io/disk.py": "import torch\nfrom pkg import facts\n",
}


def test_the_graph_counts_every_kind_of_import(tmp_path: Path) -> None:
    _write(tmp_path, SYNTHETIC)
    g = module_graph(tmp_path, "pkg")
    assert g["pkg"] == {"pkg.api"}
    assert g["pkg.api"] == {"pkg.core.engine"}  # inside a function
    assert g["pkg.core"] == {"pkg.core.engine"}  # from . import x, in a package
    assert g["pkg.core.engine"] == {"pkg.facts", "pkg.core.store", "pkg.api"}  # .., ., TYPE_CHECKING
    assert g["pkg.core.store"] == {"pkg.facts", "pkg.core.engine"}
    assert g["pkg.io.disk"] == {"pkg.facts"}  # from pkg import <module>
    assert torch_imports(tmp_path, "pkg", {"io"}) == ["pkg.io.disk: torch"]
    assert outside_imports(tmp_path, "pkg", None, {"torch"}) == ["pkg.io.disk: torch"]
    assert torch_imports(tmp_path, "pkg", {"core", "api"}) == []


def test_a_cycle_is_found(tmp_path: Path) -> None:
    _write(tmp_path, SYNTHETIC)
    g = module_graph(tmp_path, "pkg")
    # engine <-> store, and api -> engine (late) with engine -> api (TYPE_CHECKING): one component
    assert cycles(g) == [["pkg.api", "pkg.core.engine", "pkg.core.store"]]
    units = unit_graph(g, "pkg")
    assert units["core"]["api"] == {"pkg.core.engine -> pkg.api"}
    assert cycles({a: set(bs) for a, bs in units.items()}) == [["api", "core"]]  # via TYPE_CHECKING
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_an_import_outside_the_table_is_found(tmp_path: Path) -> None:
    _write(tmp_path, SYNTHETIC)
    units = unit_graph(module_graph(tmp_path, "pkg"), "pkg")
    table = {"pkg": (frozenset({"api"}), "."), "api": (frozenset({"core"}), "."), "core": (frozenset({"facts"}), "."),
             "facts": (frozenset(), ".")}
    assert disallowed(units, table) == [
        "core -> api is not allowed: ['pkg.core.engine -> pkg.api']",
        "io: no row in ALLOWED (a new package or top-level module: add its row and why)",
    ]
