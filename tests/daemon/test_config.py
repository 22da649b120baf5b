"""What shmstaged accepts as configuration, and how it refuses what it does not.

Every rejection must name the key, the value and what is allowed, because the operator reads
it in `journalctl -u shmstaged` after the daemon refused to start.
"""

from __future__ import annotations

import grp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest
from shmstage_daemon.admission import Allowlist, Peer, peer_of
from shmstage_daemon.config import (
    DEFAULT_CONFIG_PATH,
    Config,
    ConfigError,
    ShmCapacity,
    cgroup_room,
    load_config,
    measure_shm,
    resolve_budget,
)
from shmstage_daemon.main import build_parser

from shmstage import paths
from shmstage.paths import default_socket_path
from shmstage.units import format_size, parse_size

EXAMPLE = Path(__file__).resolve().parents[2] / "systemd" / "shmstaged.toml"
# Keys whose value in the example deliberately differs from the built-in default: the
# packaged service listens on the system socket and admits the shmstage group.
PACKAGED_SETTINGS = {("server", "socket_path"), ("server", "allowed_groups")}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "shmstaged.toml"
    path.write_text(text)
    return path


def rejection(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    return str(info.value)


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("512B", 512),
        ("4KiB", 4 << 10),
        ("64 MiB", 64 << 20),
        ("64GiB", 64 << 30),
        ("64gib", 64 << 30),
        ("2TiB", 2 << 40),
        ("1.5GiB", 3 << 29),
        ("4KB", 4000),
        ("64MB", 64_000_000),
        ("1GB", 10**9),
    ],
)
def test_parse_size_understands_binary_and_decimal_units(text: int | str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "64G", "64 gigs", "-1", -1, "1.5B", True, 1.5])
def test_parse_size_rejects_ambiguous_or_malformed_sizes(text: object) -> None:
    with pytest.raises(ValueError):
        parse_size(text)  # type: ignore[arg-type]


def test_format_size_is_readable() -> None:
    assert format_size(512) == "512 B"
    assert format_size(64 << 30) == "64.0 GiB"


# ---------------------------------------------------------------------------- socket path


def test_default_socket_path_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(paths, "SYSTEM_SOCKET", tmp_path / "absent.sock")
    explicit = {"SHMSTAGE_SOCKET": "/srv/s.sock", "XDG_RUNTIME_DIR": "/run/user/1000"}
    assert default_socket_path(environ=explicit, uid=0) == Path("/srv/s.sock")
    assert default_socket_path(environ={}, uid=0) == tmp_path / "absent.sock"
    assert default_socket_path(environ={"XDG_RUNTIME_DIR": "/run/user/1000"}, uid=1000) == Path(
        "/run/user/1000/shmstage/shmstaged.sock"
    )
    assert default_socket_path(environ={}, uid=1000) == Path("/tmp/shmstage-1000/shmstaged.sock")


def test_clients_find_the_system_socket_but_a_user_daemon_does_not_take_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    system = tmp_path / "shmstaged.sock"
    system.touch()
    monkeypatch.setattr(paths, "SYSTEM_SOCKET", system)
    env = {"XDG_RUNTIME_DIR": "/run/user/1000"}
    assert default_socket_path(environ=env, uid=1000) == system
    assert default_socket_path(environ=env, uid=1000, prefer_system=False) == Path(
        "/run/user/1000/shmstage/shmstaged.sock"
    )


# ---------------------------------------------------------------------------- loading


def test_without_a_file_the_defaults_apply() -> None:
    if DEFAULT_CONFIG_PATH.exists():
        pytest.skip(f"{DEFAULT_CONFIG_PATH} exists on this machine")
    config = load_config(None)
    assert config == Config()
    assert config.source is None
    assert config.writer_threads == 16
    assert (config.io_threads, config.write_chunk, config.write_buffers) == (4, 4 << 20, 64 << 20)
    assert config.direct_io is True
    assert config.fsync == "always"
    assert config.default_slots == 2
    assert config.size_check_interval == 10.0
    assert config.shutdown_timeout == 60.0
    assert config.metrics_port is None
    assert config.max_bytes is None
    assert config.log_level == "info"
    assert config.log_format == "text"
    assert config.allowed_users == {os.getuid(), 0}
    assert config.allowed_groups == frozenset()
    assert config.socket_path == default_socket_path(prefer_system=False)
    # "80%" of the real /dev/shm.
    assert config.shm_budget_bytes == int(measure_shm().shm_total * 0.8)


