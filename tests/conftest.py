"""One compute thread in the test process too, like every rank: single-device references then sum in the same order.
Multi-process jobs run on warm ranks kept for the session (see _launch.py).

The tiers go by folder: every test under ``multi_process/`` is marked ``multiprocess`` here (no test marks itself);
every other test (``single_process/``) is single-process, and `_launch`'s launchers refuse to run under it."""

import os
import signal
from collections.abc import Generator, Iterator
from pathlib import Path

import _launch
import pytest
import torch
from _launch import worker_pools

MULTI_PROCESS = Path(__file__).parent / "multi_process"

# the shared helpers (see support.py) assert as a test module does: pytest reports the values that differ
pytest.register_assert_rewrite("support")
torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(MULTI_PROCESS):
            item.add_marker(pytest.mark.multiprocess)
        elif item.get_closest_marker("multiprocess"):
            raise pytest.UsageError(f"{item.nodeid} is marked multiprocess: move it to tests/multi_process/, whose "
                                    "tests conftest.py marks (and only those)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """Outside multi_process/ (setup, call and teardown), `_launch`'s launchers raise: a single-process test starts no
    process."""
    _launch.single_process_test = None if item.get_closest_marker("multiprocess") else item.nodeid
    try:
        return (yield)
    finally:
        _launch.single_process_test = None


@pytest.fixture(autouse=True, scope="session")
def _warm_ranks(request: pytest.FixtureRequest) -> Iterator[None]:
    """`launch` reuses the ranks of earlier jobs of its world size (started on first use, SIGKILLed at the end). Under
    pytest-xdist each worker keeps its own pools and hands their summary to the controller, which prints them all."""
    with worker_pools() as pools:
        yield
    if pools is not None:
        summary = pools.summary()
        workeroutput = getattr(request.config, "workeroutput", None)  # set on an xdist worker only
        if workeroutput is not None:
            workeroutput["pool_summary"] = f"{os.environ.get('PYTEST_XDIST_WORKER', 'worker')}: {summary}"
        else:
            _summaries.append(summary)


_summaries: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """pytest-xdist's controller: a worker's pool summary (see `_warm_ranks`)."""
    summary = getattr(node, "workeroutput", {}).get("pool_summary")
    if summary:
        _summaries.append(summary)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _summaries:
        terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _as_before() -> Iterator[None]:
    """A test that fits in-process leaves Lightning's changes to the process behind: the thread count
    (``_set_num_threads_if_needed``) and the environment (``MASTER_PORT`` of a store that still listens). Put both back,
    so a later test's single-device reference sums as the ranks do and a later launch does not reuse that port; and
    the signal handlers (a SIGINT handler left replaced made test_launch's interrupted launch wait for its timeout)."""
    environment = dict(os.environ)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    torch.set_num_threads(1)
    os.environ.clear()
    os.environ.update(environment)
    for signum, handler in handlers.items():
        if handler is not None and signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)
