"""shmstaged as a systemd service, from systemd's side of real sockets and real processes.

Configuration files that stop it, ``--check-config``, sd_notify datagrams from the real
daemon, socket activation through the real ``systemd-socket-activate``, SIGHUP reloads
under connected clients, metrics over HTTP, and trainers that outlive a daemon restart.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from harness import RawClient, RunningDaemon, shmstaged_command, start_daemon
from shmstage_client import DaemonLost, Stager, StagingLimitExceeded
from test_notify import ServiceManager

from shmstage import checkpoint, segment
from shmstage.control import ControlClient

WAIT_S = 20.0
EX_CONFIG = 78


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def run_shmstaged(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*shmstaged_command(), *args], capture_output=True, text=True, timeout=timeout
    )


def wait_for(condition: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """AF_UNIX paths are limited to 108 bytes; pytest's tmp_path can be longer."""
    with tempfile.TemporaryDirectory(prefix="svc-", dir="/tmp") as tmp:
        yield Path(tmp)


@pytest.fixture
def manager(short_dir: Path) -> Iterator[ServiceManager]:
    mgr = ServiceManager(str(short_dir / "notify"), str(short_dir / "notify"))
    yield mgr
    mgr.sock.close()


def stop_and_clean(daemon: RunningDaemon) -> None:
    if daemon.proc.poll() is None:
        daemon.proc.kill()
        daemon.proc.wait(10)
    for name in segment.list_names(daemon.instance):
        segment.unlink(name)


# --------------------------------------------------------------------- configuration


BAD_CONFIGS = [
    pytest.param(
        "[limits]\nmax_job = 4\n",
        ["unknown key [limits] max_job", "did you mean max_jobs?"],
        id="unknown-key",
    ),
    pytest.param(
        '[limits]\nmax_jobs = "x"\n',
        ['[limits] max_jobs = "x": expected an integer ≥ 1'],
        id="wrong-type",
    ),
    pytest.param(
        '[limits]\nshm_budget = "1000TiB"\n',
        ['[limits] shm_budget = "1000TiB"', "exceeds the size of /dev/shm"],
        id="budget-over-dev-shm",
    ),
    pytest.param(
        '[log]\nlevel = "loud"\n[storage]\nfsync = "sometimes"\n',
        ['[log] level = "loud": expected one of', '[storage] fsync = "sometimes"'],
        id="every-problem-at-once",
    ),
]


@pytest.mark.parametrize(("text", "expected"), BAD_CONFIGS)
def test_bad_configuration_stops_the_daemon_before_it_serves(
    short_dir: Path, text: str, expected: list[str]
) -> None:
    config = write_config(short_dir / "bad.toml", text)
    sock = short_dir / "s.sock"
    out = run_shmstaged("--config", str(config), "--socket", str(sock))
    assert out.returncode == EX_CONFIG, out.stderr
    assert "configuration error; not starting" in out.stderr
    for fragment in expected:
        assert fragment in out.stderr
    assert str(config) in out.stderr  # the operator learns which file to fix
    assert not sock.exists()  # it never served


def test_data_write_settings_come_from_the_file_and_the_flags(short_dir: Path) -> None:
    good = write_config(
        short_dir / "good.toml", '[storage]\nio_threads = 2\nwrite_chunk = "1MiB"\n'
    )
    out = run_shmstaged(
        "--config", str(good), "--check-config", "--no-direct-io", "--write-buffers", "8MiB"
    )
    assert out.returncode == 0, out.stderr
    assert "writer_threads 16, io_threads 2, fsync always" in out.stdout
    assert "write_chunk 1.0 MiB, write_buffers 8.0 MiB, direct_io off" in out.stdout
    out = run_shmstaged("--check-config", "--write-chunk", "4MiB", "--write-buffers", "1MiB")
    assert out.returncode == EX_CONFIG
    assert "write_buffers = 1048576: must hold at least one write_chunk (4.0 MiB)" in out.stderr


