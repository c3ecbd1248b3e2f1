"""The layers of docs/architecture.md ("Layers"), held by reading every import statement of the tree.

Every import counts: top level, inside functions, under ``TYPE_CHECKING``. A module may import its own
layer and the layers below it; an import of a higher layer, a module cycle or a cycle between the
top-level packages fails, naming the file, the line and the rule.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("agent_trainer", "envs", "launch")

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("config", ("agent_trainer.config", "=agent_trainer")),
    ("envs", ("envs",)),
    ("common", ("agent_trainer.common",)),
    ("core_algos", ("agent_trainer.core_algos",)),
    ("episode", ("agent_trainer.episode",)),
    ("trajectory_rewards", ("agent_trainer.trajectory_rewards",)),
    ("condensers", ("agent_trainer.condensers",)),
    ("gateway", ("agent_trainer.gateway",)),
    ("agents", ("agent_trainer.agents",)),
    ("checks", ("agent_trainer.checks",)),
    ("workers", ("agent_trainer.workers",)),
    ("rollout", ("agent_trainer.rollout",)),
    ("observe", ("agent_trainer.observe",)),
    ("training", ("agent_trainer.training",)),
    ("cli", ("agent_trainer.main", "agent_trainer.sft", "agent_trainer.eval", "agent_trainer.plan",
             "agent_trainer.export", "agent_trainer.watchdog", "agent_trainer.cli_args",
             "agent_trainer.check_env", "agent_trainer.serve_env", "agent_trainer.ray_cluster")),
    ("launch", ("launch",)),
]
"""Lowest first: (layer, the modules it holds, by dotted prefix; the longest prefix wins; ``=name`` is that module
alone: the empty ``agent_trainer/__init__.py``). A layer is one folder of ``agent_trainer`` (the entry points are the
top of the package), so this order is also the allowed direction between folders: a folder imports only the folders
listed before it."""
BUILDERS = ("agent_trainer.main", "agent_trainer.sft", "agent_trainer.eval")
"""The entry points that build workers (``agent_trainer.workers.build``) and hand them to their trainer."""


def project_modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the four packages (a package is its ``__init__``)."""
    mods = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


MODULES = project_modules()


def imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The project modules an import statement of ``module`` loads (``from p import m`` names module p.m)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in MODULES]
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        if MODULES[module].name != "__init__.py":
            parts = parts[:-1]
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    found = []
    for alias in node.names:
        if f"{base}.{alias.name}" in MODULES:
            found.append(f"{base}.{alias.name}")
        elif base in MODULES:
            found.append(base)
    return found


def import_edges() -> list[tuple[str, str, int]]:
    """(importer, imported, line) for every import statement anywhere in a module."""
    edges = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges += [(module, target, node.lineno) for target in imported(module, node) if target != module]
    return edges


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest prefix naming ``module``."""
    best, index = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if prefix.startswith("="):
                if module == prefix[1:]:
                    return i
                continue
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, index = len(prefix), i
    if index is None:
        raise AssertionError(f"{module} is in no layer: add it to tests/test_layers.py LAYERS and docs/architecture.md")
    return index


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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
                    out.append(sorted(component))
    return out


def test_every_module_is_in_a_layer():
    for module in MODULES:
        layer_of(module)


def test_no_module_imports_a_higher_layer():
    upward = [f"{MODULES[a].relative_to(REPO)}:{line} imports {b} ({LAYERS[layer_of(b)][0]}), above its layer "
              f"{LAYERS[layer_of(a)][0]}" for a, b, line in import_edges() if layer_of(b) > layer_of(a)]
    assert not upward, "\n".join(upward)


def test_envs_never_imports_agent_trainer_nor_config_imports_the_runtime():
    wrong = [f"{MODULES[a].relative_to(REPO)}:{line} imports {b}" for a, b, line in import_edges()
             if (a.startswith("envs") and b.split(".")[0] != "envs")
             or (a.startswith("agent_trainer.config") and not b.startswith("agent_trainer.config"))]
    assert not wrong, "\n".join(wrong)


def test_no_module_cycle_and_no_package_cycle():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    packages: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for a, b, _ in import_edges():
        graph[a].add(b)
        if a.split(".")[0] != b.split(".")[0]:
            packages[a.split(".")[0]].add(b.split(".")[0])
    assert cycles(graph) == [], f"module cycles: {cycles(graph)}"
    assert cycles(packages) == [], f"package cycles: {cycles(packages)}"


def test_the_checker_sees_an_upward_import_and_a_cycle():
    """The rules above can fail: an import of the trainer from the config layer is upward, two modules that
    import each other are a cycle."""
    assert layer_of("agent_trainer.training.trainer") > layer_of("agent_trainer.config.schema")
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    tree = ast.parse("from agent_trainer.training import trainer\nfrom . import loading\n")
    found = [t for node in tree.body for t in imported("agent_trainer.config.schema", node)]
    assert found == ["agent_trainer.training.trainer", "agent_trainer.config.loading"]


def folder_of(module: str) -> str:
    """The folder (``agent_trainer/<folder>/``, or a top-level package) a module sits in; an entry point is its own."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "agent_trainer" and len(parts) > 1 else parts[0]


