"""The project's shape: the library's stage packages in data-flow order and the Dagster layer above them, imports
only downward, no cycles, module docstrings.

Reads the source with `ast` (imports inside functions count too), so what an
editor or an import-graph tool sees is what is checked.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_assets"
DAGSTER = PACKAGE.parent / "dagster_project"

# Each top-level unit of the library and its floor: a unit may import only units on its floor or below.
FLOORS = {
    "store": 0, "cache_keys": 0, "torch_compile": 0, "chart_data": 0, "stage_io": 0, "quality_gates": 0,  # foundations
    "bundle": 0, "atomic_write": 0, "settings": 0,
    "prompts": 1,
    "target_model": 2,
    "generation": 3,
    "tokenization": 4,
    "hidden_states": 5,
    "drafter": 6,
    "embedded": 7,  # the tiny targets and the embedded engine: built from the stages below
    "demo": 7,  # the demo's library parts (recipe, answers preview, plan vs run, untrained tau), for dagster_project.demo
    "planning": 7,  # the corpus's cost plan: measured on the fleet and the store, arithmetic over stage shapes
    "self_generated": 7,  # prompts the target writes itself: sampled, filtered by prompts', decontaminated by drafter's rule
    "pipes_worker": 8, "cli": 8,  # entry points
}
# The stages in data-flow order (the target_model package serves them all, the embedded default sits on top).
STAGES = ["prompts", "target_model", "generation", "tokenization", "hidden_states", "drafter", "embedded"]
# Floors of the unit-level import graph, measured by test_floors_are_at_most_the_stages_plus_two (cli and
# pipes_worker on floor 7: the one atomic writer sits under the store and the cache keys); docs/development.md
# says the same number.
MEASURED_FLOORS = 7


# The Dagster layer sits above the whole library (it imports the library; the library never imports it). Its units
# are its modules (assets/ is one unit), each on a floor: a unit imports only units on a lower floor.
DAGSTER_FLOORS = {
    "profile": 0, "charts": 0, "partitions": 0, "jobs": 0, "instance_config": 0,  # environment, charts, names
    "resources": 1, "config": 1, "metadata": 1,  # deployment resources, run config, metadata
    "pipes": 2, "versions": 2, "sensors": 2,  # the GPU launcher (a resource), code versions, the source sensor
    "assets": 3, "deployment": 3,  # asset bodies; the profile's resources built from the environment
    "definitions": 4,  # the code location
    "demo": 5,  # `make demo`: drives the code location's assets (its library parts are dflash_assets.demo)
}
# Floors of the Dagster layer's unit-level import graph, measured by test_dagster_layer_has_at_most_six_floors;
# docs/development.md says the same number.
DAGSTER_MEASURED_FLOORS = 6


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules that `name` imports, anywhere in the file (relative imports resolved)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t not in ("dflash_assets", "dagster_project"):
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items() if name != "dflash_assets"}


def _unit(module: str) -> str:
    return module.split(".")[1]


def test_every_module_belongs_to_a_known_unit():
    units = {_unit(m) for m in _graph()}
    assert units == set(FLOORS), f"new units must get a floor: {sorted(units ^ set(FLOORS))}"


def test_imports_only_go_down_the_floors():
    upward = sorted(f"{src} -> {dst}" for src, dsts in _graph().items() for dst in dsts
                    if FLOORS[_unit(dst)] > FLOORS[_unit(src)])
    assert upward == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle a depth-first walk of ``graph`` meets (lazy imports included)."""
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_import_cycles_between_modules():
    assert _cycles(_graph()) == []


def test_floors_are_at_most_the_stages_plus_two():
    graph = _graph()
    units: dict[str, set[str]] = {}
    for src, dsts in graph.items():
        units.setdefault(_unit(src), set()).update(_unit(d) for d in dsts if _unit(d) != _unit(src))
    depth: dict[str, int] = {}

    def floor(unit: str) -> int:
        if unit not in depth:
            depth[unit] = 1 + max((floor(d) for d in units.get(unit, ())), default=0)
        return depth[unit]

    floors = max(floor(u) for u in units)
    # The bound is the stages plus two; the recorded count ratchets it, so a new floor fails here
    # until it is looked at (and MEASURED_FLOORS and docs/development.md's count are updated on purpose).
    bound = min(len(STAGES) + 2, MEASURED_FLOORS)
    assert floors <= bound, (
        f"{floors} floors of imports measured (recorded {MEASURED_FLOORS}, at most {len(STAGES) + 2} "
        f"for {len(STAGES)} stages): {sorted(depth.items(), key=lambda kv: kv[1])}")