def test_check_config_validates_and_prints_the_effective_settings(short_dir: Path) -> None:
    good = write_config(
        short_dir / "good.toml",
        '[limits]\nshm_budget = "1GiB"\nmax_jobs = 2\n[log]\nformat = "json"\n',
    )
    out = run_shmstaged("--config", str(good), "--check-config", "--max-layouts", "3")
    assert out.returncode == 0, out.stderr
    assert f"configuration OK: {good}" in out.stdout
    assert "1073741824 bytes (1.0 GiB)" in out.stdout
    assert "max_layouts 3, max_jobs 2" in out.stdout  # the flag overrides the file
    bad = write_config(short_dir / "bad.toml", "[server]\nshutdown_timeout = -1\n")
    out = run_shmstaged("--config", str(bad), "--check-config")
    assert out.returncode == EX_CONFIG
    assert "[server] shutdown_timeout = -1: expected a finite number of seconds >= 0" in out.stderr
    out = run_shmstaged("--check-config", "--default-slots", "9")
    assert out.returncode == EX_CONFIG
    assert "command line: default_slots = 9: expected an integer from 1 to 8" in out.stderr


def test_configured_limits_slots_and_json_logs_apply(tmp_path: Path, ckpt: Path) -> None:
    config = write_config(
        tmp_path / "c.toml",
        '[limits]\nshm_budget = "64MiB"\ndefault_slots = 3\nmax_layouts = 1\n'
        '[log]\nformat = "json"\n',
    )
    daemon = start_daemon(tmp_path / "d", "--config", str(config))
    try:
        with Stager(daemon.socket) as stager:
            stager.save({"w": torch.ones(16)}, ckpt / "a").wait(WAIT_S)
            assert len(daemon.segments()) == 3  # default_slots, since the client chose none
            with ControlClient(daemon.socket) as control:
                status = control.status()
            assert status["shm_budget_bytes"] == 64 << 20
            assert status["limits"]["max_user_layouts"] == 1
            assert status["config"] == str(config)
            with pytest.raises(StagingLimitExceeded, match="shared-memory budget"):
                stager.save({"big": torch.ones(32 << 20, dtype=torch.uint8)}, ckpt / "b")
        lines = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
        assert any("listening on" in line["message"] for line in lines)
        assert {"time", "level", "logger", "message"} <= set(lines[0])
    finally:
        assert daemon.stop() == 0


# ------------------------------------------------------------------ systemd protocol


def test_notify_ready_watchdog_and_stopping_from_the_real_daemon(
    manager: ServiceManager, short_dir: Path
) -> None:
    daemon = start_daemon(
        short_dir / "d",
        env={"NOTIFY_SOCKET": manager.env_value, "WATCHDOG_USEC": "400000"},
    )
    try:
        ready = manager.receive_until("READY=1")
        assert "STATUS=0 client(s)" in ready[-1][1]  # the first line systemctl status shows
        pings = manager.receive_until("WATCHDOG=1")
        pings += manager.receive_until("WATCHDOG=1")
        pings += manager.receive_until("WATCHDOG=1")
        times = [t for t, m in pings if m == "WATCHDOG=1"]
        assert len(times) >= 3 and times[-1] - times[0] < 2.0  # every ~0.2 s, from the loop
        daemon.proc.send_signal(signal.SIGTERM)
        stopping = manager.receive_until("STOPPING=1")
        assert "STATUS=stopping" in stopping[-1][1]
        assert daemon.proc.wait(WAIT_S) == 0
    finally:
        stop_and_clean(daemon)


