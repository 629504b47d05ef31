"""``--fork-each``: every test marked ``forks`` runs in a process forked for it alone from pytest's process, which runs
no test itself. A fork copies the threads its process has started, and a test's forked children must not inherit the
threads of the tests before it (after a ``torch.export``, a backward starts autograd's device threads, and a child
forked after that cannot run a backward). Reports come back through pytest's own report serialisation; a child that
dies (a signal, an exit) is reported as a failure naming how."""
from __future__ import annotations

import json
import os
import signal
import tempfile

import pytest
from _pytest.runner import runtestprotocol


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fork-each", action="store_true", default=False,
                     help="run each test marked `forks` in a process forked for it alone")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    if not item.config.getoption("fork_each") or item.get_closest_marker("forks") is None:
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in _reports_of_child(item):
        item.ihook.pytest_runtest_logreport(report=report)
    item.session._setupstate.teardown_exact(nextitem)  # what earlier tests of this process set up, as pytest does
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _reports_of_child(item: pytest.Item) -> list[pytest.TestReport]:
    """The reports of ``item`` run (set up, called, torn down) in a forked child."""
    hook = item.config.hook
    with tempfile.TemporaryDirectory() as folder:
        results = os.path.join(folder, "reports.json")
        pid = os.fork()
        if pid == 0:  # the child: runs the test, writes its reports, and leaves without running pytest's exit code
            code = 1
            try:
                reports = runtestprotocol(item, log=False, nextitem=None)
                with open(results, "w") as file:
                    json.dump([hook.pytest_report_to_serializable(config=item.config, report=r) for r in reports],
                              file)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            with open(results) as file:
                return [hook.pytest_report_from_serializable(config=item.config, data=data) for data in json.load(file)]
        died = (f"signal {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status)
                else f"exit code {os.WEXITSTATUS(status)}")
    return [pytest.TestReport(item.nodeid, item.location, {name: 1 for name in item.keywords}, "failed",
                              f"the test's forked process died ({died}) before it reported", "call")]