def test_every_module_opens_with_a_docstring():
    """Every module opens with a docstring, and (package ``__init__`` files aside) it says what the module
    reads and what it writes, if only nothing ("Reads and writes nothing" counts for both)."""
    missing, silent = [], []
    for name, path in _modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if not doc:
            missing.append(name)
            continue
        if path.name == "__init__.py":
            continue
        unsaid = [word for word, pattern in (("reads", r"\bread"), ("writes", r"\bwrit"))
                  if not re.search(pattern, doc, re.IGNORECASE)]
        if unsaid:
            silent.append(f"{name}: its docstring does not say what it {' or '.join(unsaid)}")
    assert missing == []
    assert silent == []


# Size limits: a function or method counts from its def line to its last line (decorators left out); a module
# counts all its lines. Longer ones are split into named steps.
MAX_FUNCTION_LINES = 100
MAX_LIBRARY_MODULE_LINES = 700


def test_no_function_or_library_module_over_the_size_limits():
    """No function of the library or the Dagster layer over MAX_FUNCTION_LINES lines, no library module over
    MAX_LIBRARY_MODULE_LINES lines; the failure lists each one and its length."""
    too_long = []
    for package in (PACKAGE, DAGSTER):
        for name, path in _modules(package).items():
            text = path.read_text()
            if package == PACKAGE and (lines := len(text.splitlines())) > MAX_LIBRARY_MODULE_LINES:
                too_long.append(f"{name}: {lines} lines (module)")
            too_long += [f"{name}.{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
                         for node in ast.walk(ast.parse(text))
                         if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert too_long == [], (f"over {MAX_FUNCTION_LINES} lines a function or {MAX_LIBRARY_MODULE_LINES} a library "
                            f"module: {too_long}")


def test_the_library_imports_no_dagster():
    offenders = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(m == "dagster" or m.startswith(("dagster.", "dagster_")) and m != "dagster_pipes" for m in mods):
                offenders.append(name)
    assert offenders == []


# -- the Dagster layer -------------------------------------------------------------------------------------------


def _project_graph() -> dict[str, set[str]]:
    """Module -> project modules it imports, over the library and the Dagster layer together."""
    modules = {**_modules(PACKAGE), **_modules(DAGSTER)}
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()
            if name not in ("dflash_assets", "dagster_project")}


def _dagster_unit(module: str) -> str | None:
    """``dagster_project.assets.drafter`` -> ``assets``; None for a library module."""
    parts = module.split(".")
    return parts[1] if parts[0] == "dagster_project" else None


def test_every_dagster_module_belongs_to_a_known_unit():
    units = {_dagster_unit(m) for m in _project_graph()} - {None}
    assert units == set(DAGSTER_FLOORS), f"new units must get a floor: {sorted(units ^ set(DAGSTER_FLOORS))}"


def test_the_library_never_imports_the_dagster_layer():
    upward = sorted(f"{src} -> {dst}" for src, dsts in _project_graph().items() for dst in dsts
                    if _dagster_unit(src) is None and _dagster_unit(dst) is not None)
    assert upward == []


def test_dagster_imports_only_go_down_the_floors():
    upward = sorted(f"{src} -> {dst}" for src, dsts in _project_graph().items() for dst in dsts
                    if _dagster_unit(src) is not None and _dagster_unit(dst) is not None
                    and _dagster_unit(dst) != _dagster_unit(src)
                    and DAGSTER_FLOORS[_dagster_unit(dst)] >= DAGSTER_FLOORS[_dagster_unit(src)])
    assert upward == []


def test_no_import_cycles_across_the_project():
    """No module of the library or the Dagster layer reaches itself through its imports (lazy ones included)."""
    assert _cycles(_project_graph()) == []