def test_a_complete_file_is_read_into_typed_values(tmp_path: Path) -> None:
    gid = os.getgid()
    config = load_config(
        write(
            tmp_path,
            f"""
            [server]
            socket_path = "/run/test/shmstaged.sock"
            allowed_users = ["root", 4242]
            allowed_groups = [{gid}, "{gid}"]
            shutdown_timeout = 12.5
            metrics_port = 9464

            [limits]
            shm_budget = "1MiB"
            max_bytes = "512KiB"
            max_segments = 100
            max_layouts = 3
            max_jobs = 2
            default_slots = 3
            size_check_interval = 0.5

            [storage]
            writer_threads = 16
            fsync = "never"

            [log]
            level = "DEBUG"
            format = "json"
            """,
        )
    )
    assert config.source == tmp_path / "shmstaged.toml"
    assert config.socket_path == Path("/run/test/shmstaged.sock")
    assert config.allowed_users == {0, 4242, os.getuid()}
    assert config.allowed_groups == {gid}
    assert config.shutdown_timeout == 12.5
    assert config.metrics_port == 9464
    assert config.shm_budget_bytes == 1 << 20
    assert config.max_bytes == 512 << 10
    assert (config.max_segments, config.max_layouts, config.max_jobs) == (100, 3, 2)
    assert config.default_slots == 3
    assert config.size_check_interval == 0.5  # the least allowed
    assert config.writer_threads == 16
    assert config.fsync == "never"
    assert (config.log_level, config.log_format) == ("debug", "json")
    assert config.warnings == ()


def test_unknown_key_is_named_with_its_table_and_the_allowed_keys(tmp_path: Path) -> None:
    message = rejection(tmp_path, "[limits]\nmax_job = 3\n")
    assert message == (
        f"{tmp_path / 'shmstaged.toml'}: unknown key [limits] max_job (allowed: shm_budget, "
        "max_bytes, max_segments, max_layouts, max_jobs, max_connections, max_prepared, "
        "max_journal_bytes, max_buffered_bytes, default_slots, size_check_interval); did you "
        "mean max_jobs?"
    )


