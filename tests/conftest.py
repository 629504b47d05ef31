"""Test-wide settings: tiny models run fastest on one thread, and one thread keeps timings steady
when other processes share the two cores.

Hypothesis draws afresh on every run: the profile (``HYPOTHESIS_PROFILE``: ``ci`` by default,
``soak`` for ``make soak``) sets how many examples, and the run's seed is printed at the end so a
failure can be replayed with ``--hypothesis-seed=<seed>``."""
import inspect
import os
import random

import pytest
import torch
from fork_each import pytest_addoption, pytest_runtest_protocol  # noqa: F401 (hooks: ``--fork-each``)
from hypothesis import HealthCheck, Phase, settings

torch.set_num_threads(1)

# Shrinking re-traces models hundreds of times; a failure prints its drawn example and its seed instead.
settings.register_profile("ci", max_examples=30, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow], phases=[Phase.explicit, Phase.generate])
settings.register_profile("soak", settings.get_profile("ci"), max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Pick the run's seed (unless ``--hypothesis-seed`` gave one) and hand it to hypothesis' plugin."""
    if getattr(config.option, "hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(random.randrange(2**32))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``forks`` the tests of modules that fork processes: `make test` runs them after the others, each in a
    process forked for it alone (``--fork-each``), because a fork copies the threads that earlier tests in its
    process started (autograd's device threads make a forked child's backward fail)."""
    forking: dict[str, bool] = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        if module.__name__ not in forking:
            forking[module.__name__] = "fork_processes" in vars(module) or "os.fork(" in inspect.getsource(module)
        if forking[module.__name__]:
            item.add_marker(pytest.mark.forks)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    seed = config.option.hypothesis_seed
    terminalreporter.write_line(f"hypothesis profile {settings.get_current_profile_name()!r}, seed {seed} "
                                f"(replay: --hypothesis-seed={seed})")