def test_dagster_layer_has_at_most_six_floors():
    """The longest chain of Dagster units importing each other (the library below counts as none)."""
    units: dict[str, set[str]] = {}
    for src, dsts in _project_graph().items():
        if (unit := _dagster_unit(src)) is not None:
            units.setdefault(unit, set()).update(
                d for d in map(_dagster_unit, dsts) if d is not None and d != unit)
    depth: dict[str, int] = {}

    def floor(unit: str) -> int:
        if unit not in depth:
            depth[unit] = 1 + max((floor(d) for d in units.get(unit, ())), default=0)
        return depth[unit]

    floors = max(floor(u) for u in units)
    assert floors <= DAGSTER_MEASURED_FLOORS <= 6, (
        f"{floors} floors of imports in dagster_project (recorded {DAGSTER_MEASURED_FLOORS}, at most 6): "
        f"{sorted(depth.items(), key=lambda kv: kv[1])}")


def test_every_dagster_module_opens_with_a_docstring():
    assert [name for name, path in _modules(DAGSTER).items() if not ast.get_docstring(ast.parse(path.read_text()))] == []


# Where a tokenizer may be loaded: the target package (the spec loads it, the chat object carries it) and the
# embedded target builders.
TOKENIZER_LOADERS = ("target_model", "embedded")


def test_no_tokenizer_is_loaded_outside_the_target_package():
    """No `AutoTokenizer`, nor `from_pretrained` / `from_file` of a tokenizer class, outside the target package
    (and the embedded builders): the stages take the target's chat object (`TargetModelSpec.chat()`), so its
    template override and template kwargs reach them all."""
    offenders = []
    for name, path in _modules().items():
        if name == "dflash_assets" or _unit(name) in TOKENIZER_LOADERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.alias) and "AutoTokenizer" in node.name:
                offenders.append(f"{name}: imports {node.name}")
            elif isinstance(node, ast.Name) and node.id == "AutoTokenizer":
                offenders.append(f"{name}: uses AutoTokenizer")
            elif (isinstance(node, ast.Attribute) and node.attr in ("from_pretrained", "from_file")
                  and "Tokenizer" in ast.unparse(node.value)):
                offenders.append(f"{name}: {ast.unparse(node)}")
    assert offenders == []


# --- the tests' layout: tests/<package>/test_<module>.py ------------------------------------------------------------
TESTS = PACKAGE.parent / "tests"
# Test modules at the top of tests/: they test no one package but the whole (the shape, the demo graph end to end,
# the install lock, what a run may read).
TOP_LEVEL_TESTS = {
    "test_architecture.py": "the project's shape, read from the source",
    "test_end_to_end.py": "the demo graph through Dagster, every stage",
    "test_lock.py": "constraints.txt against pyproject.toml",
    "test_trust_boundaries.py": "what a run may read and where secrets go, across the Dagster layer and the library",
}
# Test folders named other than a package of dflash_assets: `library` holds the tests of dflash_assets' top-level
# modules (dflash_assets/cache_keys.py -> tests/library/test_cache_keys.py); the Dagster layer mirrors its own tree;
# `bench` holds the tests of the bench scripts; `support` the tests of the test support (tests/support, not installed).
TEST_FOLDERS_OUTSIDE_THE_STAGES = {"library": PACKAGE, "dagster_project": DAGSTER, "dagster_project/assets": DAGSTER / "assets",
                                   "bench": PACKAGE.parent / "bench", "support": PACKAGE.parent / "tests" / "support"}
# Library modules without a tests/<package>/test_<module>.py, and why (the file named exercises it).
NO_TEST_MODULE = {
    "dflash_assets/demo.py": "tested through tests/dagster_project/test_demo.py (`make demo`) and tests/test_end_to_end.py",
    "dflash_assets/stage_io.py": "data only (the plain types between the Pipes worker and the stage libraries)",
    "dflash_assets/pipes_worker.py": "tested through tests/dagster_project/test_pipes.py (its selftest and the GPU-host stages)",
    "dflash_assets/store/schemas.py": "data only (Arrow schemas)",
}


def _package_of_test_folder(folder: str) -> Path:
    return TEST_FOLDERS_OUTSIDE_THE_STAGES.get(folder, PACKAGE / folder)


