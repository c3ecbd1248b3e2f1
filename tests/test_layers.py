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

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("agent_trainer", "workers", "envs", "launch")

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("config", ("agent_trainer.config", "=agent_trainer")),
    ("envs", ("envs",)),
    ("algorithms", ("agent_trainer.core_algos", "agent_trainer.common.batch", "agent_trainer.common.checkpoint",
                    "agent_trainer.common.plugins", "agent_trainer.common.prompts", "agent_trainer.common.profiling")),
    ("episode", ("agent_trainer.episode.es_manager", "agent_trainer.agents", "agent_trainer.agents.ctx_manager",
                 "agent_trainer.agents.condensed_ctx", "agent_trainer.condensers", "agent_trainer.trajectory_rewards",
                 "agent_trainer.agents.demonstrations", "agent_trainer.episode.prompt_data", "agent_trainer.episode.rollout_shaping",
                 "agent_trainer.episode.collapse_metrics")),
    ("gateway", ("agent_trainer.gateway",)),
    ("checks", ("agent_trainer.checks",)),
    ("rollout", ("agent_trainer.rollout", "agent_trainer.rollout.multiturn", "agent_trainer.rollout.splits",
                 "agent_trainer.rollout.resets", "agent_trainer.rollout.turns", "agent_trainer.rollout.lanes",
                 "agent_trainer.rollout.engines", "agent_trainer.rollout.results", "agent_trainer.rollout.env_pool",
                 "agent_trainer.rollout.overlap")),
    ("workers", ("workers",)),
    ("observe", ("agent_trainer.observe.tracking", "agent_trainer.observe.metrics_export", "agent_trainer.observe.trajectories",
                 "agent_trainer.observe.viewer", "agent_trainer.observe.run_logs")),
    ("trainer", ("agent_trainer.training.trainer", "agent_trainer.training.reward_model", "agent_trainer.training.colocation",
                 "agent_trainer.training.lifecycle", "agent_trainer.training.memory_plan", "agent_trainer.worker_registry")),
    ("cli", ("agent_trainer.main", "agent_trainer.sft", "agent_trainer.eval", "agent_trainer.plan",
             "agent_trainer.export", "agent_trainer.watchdog", "agent_trainer.cli_args",
             "agent_trainer.check_env", "agent_trainer.serve_env")),
    ("launch", ("launch",)),
]
"""Lowest first: (layer, the modules it holds, by dotted prefix; the longest prefix wins; ``=name`` is that module
alone: the empty ``agent_trainer/__init__.py``)."""
WORKER_API_LAYERS = ("trainer", "cli")
"""The layers that may reach ``workers`` through ``agent_trainer.worker_registry.worker_api``."""


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
    tree = ast.parse("from agent_trainer import trainer\nfrom . import loading\n")
    found = [t for node in tree.body for t in imported("agent_trainer.config.schema", node)]
    assert found == ["agent_trainer.training.trainer", "agent_trainer.config.loading"]


def test_only_the_trainer_and_cli_layers_reach_workers_and_every_entry_resolves():
    from agent_trainer.worker_registry import WORKER_API, worker_api

    callers = []
    for module, path in MODULES.items():
        if not module.startswith("agent_trainer") or module == "agent_trainer.worker_registry":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Name) and node.id == "worker_api":
                callers.append(module)
    assert callers, "nothing calls worker_api: drop agent_trainer.worker_registry"
    wrong = sorted({m for m in callers if LAYERS[layer_of(m)][0] not in WORKER_API_LAYERS})
    assert not wrong, f"{wrong} reach workers through worker_api but sit below the trainer layer"
    for name, path in WORKER_API.items():
        assert path.startswith("workers."), (name, path)
        assert worker_api(name) is not None
    with pytest.raises(KeyError, match="not in agent_trainer.worker_registry.WORKER_API"):
        worker_api("no_such_worker")


def test_importing_the_config_loads_no_runtime():
    """``import agent_trainer.config`` in a fresh interpreter: the standard library, omegaconf and yaml (and what
    those two load) only."""
    code = ("import sys; import omegaconf, yaml; start = set(sys.modules); import agent_trainer.config; "
            "print(' '.join(sorted(set(sys.modules) - start)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    loaded = out.stdout.split()
    assert "agent_trainer.config.schema" in loaded  # the probe looks at the right interpreter
    roots = {name.split(".")[0] for name in loaded}
    heavy = sorted(roots & {"torch", "ray", "vllm", "transformers", "envs", "workers", "numpy"})
    assert not heavy, f"import agent_trainer.config loads {heavy}"
    project = sorted(m for m in loaded if m.split(".")[0] == "agent_trainer"
                     and m not in ("agent_trainer", "agent_trainer.config")
                     and not m.startswith("agent_trainer.config."))
    assert not project, f"import agent_trainer.config loads {project}"
    third_party = sorted(r for r in roots if r not in sys.stdlib_module_names and not r.startswith("_")
                         and r != "agent_trainer")
    assert not third_party, f"import agent_trainer.config loads {third_party} (allowed: stdlib, omegaconf, yaml)"
