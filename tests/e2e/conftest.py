"""The e2e tests' one local Ray cluster for the runs trained in the test process.

A test marked ``shared_cluster`` trains through ``e2e_runs.train_here``: the first such run starts a
local cluster as the command line does (``init_ray``) and later runs, in any module, join it. The
marked tests run first among the e2e tests, in their modules' order (:func:`pytest_collection_modifyitems`),
so the cluster starts once; it ends after the last of them (:func:`pytest_runtest_teardown`), before
the command-line runs, which start clusters of their own. Under ``make test``'s two xdist workers every
marked test goes to the same worker (tests/conftest.py), while the other worker runs the rest beside it.
"""

from __future__ import annotations

import pytest


def _shares(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("shared_cluster") is not None


def pytest_collection_modifyitems(config, items):
    """Within tests/e2e: the ``shared_cluster`` tests first, keeping each group's order."""
    e2e = [i for i, item in enumerate(items) if "/tests/e2e/" in str(item.path)]
    if e2e:
        block = [items[i] for i in e2e]
        for i, item in zip(e2e, [t for t in block if _shares(t)] + [t for t in block if not _shares(t)]):
            items[i] = item


@pytest.hookimpl(trylast=True)  # after the fixtures' teardown, which kills a module's workers
def pytest_runtest_teardown(item, nextitem):
    """End the shared cluster after the last test that uses it."""
    if _shares(item) and not _shares(nextitem):
        from agent_trainer.ray_cluster import shutdown_ray

        shutdown_ray()