def test_socket_activation_with_systemd_socket_activate(short_dir: Path, ckpt: Path) -> None:
    tool = shutil.which("systemd-socket-activate")
    if tool is None:
        pytest.skip("systemd-socket-activate not installed (apt-get install systemd)")
    sock = short_dir / "activated.sock"
    log_path = short_dir / "shmstaged.log"
    env = [f"-E{name}={os.environ[name]}" for name in ("PATH", "HOME") if name in os.environ]
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [tool, "-l", str(sock), *env, *shmstaged_command(), "--log-level", "debug"],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(sock.exists, "systemd-socket-activate to listen")
        # The daemon is started by the first connection and serves the socket it is passed.
        with Stager(sock) as stager:
            stager.save({"w": torch.arange(10.0)}, ckpt / "c").wait(WAIT_S)
        assert checkpoint.verify(ckpt / "c") == []
        log = log_path.read_text()
        assert f"listening on {sock} (socket activation)" in log
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0
        # systemd owns the socket and keeps listening across restarts: never unlinked.
        assert sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# --------------------------------------------------------------------------- reload


def test_sighup_applies_a_new_limit_to_new_registrations_without_dropping_clients(
    tmp_path: Path, ckpt: Path, manager: ServiceManager
) -> None:
    config = write_config(tmp_path / "c.toml", "[limits]\nmax_segments = 100\n")
    daemon = start_daemon(
        tmp_path / "d", "--config", str(config), env={"NOTIFY_SOCKET": manager.env_value}
    )
    try:
        manager.receive_until("READY=1")
        connected = Stager(daemon.socket, slots=1)
        connected.save({"a": torch.ones(4), "b": torch.ones(4)}, ckpt / "1").wait(WAIT_S)

        write_config(config, '[limits]\nmax_segments = 1\n[log]\nlevel = "warning"\n')
        daemon.proc.send_signal(signal.SIGHUP)
        reload = manager.receive_until("READY=1")
        assert any("RELOADING=1" in m for _, m in reload)
        with ControlClient(daemon.socket) as control:
            assert control.status()["limits"]["max_user_segments"] == 1
        # The connected client keeps its session and its two-segment layout...
        connected.save({"a": torch.full((4,), 2.0), "b": torch.ones(4)}, ckpt / "2").wait(WAIT_S)
        assert checkpoint.verify(ckpt / "2") == []
        # ...while new registrations meet the new limit, which is per user: this uid
        # already holds two segments through the first connection.
        with Stager(daemon.socket, slots=1) as newcomer:
            with pytest.raises(StagingLimitExceeded, match="over its limit of 1"):
                newcomer.save({"a": torch.ones(4), "b": torch.ones(4)}, ckpt / "3")
            with pytest.raises(StagingLimitExceeded, match="for all its connections together"):
                newcomer.save({"a": torch.ones(4)}, ckpt / "4")

        # A bad file on reload is reported and the running configuration stays.
        write_config(config, "[limits]\nmax_segments = 0\nbogus = 1\n")
        daemon.proc.send_signal(signal.SIGHUP)
        failed = manager.receive_until("READY=1")
        assert "reload failed, old configuration kept" in failed[-1][1]
        log = daemon.log()
        assert "[limits] max_segments = 0: expected an integer ≥ 1" in log
        assert "unknown key [limits] bogus" in log
        assert "configuration NOT reloaded" in log
        with ControlClient(daemon.socket) as control:
            assert control.status()["limits"]["max_user_segments"] == 1
        connected.save({"a": torch.ones(4), "b": torch.ones(4)}, ckpt / "5").wait(WAIT_S)
        connected.close()
    finally:
        assert daemon.stop() == 0
        stop_and_clean(daemon)


def test_reload_changes_the_log_level(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.toml", '[log]\nlevel = "info"\n')
    daemon = start_daemon(tmp_path / "d", "--config", str(config))
    try:
        # --log-level on the command line (the harness passes debug) wins over the file,
        # across reloads too: a flag is what the operator typed for this run.
        write_config(config, '[log]\nlevel = "error"\n')
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "configuration reloaded" in daemon.log(), "the reload")
        RawClient(daemon.socket).close()
        wait_for(lambda: "disconnected" in daemon.log(), "a debug-level line after the reload")
    finally:
        assert daemon.stop() == 0


# -------------------------------------------------------------------------- metrics