def test_no_folder_cycle():
    """Folders never import each other in a circle, counting every import (inside functions too)."""
    graph: dict[str, set[str]] = {folder_of(m): set() for m in MODULES}
    for a, b, _ in import_edges():
        if folder_of(a) != folder_of(b):
            graph[folder_of(a)].add(folder_of(b))
    assert cycles(graph) == [], f"folder cycles: {cycles(graph)}"
    assert cycles({"agent_trainer.agents": {"agent_trainer.condensers"},
                   "agent_trainer.condensers": {"agent_trainer.agents"}}) != []  # the check can fail


def test_only_the_entry_points_build_workers():
    """``agent_trainer.workers.build`` is imported by the workers themselves and by the entry points that build
    workers for their trainer (RL, SFT, evaluation); the trainers are handed a ``Workers`` (a type, under
    ``TYPE_CHECKING``)."""
    wrong = []
    for module, path in MODULES.items():
        if module.startswith("agent_trainer.workers") or module in BUILDERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and imported(module, node) == ["agent_trainer.workers.build"] * len(
                    node.names) and any(alias.name != "Workers" for alias in node.names):
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno}")
            elif isinstance(node, ast.Import) and any(a.name == "agent_trainer.workers.build" for a in node.names):
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not wrong, f"only {BUILDERS} build workers; these import the builder: {wrong}"
    assert any(LAYERS[layer_of(m)][0] == "cli" for m in BUILDERS)


def test_importing_the_config_loads_no_runtime():
    """``import agent_trainer.config`` in a fresh interpreter: the standard library, omegaconf and yaml (and what
    those two load) only."""
    code = ("import sys; import omegaconf, yaml; start = set(sys.modules); import agent_trainer.config; "
            "print(' '.join(sorted(set(sys.modules) - start)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    loaded = out.stdout.split()
    assert "agent_trainer.config.schema" in loaded  # the probe looks at the right interpreter
    roots = {name.split(".")[0] for name in loaded}
    heavy = sorted(roots & {"torch", "ray", "vllm", "transformers", "envs", "numpy"})
    assert not heavy, f"import agent_trainer.config loads {heavy}"
    project = sorted(m for m in loaded if m.split(".")[0] == "agent_trainer"
                     and m not in ("agent_trainer", "agent_trainer.config")
                     and not m.startswith("agent_trainer.config."))
    assert not project, f"import agent_trainer.config loads {project}"
    third_party = sorted(r for r in roots if r not in sys.stdlib_module_names and not r.startswith("_")
                         and r != "agent_trainer")
    assert not third_party, f"import agent_trainer.config loads {third_party} (allowed: stdlib, omegaconf, yaml)"
