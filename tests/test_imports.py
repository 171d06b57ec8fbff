"""Dependencies run one way (docs/architecture.md, "Layers"): read from the source.

The allowed directions are the layer table of docs/architecture.md, read from there (one
table for the reader and the test). Every module under ``digenrl/`` is parsed and each of its imports of a ``digenrl``
module is an edge -- top-level ones and those inside functions alike, since a
function-local import is a dependency that merely waits for its first call (those under
``if TYPE_CHECKING:``, for annotations only, never run and are left out). Importing
``a.b.c`` from outside the package ``a.b`` also runs ``a/b/__init__.py``: an edge to
that package too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "digenrl"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
#: What the scheduling layer never loads, directly or through another module.
MODEL_LIBRARIES = {"torch", "diffusers", "transformers", "peft"}

#: What the config may import of the project: the pure leaves it is built from (the
#: schedule's switches and the options the policy reads; the algorithms' shapes and the
#: seeds of their draws; the checks every layer's settings are checked with), and the
#: package files importing them runs.
CONFIG_LEAVES = {"digenrl.schedulers", "digenrl.schedulers.switches",
                 "digenrl.schedulers.options", "digenrl.algorithms",
                 "digenrl.algorithms.base", "digenrl.algorithms.flow_grpo",
                 "digenrl.algorithms.diffusion_nft", "digenrl.algorithms.awm",
                 "digenrl.algorithms.dpo", "digenrl.seeding", "digenrl.checks"}

#: Import cycles among digenrl modules that are needed, each with its reason. None is.
ALLOWED_CYCLES: dict[frozenset[str], str] = {}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(module: str, path: Path, node: ast.Import | ast.ImportFrom,
             modules: set[str]) -> set[str]:
    """The digenrl modules one import statement of ``module`` loads."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package up
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        # ``from P import x`` loads P, and P.x when that is a module.
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                 for a in node.names]
    out = set()
    for name in names:
        if not (name == "digenrl" or name.startswith("digenrl.")):
            continue
        parts = name.split(".")
        # The module itself (or its nearest existing parent) and every package above it
        # that ``module`` is not inside of.
        for k in range(2, len(parts) + 1):
            target = ".".join(parts[:k])
            if target in modules and target != module and (
                    k == len(parts) or not (module + ".").startswith(target + ".")):
                out.add(target)
    return out


def _imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of a module that run (not those for annotations only)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if _type_checking(block)
                   for stmt in block.body for n in ast.walk(stmt)}
    return [node for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in typing_only]


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each digenrl module of ``package`` (a folder named ``digenrl``) -> the digenrl
    modules its imports load."""
    paths = {module_name(p, package.parent): p for p in package.rglob("*.py")}
    modules = set(paths)
    return {module: set().union(*(imported(module, path, node, modules)
                                  for node in _imports(path)))
            for module, path in paths.items()}


def library_imports(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each digenrl module -> the top-level names of the other libraries it imports."""
    out = {}
    for path in package.rglob("*.py"):
        names = set()
        for node in _imports(path):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif not node.level and node.module:
                names.add(node.module.split(".")[0])
        out[module_name(path, package.parent)] = names - {"digenrl"}
    return out


#: A row of the layer table: a module or package name, whether it stands for its
#: package file only (else for everything under it too), and its layer.
Entry = tuple[str, bool, str]


def layer_table(text: str) -> tuple[list[Entry], dict[str, set[str]]]:
    """The layer table between ``<!-- layers -->`` and ``<!-- /layers -->``: its names,
    and each layer -> the layers it may import (``every layer``: all of them)."""
    rows = text.split("<!-- layers -->")[1].split("<!-- /layers -->")[0].strip().splitlines()
    entries: list[Entry] = []
    allowed: dict[str, set[str]] = {}
    for row in rows[2:]:  # past the header and its rule
        layer, modules, may = (cell.strip() for cell in row.strip("|").split("|"))
        for piece in modules.split(","):
            name = piece.split("`")[1]
            entries.append((name if name == "digenrl" else f"digenrl.{name}",
                            "package file" in piece, layer))
        allowed[layer] = {m.strip() for m in may.split(",") if m.strip()}
    for layer, may in allowed.items():
        if may == {"every layer"}:
            allowed[layer] = set(allowed)
    return entries, allowed


def layer_of(module: str, entries: list[Entry]) -> str | None:
    """The layer of the table's most specific name covering ``module`` (a package file
    named as such before the package as a whole)."""
    covering = [(len(name), exact, layer) for name, exact, layer in entries
                if module == name or (not exact and module.startswith(name + "."))]
    return max(covering)[2] if covering else None


def layer_violations(graph: dict[str, set[str]], text: str) -> list[str]:
    """Every import against the layer table, and every module it places in no layer."""
    entries, allowed = layer_table(text)
    out = []
    for module in sorted(graph):
        mine = layer_of(module, entries)
        if mine is None:
            out.append(f"{module}: in no layer of the table")
            continue
        for dep in sorted(graph[module]):
            theirs = layer_of(dep, entries)
            if theirs != mine and theirs not in allowed[mine]:
                out.append(f"{module} ({mine}) imports {dep} ({theirs})")
    return out