def test_metrics_are_served_on_localhost_http(tmp_path: Path, ckpt: Path) -> None:
    import socket

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    daemon = start_daemon(tmp_path / "d", "--metrics-port", str(port))
    try:
        with Stager(daemon.socket) as stager:
            stager.save({"w": torch.ones(1 << 16)}, ckpt / "a").wait(WAIT_S)
        wait_for(lambda: "metrics: serving" in daemon.log(), "the metrics endpoint")

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
                assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                return reply.read().decode()

        # The stall is reported after save() returned, on the connection the Stager closed
        # since: the daemon may read it a moment after the scrape.
        wait_for(lambda: "shmstage_stall_seconds_count 1" in scrape(), "the reported stall")
        text = scrape()
        assert 'shmstage_saves_total{result="ok"} 1' in text
        assert "shmstage_persist_seconds_count 1" in text
        assert "shmstage_copy_seconds_count 1" in text
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=10)
        assert info.value.code == 404
    finally:
        assert daemon.stop() == 0


def test_metrics_can_be_served_on_an_owner_only_unix_socket(tmp_path: Path) -> None:
    """For nodes where even the aggregate counters are not for every local user."""
    import socket
    import stat

    path = tmp_path / "metrics.sock"
    daemon = start_daemon(tmp_path / "d", "--metrics-socket", str(path))
    try:
        wait_for(lambda: "metrics: serving on the unix socket" in daemon.log(), "the endpoint")
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        client = socket.socket(socket.AF_UNIX)
        client.settimeout(10)
        client.connect(str(path))
        client.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        reply = b""
        while chunk := client.recv(65536):
            reply += chunk
        client.close()
        assert reply.startswith(b"HTTP/1.0 200 OK") and b"shmstage_saves_total" in reply
    finally:
        assert daemon.stop() == 0
    assert not path.exists()


# ------------------------------------------------------------------------- restart


def test_a_connected_stager_survives_a_daemon_restart(tmp_path: Path, ckpt: Path) -> None:
    """systemctl restart: in-flight saves fail clearly; the next save reconnects by itself."""
    events: list[str] = []
    first = start_daemon(tmp_path / "d")
    stager = Stager(first.socket, slots=1, progress=lambda e: events.append(e.phase))
    try:
        stager.save({"w": torch.ones(8)}, ckpt / "before").wait(WAIT_S)
        in_flight = stager.save({"w": torch.randn(64 << 20)}, ckpt / "in-flight")  # 256 MiB
        first.proc.kill()  # the harshest restart: no chance to finish or answer
        first.proc.wait(10)
        with pytest.raises(DaemonLost, match=r"in-flight has no confirmed result.*reconnects"):
            in_flight.wait(WAIT_S)
        second = start_daemon(tmp_path / "d", log_name="second.log")
        try:
            after = stager.save({"w": torch.full((8,), 3.0)}, ckpt / "after").wait(WAIT_S)
            assert after.bytes > 0 and checkpoint.verify(ckpt / "after") == []
            with ControlClient(second.socket) as control:
                clients = control.status()["clients"]
            trainers = [c for c in clients if c["name"].startswith("shmstage-client")]
            assert [c["layouts"] for c in trainers] == [1]  # registered again by itself
        finally:
            stager.close()
            assert second.stop() == 0
    finally:
        stop_and_clean(first)
    assert events[:2] == ["staged", "durable"]
    assert "failed" in events and events[-1] == "durable"
    assert checkpoint.verify(ckpt / "before") == []


def test_in_flight_saves_finish_and_are_confirmed_on_sigterm(tmp_path: Path, ckpt: Path) -> None:
    daemon = start_daemon(tmp_path / "d")
    with Stager(daemon.socket, slots=1) as stager:
        handle = stager.save({"w": torch.randn(32 << 20)}, ckpt / "big")
        daemon.proc.send_signal(signal.SIGTERM)
        assert handle.wait(WAIT_S).bytes > 32 << 22  # the answer arrived before the socket closed
        assert daemon.proc.wait(WAIT_S) == 0
    assert checkpoint.verify(ckpt / "big") == []
