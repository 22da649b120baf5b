"""Shared fixtures: a real shmstaged process on a private socket, and its segments; and the
order in which ``make test``'s workers take the tests (slowest first)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import STARTED, RawClient, RunningDaemon, start_daemon

from shmstage import instance, segment

#: Seconds each test file took (its tests' setup, call and teardown) in a recent run of the
#: whole suite on two workers: what ``make test``'s workers sort the files by. A hint, never
#: a result: a file missing from it counts as quick, a stale figure costs time at most.
#: ``--write-durations`` writes it anew from a run.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--write-durations",
        action="store_true",
        help=f"write tests/{DURATIONS.name}: each test file's seconds in this run",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test``: ``--dist loadfile --no-loadscope-reorder``), the
    slowest files first. A worker takes a whole file, so a module's shared fixtures (a
    daemon, a forkserver that imported a framework, a training run) are built once, not
    once on each worker; and the next file goes to whichever worker runs short, so with
    the longest started first no long file starts last while the other worker has nothing
    left to do (that tail was most of a minute)."""
    if hasattr(config, "workerinput"):
        seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))  # stable


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The ``node_wide`` run (``-m node_wide``, alone after the rest) reads only the test
    files that name the mark: importing the others cost it seconds of its half-minute.
    (A mark comes from a file's own text: no hook here adds one.)"""
    if (
        config.getoption("markexpr") == "node_wide"
        and collection_path.suffix == ".py"
        and collection_path.name.startswith("test_")
    ):
        return "node_wide" not in collection_path.read_text(errors="replace") or None
    return None


class DurationRecorder:
    """``--write-durations``: adds up each file's test phases as the reports come in (from
    the workers, under xdist), and writes them at the end, the slowest first."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        path = report.nodeid.split("::")[0]
        self.seconds[path] = self.seconds.get(path, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        ordered = sorted(self.seconds.items(), key=lambda kv: (-kv[1], kv[0]))
        DURATIONS.write_text(json.dumps({k: round(v, 1) for k, v in ordered}, indent=0) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("write_durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(DurationRecorder(), "shmstage-durations")


@pytest.fixture(autouse=True, scope="session")
def discard_every_daemon() -> Iterator[None]:
    """At the session's end, no daemon a test started is left running, nor its segments,
    lock file or journal directory in /dev/shm (a test that kills one leaves them for the
    successor it starts; one that ends first leaves them for nobody)."""
    yield
    for running in STARTED:
        running.discard()


@pytest.fixture(autouse=True)
def environment_restored() -> Iterator[None]:
    """Each test leaves ``os.environ`` as it found it: libraries set variables in-process
    (a Lightning run sets TORCHINDUCTOR_CACHE_DIR), and a later test in the same worker
    would otherwise run in an environment that depends on which tests came first. (What a
    module-scoped import sets stays for that module; ``user_forks`` gives such an
    environment a fork server of its own.)"""
    before = _environment()
    yield
    if _environment() != before:
        current = os.environ.get(_CURRENT)
        os.environ.clear()
        os.environ.update(before)
        if current is not None:
            os.environ[_CURRENT] = current


#: pytest's own variable, changed by every phase of every test.
_CURRENT = "PYTEST_CURRENT_TEST"


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != _CURRENT}


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[RunningDaemon]:
    running = start_daemon(tmp_path)
    yield running
    running.discard()  # never leak segments, a lock file or a journal into the next test


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoints"
    path.mkdir()
    return path


@pytest.fixture
def raw_client(daemon: RunningDaemon) -> Iterator[Callable[..., RawClient]]:
    made: list[RawClient] = []

    def make(**kwargs: object) -> RawClient:
        client = RawClient(daemon.socket, **kwargs)  # type: ignore[arg-type]
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.fixture
def instance_id() -> Iterator[str]:
    """A live daemon instance for in-process tests of jobs and the journal: its lock is held
    (so that no daemon on the node, this suite's or another's, reaps its segments as a dead
    instance's while a test uses them), and its segments go after the test."""
    lock = instance.InstanceLock.claim()
    yield lock.instance
    for name in segment.list_names(lock.instance):
        segment.unlink(name)
    lock.release()


@pytest.fixture(params=["one pass", "two passes"])
def read_passes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A restore's reads checksummed in the pass that reads (``shmstage.readsum``, where
    it is built) or in a second pass over the bytes read (Python, everywhere else)."""
    from shmstage import readsum

    if request.param == "two passes":
        monkeypatch.setattr(readsum, "_LIBRARY", None)
    elif not readsum.available():
        pytest.skip("shmstage._readsum is not built or not usable here")
    return str(request.param)