def test_every_test_module_sits_in_the_folder_of_a_package():
    """tests/<package>/test_<module>.py: each folder is named after a package that exists (`library`: the top of
    dflash_assets, a namespace package) and is itself a package, so two folders may hold test modules of one name."""
    misplaced = []
    for path in sorted(TESTS.rglob("test_*.py")):
        folder = path.parent.relative_to(TESTS).as_posix()
        if folder == ".":
            if path.name not in TOP_LEVEL_TESTS:
                misplaced.append(f"{path.name}: at the top of tests/, but not in TOP_LEVEL_TESTS")
            continue
        package = _package_of_test_folder(folder)
        if not any(package.glob("*.py")):
            misplaced.append(f"{folder}/{path.name}: no package {folder}")
        if not (path.parent / "__init__.py").is_file():
            misplaced.append(f"{folder}/{path.name}: tests/{folder} has no __init__.py")
    assert misplaced == []


def test_every_library_module_has_a_test_module_or_a_reason():
    """Each dflash_assets/**/*.py (not __init__) has tests/<package>/test_<module>.py or a line in NO_TEST_MODULE;
    no line there for a module that has a test module or no longer exists, and every test file a reason names exists."""
    missing = []
    modules = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    for path in modules:
        rel = path.relative_to(PACKAGE.parent).as_posix()
        folder = path.parent.relative_to(PACKAGE).as_posix()
        test = TESTS / ("library" if folder == "." else folder) / f"test_{path.name}"
        if test.is_file() == (rel in NO_TEST_MODULE):
            missing.append(f"{rel}: " + ("has a test module and a NO_TEST_MODULE line" if test.is_file()
                                          else "no test module and no NO_TEST_MODULE line"))
    known = {p.relative_to(PACKAGE.parent).as_posix() for p in modules}
    missing += [f"{rel}: in NO_TEST_MODULE, but no such module" for rel in NO_TEST_MODULE if rel not in known]
    missing += [f"{rel}: names {name}, which does not exist" for rel, reason in NO_TEST_MODULE.items()
                for name in re.findall(r"tests/[\w/]+\.py", reason) if not (PACKAGE.parent / name).is_file()]
    assert missing == []


# The modules that read the project's settings from the environment: the library's and the Dagster layer's.
SETTINGS_MODULES = {"dflash_assets/settings.py", "dagster_project/profile.py"}


def _environment_reads(path: Path) -> list[str]:
    """``DFLASH_*`` names read in `path`: ``os.environ.get(name)``, ``os.getenv(name)``, ``os.environ[name]``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        key = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr == "get" and ast.unparse(f.value).endswith("environ")) or ast.unparse(f) == "os.getenv":
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and ast.unparse(node.value).endswith("environ"):
            key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.startswith("DFLASH_"):
            found.append(f"{path.relative_to(PACKAGE.parent).as_posix()}:{node.lineno} reads {key.value}")
    return found


def test_settings_are_read_in_the_settings_modules_only():
    """A ``DFLASH_*`` variable is read in dflash_assets/settings.py or dagster_project/profile.py only, so each
    setting has one parser, one default and one place a reader finds it."""
    reads = [r for root in (PACKAGE, DAGSTER) for path in sorted(root.rglob("*.py"))
             if path.relative_to(PACKAGE.parent).as_posix() not in SETTINGS_MODULES for r in _environment_reads(path)]
    assert reads == []
    assert _environment_reads(DAGSTER / "profile.py"), "the check finds the reads it looks for"


def test_the_tiny_demo_is_read_in_one_module_only():
    """Every test that takes the session's tiny demo (the ``tiny_demo`` fixture) is in tests/test_end_to_end.py:
    ``make test``'s pytest-xdist workers take a module each, so the demo runs once per suite, on one worker."""
    from tests.conftest import WHOLE_GRAPH_TESTS

    readers = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") \
                    and "tiny_demo" in [a.arg for a in node.args.args]:
                readers.setdefault(path.relative_to(TESTS).as_posix(), []).append(node.name)
    assert set(readers) == {WHOLE_GRAPH_TESTS}, readers
    assert len(readers[WHOLE_GRAPH_TESTS]) >= 4  # the check finds the readers it looks for