def test_unknown_table_and_top_level_keys_are_rejected(tmp_path: Path) -> None:
    message = rejection(tmp_path, 'writer_threads = 4\n[storge]\nfsync = "never"\n')
    assert "writer_threads = 4 is outside any table: it belongs under [storage]" in message
    assert "unknown table [storge]" in message
    assert "did you mean storage?" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[limits]\nmax_jobs = "x"\n', '[limits] max_jobs = "x": expected an integer ≥ 1'),
        ("[limits]\nmax_jobs = 0\n", "[limits] max_jobs = 0: expected an integer ≥ 1"),
        ("[limits]\nmax_segments = true\n", "[limits] max_segments = true: expected an integer"),
        ("[limits]\ndefault_slots = 9\n", "default_slots = 9: expected an integer from 1 to 8"),
        ("[storage]\nwriter_threads = 0\n", "writer_threads = 0: expected an integer from 1 to 64"),
        (
            "[storage]\nwriter_threads = 4.0\n",
            "writer_threads = 4.0: expected an integer from 1 to 64",
        ),
        (
            '[storage]\nfsync = "sometimes"\n',
            'fsync = "sometimes": expected one of "always", "never"',
        ),
        (
            '[storage]\nwrite_chunk = "1000KB"\n',
            'write_chunk = "1000KB": expected a size from 64.0 KiB to 256.0 MiB that is a '
            "multiple of 4096 bytes",
        ),
        (
            '[storage]\nwrite_chunk = "8MiB"\nwrite_buffers = "4MiB"\n',
            "write_buffers = 4194304: must hold at least one write_chunk (8.0 MiB)",
        ),
        ('[storage]\ndirect_io = "yes"\n', 'direct_io = "yes": expected true or false'),
        ('[log]\nlevel = "trace"\n', '[log] level = "trace": expected one of "debug", "info"'),
        ('[log]\nformat = "xml"\n', '[log] format = "xml": expected one of "text", "json"'),
        ('[server]\nsocket_path = "run/s"\n', 'socket_path = "run/s": expected an absolute'),
        (
            "[server]\nshutdown_timeout = -1\n",
            "shutdown_timeout = -1: expected a finite number of seconds",
        ),
        ("[server]\nmetrics_port = 70000\n", "metrics_port = 70000: expected a TCP port"),
        ('[server]\nallowed_users = "root"\n', 'allowed_users = "root": expected a list of user'),
        ('[limits]\nmax_bytes = "lots"\n', '[limits] max_bytes = "lots": expected bytes'),
        ('[limits]\nshm_budget = "150%"\n', 'shm_budget = "150%": a percentage must be above 0%'),
        ("[limits]\nshm_budget = 0\n", "[limits] shm_budget = 0: expected bytes"),
        (
            "[limits]\nsize_check_interval = 0.1\n",
            "[limits] size_check_interval = 0.1: expected a number of seconds from 0.5 to 3600",
        ),
        (
            '[limits]\nsize_check_interval = "often"\n',
            '[limits] size_check_interval = "often": expected a number of seconds from 0.5',
        ),
        ("server = 3\n", "server = 3: expected a table [server]"),
        # limits past 64-bit integers made every client's hello an "internal daemon error"
        (
            "[limits]\nmax_jobs = 100000000000000000000000\n",
            "[limits] max_jobs = 100000000000000000000000: expected an integer ≥ 1 and at most",
        ),
        (
            "[limits]\nmax_journal_bytes = 100000000000000000000000\n",
            "max_journal_bytes = 100000000000000000000000: expected bytes",
        ),
        (
            "[limits]\nmax_bytes = 100000000000000000000000\n",
            "[limits] max_bytes = 100000000000000000000000: expected bytes",
        ),
        # a setting above its table's header, or in another table, is named as what it is
        ("max_jobs = 3\n", "max_jobs = 3 is outside any table: it belongs under [limits]"),
        ("[storage]\nmax_jobs = 3\n", "unknown key [storage] max_jobs: it belongs under [limits]"),
    ],
)
def test_bad_values_name_key_value_and_what_is_allowed(
    tmp_path: Path, text: str, expected: str
) -> None:
    assert expected in rejection(tmp_path, text)


def test_unknown_user_and_group_names_stop_the_daemon(tmp_path: Path) -> None:
    message = rejection(
        tmp_path,
        '[server]\nallowed_users = ["no-such-user-x"]\nallowed_groups = ["no-such-group-x"]\n',
    )
    assert 'allowed_users = ["no-such-user-x"]: no such user "no-such-user-x"' in message
    assert 'allowed_groups = ["no-such-group-x"]: no such group "no-such-group-x"' in message


def test_every_problem_in_a_file_is_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, '[limits]\nmax_jobs = "x"\nmax_job = 1\n[log]\nlevel = 3\n'))
    assert len(info.value.problems) == 3


def test_budget_larger_than_dev_shm_is_refused(tmp_path: Path) -> None:
    size = measure_shm().shm_total
    message = rejection(tmp_path, '[limits]\nshm_budget = "1PiB"\n')
    assert message.startswith(f"{tmp_path / 'shmstaged.toml'}: [limits] shm_budget = \"1PiB\": ")
    assert f"exceeds the size of /dev/shm ({size} bytes" in message


def test_budget_percentage_is_of_the_dev_shm_size() -> None:
    cap = ShmCapacity(shm_total=64 << 30, shm_free=10 << 30, mem_available=100 << 30)
    assert resolve_budget("50%", capacity=cap) == 32 << 30
    assert resolve_budget("100%", capacity=cap) == 64 << 30
    assert resolve_budget("16GiB", capacity=cap) == 16 << 30
    assert resolve_budget(1 << 30, capacity=cap) == 1 << 30
    with pytest.raises(ConfigError, match=r"\[limits\] shm_budget = 68719476737: .* exceeds"):
        resolve_budget((64 << 30) + 1, capacity=cap)