def reachable(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    """``start`` and every module its imports load, transitively."""
    seen, todo = set(start), list(start)
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def _type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:``: imports for annotations only, never run."""
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_walk_sees_top_level_and_function_local_imports(graph):
    # Top level: the graph binds task functions.
    assert "digenrl.tasks.rollout" in graph["digenrl.graph.build"]
    # Inside a function: the command line loads the runner only to run.
    assert "digenrl.run.runner" in graph["digenrl.commands.cli"]
    # Imports for annotations only are no dependency: a rule names its core's type.
    assert "digenrl.schedulers.policy.core" not in graph["digenrl.schedulers.policy.rules"]
    # A submodule's package runs first: models/__init__ for anyone outside it.
    assert "digenrl.models" in graph["digenrl.models.lora"]
    assert "digenrl.models" not in graph["digenrl.models.registry"]


def test_the_cycle_finder_finds_a_cycle_through_a_function_local_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [frozenset("abc")]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_config_imports_only_its_pure_leaves(graph):
    extra = graph["digenrl.config"] - CONFIG_LEAVES
    assert not extra, f"digenrl/config.py imports {sorted(extra)}: a check that needs " \
                      f"another layer belongs in digenrl/run/world.py"
    # ... and the leaves import nothing of the project but each other.
    for leaf in CONFIG_LEAVES:
        assert graph[leaf] <= CONFIG_LEAVES, (leaf, graph[leaf])


def test_every_import_follows_the_layer_table(graph):
    wrong = layer_violations(graph, ARCHITECTURE.read_text())
    assert not wrong, "imports against docs/architecture.md's layer table:\n" + "\n".join(wrong)


def test_the_layer_table_refuses_an_arrow_against_it(tmp_path):
    """A copy of the package with one module added to the graph layer that imports the
    driver inside a function: the table's check names that import (and the run package's
    file it runs), and nothing else."""
    import shutil

    copy = tmp_path / "digenrl"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "graph" / "probe.py").write_text(
        "def submit():\n    from digenrl.run.driver import Driver\n    return Driver\n")
    wrong = layer_violations(import_graph(copy), ARCHITECTURE.read_text())
    assert wrong == ["digenrl.graph.probe (graph) imports digenrl.run (run)",
                     "digenrl.graph.probe (graph) imports digenrl.run.driver (run)"]


def test_the_scheduling_layer_loads_no_model_library_and_no_task_code(graph):
    """What the scheduling modules load, transitively: no torch (nor diffusers,
    transformers, peft) and no task, model or graph code, so the simulator and the
    scheduler's process run the policy without either."""
    libraries = library_imports()
    entries, _ = layer_table(ARCHITECTURE.read_text())
    schedulers = {m for m in graph if layer_of(m, entries) == "schedulers"}
    loaded = reachable(graph, schedulers)
    assert not {m for m in loaded if m.startswith(("digenrl.tasks", "digenrl.models",
                                                   "digenrl.graph"))}
    models = {m: sorted(libraries[m] & MODEL_LIBRARIES) for m in loaded
              if libraries[m] & MODEL_LIBRARIES}
    assert not models, f"the scheduling layer loads model libraries: {models}"


def test_no_import_cycles(graph):
    unexplained = [sorted(c) for c in cycles(graph) if c not in ALLOWED_CYCLES]
    assert not unexplained, f"import cycles among digenrl modules: {unexplained}"


def test_building_a_config_loads_nothing_but_the_config(tmp_path):
    """A config with a model folder, prompt files and model rewards is built without
    importing torch, a model family, the prompts or the rewards (what it names is
    checked by digenrl.run.world, before a run)."""
    import json
    import subprocess
    import sys

    (tmp_path / "model").mkdir()
    probe = f"""
import json, sys
from digenrl.config import config_from_dict
import dataclasses
cfg = config_from_dict({{"model": {{"path": {str(tmp_path / "model")!r}}},
                         "data": {{"prompt_file": "nowhere.txt"}},
                         "reward": {{"components": {{"unregistered": 1.0}}}},
                         "train": {{"lora_rank": 4, "lora_targets": ["nope"]}}}})
dataclasses.replace(cfg, seed=1)
print(json.dumps(sorted(m for m in sys.modules
                        if m.split(".")[0] in ("digenrl", "torch", "transformers"))))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout))
    assert loaded == {"digenrl", "digenrl.config"} | CONFIG_LEAVES, loaded


def test_the_driver_imports_no_model_package():
    """What the driver of a run imports, and asks of the default model's family (its
    latent shape and sigma schedule, as the graph is built), imports none of diffusers'
    model packages, peft or transformers' Qwen2-VL processor: those load only where a
    model is built (a worker), seconds of CPU a driver and a scheduler do without."""
    import json
    import subprocess
    import sys

    probe = """
import json, sys
import digenrl.commands.cli, digenrl.run.runner
from digenrl.config import load_config
from digenrl.models import family, flow_sigmas
cfg = load_config("workflows/configs/tiny.yaml")
family(cfg.model).latent_shape(); flow_sigmas(cfg.sampler, cfg.model)
print(json.dumps(sorted(m for m in sys.modules if m.startswith(
    ("diffusers.models", "diffusers.pipelines", "peft", "transformers.models.qwen2_vl")))))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
