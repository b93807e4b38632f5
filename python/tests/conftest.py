import os
import pathlib
import signal
import time

import pytest

from gaps.testing import local_cluster

# The tests' model: two dense tensors and one embedding table.
LAYOUT = pathlib.Path(__file__).parent / "fixtures" / "layout.toml"


@pytest.fixture(scope="module")
def layout_file() -> pathlib.Path:
    return LAYOUT


@pytest.fixture(scope="module")
def cluster(layout_file):
    with local_cluster(layout_file, servers=2, rule="sgd", lr=0.5) as c:
        yield c


def pytest_report_header(config):
    return f"GAPS_BIN_DIR={os.environ.get('GAPS_BIN_DIR', '(PATH)')}"


def _gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie nobody reaps counts as exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


@pytest.fixture
def survivors():
    """``survivors(pids)``: waits up to 30 s for every process in ``pids`` to exit; returns those still
    running (after SIGKILLing them, so a failing test leaves nothing behind)."""

    def wait(pids, seconds: float = 30.0) -> list:
        deadline = time.monotonic() + seconds
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in pids if not _gone(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
        return left

    return wait