def test_capacity_is_limited_by_free_shm_and_available_memory() -> None:
    assert ShmCapacity(shm_total=10, shm_free=8, mem_available=5).usable == 5
    assert ShmCapacity(shm_total=10, shm_free=3, mem_available=5).usable == 3
    live = measure_shm()
    assert 0 <= live.shm_free <= live.shm_total
    assert live.mem_available > 0


def test_a_cgroup_memory_limit_caps_what_registrations_may_take(tmp_path: Path) -> None:
    """Segment pages are charged to the daemon's cgroup: its room under memory.max counts."""
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    (proc / "cgroup").write_text("0::/system.slice/shmstaged.service\n")
    group = cgroups / "system.slice" / "shmstaged.service"
    group.mkdir(parents=True)
    (group / "memory.max").write_text("1073741824\n")
    (group / "memory.current").write_text("268435456\n")
    assert cgroup_room(proc, cgroups) == 768 << 20
    (group / "memory.max").write_text("max\n")
    assert cgroup_room(proc, cgroups) is None
    (proc / "cgroup").write_text("4:memory:/x\n")  # cgroup v1 only: no unified limit
    assert cgroup_room(proc, cgroups) is None


def test_an_explicit_file_that_is_missing_is_an_error_not_the_defaults(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read configuration"):
        load_config(tmp_path / "missing.toml")


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    message = rejection(tmp_path, "[limits\nmax_jobs = 1\n")
    assert message.startswith(f"{tmp_path / 'shmstaged.toml'}: not valid TOML")


# ---------------------------------------------------------------------------- overrides


def test_command_line_overrides_are_validated_like_the_file(tmp_path: Path) -> None:
    base = load_config(write(tmp_path, '[limits]\nshm_budget = "1MiB"\n'))
    same = base.replace(log_level=None, writer_threads=None)  # flags not given
    assert same == base
    changed = base.replace(log_level="DEBUG", shm_budget="2MiB", socket_path="/tmp/x.sock")
    assert changed.log_level == "debug"
    assert changed.shm_budget_bytes == 2 << 20
    assert changed.socket_path == Path("/tmp/x.sock")
    assert changed.source == base.source
    assert base.diff(changed) == {
        "socket_path": (base.socket_path, Path("/tmp/x.sock")),
        "shm_budget": ("1MiB", "2MiB"),
        "log_level": ("info", "debug"),
        "shm_budget_bytes": (1 << 20, 2 << 20),
        "retain_budget_bytes": (1 << 19, 1 << 20),  # half the budget, by default
        "retain_user_budget_bytes": (1 << 19, 1 << 20),  # all of that, by default
    }
    with pytest.raises(ConfigError) as info:
        base.replace(writer_threads=0, fsync="sometimes")
    assert info.value.problems == [
        "command line: writer_threads = 0: expected an integer from 1 to 64",
        'command line: fsync = "sometimes": expected one of "always", "never"',
    ]
    with pytest.raises(ConfigError, match="command line: unknown setting threads"):
        base.replace(threads=3)
    with pytest.raises(ConfigError, match=r"command line: \[limits\] shm_budget .* exceeds"):
        base.replace(shm_budget="1PiB")


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--max-jobs", "x", "max_jobs"),
        ("--writer-threads", "1.5", "writer_threads"),
        ("--shutdown-timeout", "soon", "shutdown_timeout"),
        ("--log-level", "loud", "log_level"),
        ("--metrics-port", "99999", "metrics_port"),
        ("--size-check-interval", "0", "size_check_interval"),
    ],
)
def test_a_bad_flag_value_exits_78_naming_the_setting(flag: str, value: str, named: str) -> None:
    """As the README promises for any bad value: 78 (EX_CONFIG), not argparse's 2."""
    out = subprocess.run(
        [sys.executable, "-m", "shmstage_daemon.main", flag, value, "--check-config"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 78, out.stderr
    assert f"command line: {named} = " in out.stderr


def test_help_documents_every_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shmstage_daemon.main", "--help"],
        capture_output=True, text=True, timeout=60,
    )
    flags = [a for a in build_parser()._actions if a.option_strings]
    undocumented = [a.option_strings[0] for a in flags if not a.help]
    assert undocumented == []
    for action in flags:
        assert action.option_strings[-1] in out.stdout


def test_config_is_immutable() -> None:
    config = Config(shm_budget="1MiB")
    with pytest.raises(AttributeError):
        config.writer_threads = 8  # type: ignore[misc]


# ---------------------------------------------------------------------------- peers


def allowlist_of(config: Config) -> Allowlist:
    """What the daemon builds from a configuration (main.py) and admits peers with."""
    return Allowlist(config.allowed_users, config.allowed_groups)


def test_peer_admission_by_user_primary_and_supplementary_group() -> None:
    allow = allowlist_of(Config(shm_budget="1MiB", allowed_users=[4242], allowed_groups=[5151]))
    assert allow.admits(Peer(1, 4242, 1, frozenset({1})))
    assert allow.admits(Peer(1, 0, 1, frozenset({1})))  # root is always admitted
    assert allow.admits(Peer(1, os.getuid(), 1, frozenset({1})))  # so is the daemon's user
    assert allow.admits(Peer(1, 1000, 5151, frozenset({5151})))
    assert allow.admits(Peer(1, 1000, 1000, frozenset({1000, 5151})))  # supplementary
    assert not allow.admits(Peer(1, 1000, 1000, frozenset({1000})))
    assert not allowlist_of(Config(shm_budget="1MiB")).admits(Peer(1, 1000, 1000, frozenset()))


def test_supplementary_groups_come_from_the_socket_not_from_proc() -> None:
    """SO_PEERGROUPS: the groups the peer had when it connected, whatever its pid names
    later (a pid may be reused by another process with other groups)."""
    if os.geteuid() != 0:
        pytest.skip("a peer with chosen supplementary groups needs root")
    where = Path(tempfile.mkdtemp(prefix="shmstage-groups-", dir="/tmp"))
    where.chmod(0o755)  # pytest's tmp_path is not reachable for uid 65534
    path = where / "s.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    path.chmod(0o666)
    listener.listen(1)
    code = (
        "import os, socket, sys; os.setgroups([5151, 6161]); os.setgid(65534); "
        f"os.setuid(65534); s = socket.socket(socket.AF_UNIX); s.connect({str(path)!r}); "
        "sys.stdin.read()"
    )
    peer = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        listener.settimeout(30)
        conn, _ = listener.accept()
        seen = peer_of(conn)
        assert (seen.uid, seen.gid, seen.pid) == (65534, 65534, peer.pid)
        assert seen.groups == {65534, 5151, 6161}
        assert allowlist_of(Config(shm_budget="1MiB", allowed_groups=[6161])).admits(seen)
        assert not allowlist_of(Config(shm_budget="1MiB", allowed_groups=[7171])).admits(seen)
        peer.communicate(timeout=10)
        assert peer_of(conn).groups == seen.groups  # gone: the socket still knows
        conn.close()
    finally:
        if peer.poll() is None:
            peer.kill()
        listener.close()
        shutil.rmtree(where, ignore_errors=True)


# ---------------------------------------------------------------------------- the example


def test_example_file_documents_every_key_with_the_default_values(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    document = tomllib.loads(text)
    defaults = Config()
    table_keys = {
        "server": ["socket_path", "allowed_users", "allowed_groups", "operator_groups",
                   "shutdown_timeout", "metrics_port", "metrics_socket", "journal_dir",
                   "allow_disk_journal",
                   "restore_groups", "publish_groups"],
        "limits": ["shm_budget", "max_bytes", "max_segments", "max_layouts", "max_jobs",
                   "max_connections", "max_prepared", "max_journal_bytes", "max_buffered_bytes",
                   "default_slots", "size_check_interval"],
        "storage": ["writer_threads", "io_threads", "write_chunk", "write_buffers", "direct_io",
                    "fsync"],
        "retention": ["ttl", "budget", "user_budget", "min_free", "lease_seconds",
                      "max_lease_seconds", "max_leases", "revoke_grace"],
        "log": ["level", "format"],
    }
    for table, keys in table_keys.items():
        assert f"[{table}]" in text
        for key in keys:
            # Optional keys appear commented out ("# metrics_port = 9464").
            assert f"{key} = " in text, f"[{table}] {key} is not documented in {EXAMPLE.name}"
    for table, body in document.items():
        for key, value in body.items():
            if (table, key) in PACKAGED_SETTINGS:
                continue
            field = f"log_{key}" if table == "log" else key
            if table == "retention" and key in ("ttl", "budget", "user_budget", "min_free"):
                field = f"retain_{key}"
            if isinstance(value, str) and isinstance(getattr(defaults, field), int):
                value = parse_size(value)  # a size written with its unit
            if field == "allowed_users":
                assert value == [] and defaults.allowed_users == {os.getuid(), 0}
            elif field in ("restore_groups", "publish_groups"):
                assert value == [] and getattr(defaults, field) == frozenset()
            elif isinstance(getattr(defaults, field), Path):
                assert getattr(defaults, field) == Path(value), f"[{table}] {key}"
            elif isinstance(getattr(defaults, field), frozenset):
                assert getattr(defaults, field) == frozenset(value), f"[{table}] {key}"
            else:
                assert getattr(defaults, field) == value, f"[{table}] {key}"

    # And the daemon accepts it. The shmstage group comes from sysusers.d; where it does not
    # exist (a development machine), an existing group stands in for it.
    try:
        grp.getgrnam("shmstage")
        path = EXAMPLE
    except KeyError:
        stand_in = grp.getgrgid(os.getgid()).gr_name
        path = write(tmp_path, text.replace('["shmstage"]', f'["{stand_in}"]'))
    config = load_config(path)
    assert config.socket_path == paths.SYSTEM_SOCKET


# ------------------------------------------------------------------------------ retention


def test_retention_defaults_resolve_against_the_budgets() -> None:
    config = Config(shm_budget=1 << 20)
    assert (config.retain_ttl, config.lease_seconds, config.max_lease_seconds) == (1800, 60, 600)
    assert config.retain_budget_bytes == 1 << 19  # half the shared-memory budget
    assert config.retain_min_free_bytes == int(measure_shm().shm_total * 0.10)
    assert config.restore_groups == frozenset() and config.max_leases == 64
    assert config.retain_user_budget_bytes == 1 << 19 and config.revoke_grace == 10


def test_retention_keys_are_read_and_checked(tmp_path: Path) -> None:
    config = load_config(
        write(
            tmp_path,
            '[limits]\nshm_budget = "1MiB"\n[server]\nrestore_groups = [0]\n'
            '[retention]\nttl = 0\nbudget = "256KiB"\nmin_free = 4096\nlease_seconds = 2\n'
            'max_lease_seconds = 3\nmax_leases = 5\nuser_budget = "25%"\nrevoke_grace = 0\n',
        )
    )
    assert (config.retain_user_budget_bytes, config.revoke_grace) == (64 << 10, 0)
    assert "revoke_grace = -1: expected a finite number of seconds >= 0" in rejection(
        tmp_path, "[retention]\nrevoke_grace = -1\n"
    )
    assert "user_budget = \"0%\": a percentage must be above 0%" in rejection(
        tmp_path, '[retention]\nuser_budget = "0%"\n'
    )
    assert (config.retain_ttl, config.retain_budget_bytes, config.retain_min_free_bytes) == (
        0,
        256 << 10,
        4096,
    )
    assert config.restore_groups == frozenset({0}) and config.max_leases == 5
    assert "lease_seconds = 0: expected a finite number of seconds > 0" in rejection(
        tmp_path, "[retention]\nlease_seconds = 0\n"
    )
    assert "must not exceed [retention] max_lease_seconds (5)" in rejection(
        tmp_path, "[retention]\nlease_seconds = 10\nmax_lease_seconds = 5\n"
    )
    assert "unknown key [retention] tll" in rejection(tmp_path, "[retention]\ntll = 5\n")
    text = '[limits]\nshm_budget = "1MiB"\n[retention]\nbudget = "2MiB"\n'
    over = load_config(write(tmp_path, text))
    assert over.retain_budget_bytes == 1 << 20 and "limited by it" in over.warnings[0]
