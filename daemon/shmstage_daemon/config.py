"""shmstaged's configuration: one TOML file, validated completely before the daemon serves.

A daemon that starts with a typo in its config and silently uses a default is worse than one
that refuses to start: the typo surfaces weeks later as a trainer that cannot register or a
node whose /dev/shm fills up. So every key is known, every value is checked, and every
problem in the file is reported at once, each naming the table, the key, the value and what
is allowed.

The shared-memory budget is resolved against the real /dev/shm here as well, because a budget
larger than the tmpfs is a configuration error (segments would SIGBUS the writer), and a
percentage only means something once the tmpfs size is known.
"""

from __future__ import annotations

import dataclasses
import difflib
import grp
import json
import math
import os
import pwd
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from shmstage.paths import default_socket_path
from shmstage.units import format_size, parse_size

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "FSYNC_POLICIES",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "SHM_DIR",
    "Config",
    "ConfigError",
    "ShmCapacity",
    "load_config",
    "measure_shm",
    "resolve_budget",
]

DEFAULT_CONFIG_PATH = Path("/etc/shmstage/shmstaged.toml")
SHM_DIR = Path("/dev/shm")

FSYNC_POLICIES = ("always", "never")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")


class ConfigError(Exception):
    """The configuration cannot be used; the daemon must not start (or must keep the old one).

    `problems` holds one line per bad key, so a file with three mistakes is fixed in one
    round trip instead of three.
    """

    def __init__(self, problems: str | Iterable[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class _Invalid(Exception):
    """A converter's complaint: what was expected (the caller adds key and value)."""


# --------------------------------------------------------------------------- shared memory


@dataclass(frozen=True)
class ShmCapacity:
    """A snapshot of how much shared memory this node can actually back right now.

    tmpfs size and free RAM are separate limits: /dev/shm is often sized at 50% of RAM but
    its pages are RAM (or swap), so a half-full tmpfs on a node whose trainers use most of
    the memory still cannot take another checkpoint.
    """

    shm_total: int
    shm_free: int
    mem_available: int

    @property
    def usable(self) -> int:
        """Bytes a new registration can reserve without ENOSPC or memory pressure."""
        return min(self.shm_free, self.mem_available)


def measure_shm(shm_dir: Path = SHM_DIR) -> ShmCapacity:
    """Measure /dev/shm (statvfs) and available memory (psutil).

    The daemon calls it at start (via Config) and again at each registration, since both
    figures move while trainers run.
    """
    st = os.statvfs(shm_dir)
    available = psutil.virtual_memory().available
    room = cgroup_room()
    return ShmCapacity(
        shm_total=st.f_blocks * st.f_frsize,
        shm_free=st.f_bavail * st.f_frsize,
        mem_available=available if room is None else min(available, room),
    )


def cgroup_room(
    proc_self: Path = Path("/proc/self"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Bytes this process's cgroup (v2) may still charge before its ``memory.max``, or None
    when it has no such limit.

    Segment pages are charged to the daemon's cgroup (the unit's ``MemoryMax=``): a
    registration that would cross it must be refused with a reason, not end in the
    cgroup's OOM killer.
    """
    try:
        lines = (proc_self / "cgroup").read_text().splitlines()
    except OSError:
        return None
    unified = next((line[3:] for line in lines if line.startswith("0::")), None)
    if unified is None:
        return None
    group = cgroup_root / unified.lstrip("/")
    try:
        limit = (group / "memory.max").read_text().strip()
        current = int((group / "memory.current").read_text())
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    return max(0, int(limit) - current)


def _budget_spec(value: Any) -> int | str:
    """Validate the budget's form without touching the system (that is resolve_budget's job)."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            pct = float(value.strip()[:-1])
        except ValueError:
            raise _Invalid(_BUDGET_EXPECTED) from None
        if not 0 < pct <= 100:
            raise _Invalid("a percentage must be above 0% and at most 100%")
        return value.strip()
    try:
        nbytes = parse_size(value)
    except ValueError:
        raise _Invalid(_BUDGET_EXPECTED) from None
    if nbytes < 1:
        raise _Invalid(_BUDGET_EXPECTED)
    return value if isinstance(value, str) else nbytes


_BUDGET_EXPECTED = (
    'expected bytes (an integer ≥ 1 or a size like "64GiB") or a percentage of /dev/shm like "80%"'
)


def resolve_budget(value: int | str, *, capacity: ShmCapacity | None = None) -> int:
    """Turn the configured budget (bytes, "64GiB" or "80%") into bytes, checked against /dev/shm.

    A budget above the tmpfs size can never be honoured (the writer would hit ENOSPC or
    SIGBUS), so it is an error naming the key. Available memory is only advisory here (see
    Config.warnings): it changes from minute to minute, and refusing to start because a
    trainer happened to be loading would turn a transient into an outage.
    """
    cap = measure_shm() if capacity is None else capacity
    where = f"[limits] shm_budget = {_toml_repr(value)}"
    try:
        spec = _budget_spec(value)
    except _Invalid as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if isinstance(spec, str) and spec.endswith("%"):
        nbytes = int(cap.shm_total * float(spec[:-1]) / 100)
        if nbytes < 1:
            raise ConfigError(f"{where}: {SHM_DIR} has no space ({cap.shm_total} bytes)")
        return nbytes
    nbytes = parse_size(spec)
    if nbytes > cap.shm_total:
        raise ConfigError(
            f"{where}: {nbytes} bytes ({format_size(nbytes)}) exceeds the size of {SHM_DIR} "
            f"({cap.shm_total} bytes, {format_size(cap.shm_total)}); lower the budget, use a "
            f'percentage such as "80%", or enlarge {SHM_DIR} (docker: --shm-size)'
        )
    return nbytes


# ------------------------------------------------------------------------------ converters


def _toml_repr(value: Any) -> str:
    """Render a value the way it looks in the TOML file, so messages can be grepped for."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, Path):
        return json.dumps(str(value), ensure_ascii=False)
    if isinstance(value, (list, tuple, frozenset, set)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
        return "[" + ", ".join(_toml_repr(v) for v in items) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_repr(v)}" for k, v in value.items()) + "}"
    return str(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: Above any real limit, and inside the 64-bit integers the protocol carries: a larger
#: limit passed the configuration and then failed every client's hello ("internal error").
_MAX_INT = 1 << 62


def _int_at_least(low: int) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        if not _is_int(value) or value < low:
            raise _Invalid(f"expected an integer ≥ {low}")
        if value > _MAX_INT:
            raise _Invalid(f"expected an integer ≥ {low} and at most {_MAX_INT} (2**62)")
        return int(value)

    return convert


def _int_between(low: int, high: int) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        if not _is_int(value) or not low <= value <= high:
            raise _Invalid(f"expected an integer from {low} to {high}")
        return int(value)

    return convert


def _choice(*options: str) -> Callable[[Any], str]:
    def convert(value: Any) -> str:
        if isinstance(value, str) and value.lower() in options:
            return value.lower()
        raise _Invalid("expected one of " + ", ".join(f'"{o}"' for o in options))

    return convert


def _optional_path(value: Any) -> Path | None:
    return None if value is None else _absolute_path(value)


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise _Invalid("expected true or false")


def _absolute_path(value: Any) -> Path:
    if isinstance(value, (str, Path)) and str(value) and os.path.isabs(value):
        return Path(value)
    raise _Invalid("expected an absolute path")


def _seconds(value: Any) -> float:
    """0 is allowed: stop the writers at once and leave the journaled jobs to the next start."""
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    ):
        return float(value)
    raise _Invalid("expected a finite number of seconds >= 0")


def _size_at_least_one(value: Any) -> int:
    try:
        nbytes = parse_size(value)
    except ValueError:
        nbytes = 0
    if not 1 <= nbytes <= _MAX_INT:
        raise _Invalid('expected bytes (an integer ≥ 1 or a size like "64MiB", at most 4 EiB)')
    return nbytes


def _positive_seconds(value: Any) -> float:
    try:
        seconds = _seconds(value)
    except _Invalid:
        seconds = 0.0
    if seconds <= 0:
        raise _Invalid("expected a finite number of seconds > 0")
    return seconds


def _seconds_between(low: float, high: float, why: str) -> Callable[[Any], float]:
    def convert(value: Any) -> float:
        try:
            seconds = _seconds(value)
        except _Invalid:
            seconds = -1.0
        if not low <= seconds <= high:
            raise _Invalid(f"expected a number of seconds from {low:g} to {high:g}{why}")
        return seconds

    return convert


#: A check stats every staged segment in the segments' one thread (0.2 s for 20,000 on a
#: loaded host), which also gives segments back: more often than this would keep it busy.
MIN_SIZE_CHECK_INTERVAL_S = 0.5


def _optional_port(value: Any) -> int | None:
    if value is None:
        return None
    if _is_int(value) and 1 <= value <= 65535:
        return int(value)
    raise _Invalid("expected a TCP port from 1 to 65535 (omit the key to disable metrics)")


def _optional_size(value: Any) -> int | None:
    if value is None:
        return None
    try:
        nbytes = parse_size(value)
    except ValueError:
        nbytes = 0
    if not 1 <= nbytes <= _MAX_INT:
        raise _Invalid('expected bytes (an integer ≥ 1 or a size like "16GiB", at most 4 EiB)')
    return nbytes


def _ids(kind: str, lookup: Callable[[str], int]) -> Callable[[Any], frozenset[int]]:
    """Resolve user or group names (or numeric ids) to ids once, at load time.

    Resolving early means a misspelt group stops the daemon with a clear message instead of
    silently locking every trainer out; numeric ids are accepted unchecked because containers
    often run with ids that have no passwd entry.
    """

    def convert(value: Any) -> frozenset[int]:
        if isinstance(value, (frozenset, set)) and all(_is_int(v) for v in value):
            return frozenset(value)
        if not isinstance(value, (list, tuple)):
            raise _Invalid(f"expected a list of {kind} names or numeric ids")
        ids: set[int] = set()
        for item in value:
            if (_is_int(item) and item >= 0) or (isinstance(item, str) and item.isdigit()):
                ids.add(int(item))
            elif isinstance(item, str) and item:
                try:
                    ids.add(lookup(item))
                except KeyError:
                    raise _Invalid(f"no such {kind} {json.dumps(item)}") from None
            else:
                raise _Invalid(f"expected a list of {kind} names or numeric ids")
        return frozenset(ids)

    return convert


_users = _ids("user", lambda name: pwd.getpwnam(name).pw_uid)
_groups = _ids("group", lambda name: grp.getgrnam(name).gr_gid)


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise _Invalid("expected true or false")


def _block_size(low: int, high: int) -> Callable[[Any], int]:
    """A size in [low, high] that is a multiple of 4096 (direct I/O writes whole blocks)."""

    def convert(value: Any) -> int:
        try:
            nbytes = parse_size(value)
        except ValueError:
            nbytes = -1
        if not low <= nbytes <= high or nbytes % 4096:
            raise _Invalid(
                f"expected a size from {format_size(low)} to {format_size(high)} that is a "
                'multiple of 4096 bytes, like "4MiB"'
            )
        return nbytes

    return convert


def _budget(value: Any) -> int | str:
    return _budget_spec(value)


def _share(spec: int | str, whole: int) -> int:
    """Bytes, or a percentage of ``whole`` (validated by ``_budget_spec`` already)."""
    if isinstance(spec, str) and spec.endswith("%"):
        return int(whole * float(spec[:-1]) / 100)
    return parse_size(spec)


# (field name) -> (TOML table, key in that table, converter). The single source of truth for
# the file format, the CLI overrides and the error messages.
_SCHEMA: dict[str, tuple[str, str, Callable[[Any], Any]]] = {
    "socket_path": ("server", "socket_path", _absolute_path),
    "allowed_users": ("server", "allowed_users", _users),
    "allowed_groups": ("server", "allowed_groups", _groups),
    "operator_groups": ("server", "operator_groups", _groups),
    "shutdown_timeout": ("server", "shutdown_timeout", _seconds),
    "metrics_port": ("server", "metrics_port", _optional_port),
    "metrics_socket": ("server", "metrics_socket", _optional_path),
    "journal_dir": ("server", "journal_dir", _absolute_path),
    "allow_disk_journal": ("server", "allow_disk_journal", _bool),
    "restore_groups": ("server", "restore_groups", _groups),
    "publish_groups": ("server", "publish_groups", _groups),
    "shm_budget": ("limits", "shm_budget", _budget),
    "max_bytes": ("limits", "max_bytes", _optional_size),
    "max_segments": ("limits", "max_segments", _int_at_least(1)),
    "max_layouts": ("limits", "max_layouts", _int_at_least(1)),
    "max_jobs": ("limits", "max_jobs", _int_at_least(1)),
    "max_connections": ("limits", "max_connections", _int_at_least(1)),
    "max_prepared": ("limits", "max_prepared", _int_at_least(1)),
    "max_journal_bytes": ("limits", "max_journal_bytes", _size_at_least_one),
    "max_buffered_bytes": ("limits", "max_buffered_bytes", _size_at_least_one),
    "default_slots": ("limits", "default_slots", _int_between(1, 8)),
    "size_check_interval": (
        "limits",
        "size_check_interval",
        _seconds_between(
            MIN_SIZE_CHECK_INTERVAL_S,
            3600,
            " (each check stats every staged segment; a longer interval leaves memory a "
            "client grew its segments by uncharged for longer)",
        ),
    ),
    "writer_threads": ("storage", "writer_threads", _int_between(1, 64)),
    "io_threads": ("storage", "io_threads", _int_between(1, 64)),
    "write_chunk": ("storage", "write_chunk", _block_size(64 << 10, 256 << 20)),
    "write_buffers": ("storage", "write_buffers", _block_size(64 << 10, 16 << 30)),
    "direct_io": ("storage", "direct_io", _boolean),
    "fsync": ("storage", "fsync", _choice(*FSYNC_POLICIES)),
    "retain_ttl": ("retention", "ttl", _seconds),
    "retain_budget": ("retention", "budget", _budget),
    "retain_user_budget": ("retention", "user_budget", _budget),
    "retain_min_free": ("retention", "min_free", _budget),
    "lease_seconds": ("retention", "lease_seconds", _positive_seconds),
    "max_lease_seconds": ("retention", "max_lease_seconds", _positive_seconds),
    "max_leases": ("retention", "max_leases", _int_at_least(1)),
    "revoke_grace": ("retention", "revoke_grace", _seconds),
    "log_level": ("log", "level", _choice(*LOG_LEVELS)),
    "log_format": ("log", "format", _choice(*LOG_FORMATS)),
}
_TABLES: dict[str, list[str]] = {}
for _field_name, (_table, _key, _) in _SCHEMA.items():
    _TABLES.setdefault(_table, []).append(_key)
_BY_TABLE_KEY = {(t, k): name for name, (t, k, _) in _SCHEMA.items()}
#: The table each key belongs under, to name it for a key written outside it.
_HOME = {k: t for t, k, _ in _SCHEMA.values()}


def _problem(name: str, value: Any, why: str) -> str:
    table, key, _ = _SCHEMA[name]
    return f"[{table}] {key} = {_toml_repr(value)}: {why}"


# ---------------------------------------------------------------------------------- Config


def _own_and_root() -> frozenset[int]:
    return frozenset({os.getuid(), 0})


@dataclass(frozen=True)
class Config:
    """Everything shmstaged reads from its configuration, already validated and resolved.

    Construct it with `load_config()`; direct construction and `replace()` accept the same
    raw values the file does (sizes as "64GiB", users as names) and validate them the same way.
    `allowed_users` always contains the daemon's own uid and root: either can read every
    segment anyway, so refusing them would protect nothing and only break `shmstage status`.
    """

    socket_path: Path = field(default_factory=lambda: default_socket_path(prefer_system=False))
    allowed_users: frozenset[int] = field(default_factory=_own_and_root)
    allowed_groups: frozenset[int] = frozenset()
    operator_groups: frozenset[int] = frozenset()
    shutdown_timeout: float = 60.0
    metrics_port: int | None = None
    metrics_socket: Path | None = None
    journal_dir: Path = Path("/dev/shm")
    allow_disk_journal: bool = False
    shm_budget: int | str = "80%"
    max_bytes: int | None = None
    max_segments: int = 262144
    max_layouts: int = 64
    max_jobs: int = 32
    max_connections: int = 64
    max_prepared: int = 32
    max_journal_bytes: int | str = "64MiB"
    max_buffered_bytes: int | str = "256MiB"
    default_slots: int = 2
    # Segments a client resized through its descriptor go back to their size this often:
    # until then, what it grew them by is memory no limit counts.
    size_check_interval: float = 10.0
    writer_threads: int = 16
    io_threads: int = 4
    write_chunk: int | str = "4MiB"
    write_buffers: int | str = "64MiB"
    direct_io: bool = True
    fsync: str = "always"
    restore_groups: frozenset[int] = frozenset()
    #: Groups a publisher may share its channels with (``publish(..., share=...)``).
    publish_groups: frozenset[int] = frozenset()
    # A restart usually comes within minutes (torchrun, a scheduler's requeue); after half
    # an hour it most likely lands elsewhere, and the memory is better given back. Retained
    # memory yields to any registration and to memory pressure, so the budget may be large.
    retain_ttl: float = 1800.0
    retain_budget: int | str = "50%"
    # One user's share of the retention budget: with all of it, a user alone on the node
    # keeps what the budget allows; with several, the largest holder gives back first.
    retain_user_budget: int | str = "100%"
    retain_min_free: int | str = "10%"
    lease_seconds: float = 60.0
    max_lease_seconds: float = 600.0
    max_leases: int = 64
    # Long enough for a reader mid-copy of a large checkpoint to finish; a registration
    # that needs leased memory waits this long at most.
    revoke_grace: float = 10.0
    log_level: str = "info"
    log_format: str = "text"
    source: Path | None = None
    # Derived, not configurable: filled in by __post_init__.
    shm_budget_bytes: int = field(init=False, default=0)
    #: The retention budget in bytes (a percentage is of the shared-memory budget), and
    #: the /dev/shm space retention keeps free (a percentage is of /dev/shm's size).
    retain_budget_bytes: int = field(init=False, default=0)
    retain_min_free_bytes: int = field(init=False, default=0)
    #: One user's share in bytes (a percentage is of the retention budget).
    retain_user_budget_bytes: int = field(init=False, default=0)
    warnings: tuple[str, ...] = field(init=False, default=(), compare=False)

    def __post_init__(self) -> None:
        problems = []
        for name, (_, _, convert) in _SCHEMA.items():
            raw = getattr(self, name)
            try:
                object.__setattr__(self, name, convert(raw))
            except _Invalid as exc:
                problems.append(_problem(name, raw, str(exc)))
        if problems:
            raise ConfigError(problems)
        chunk, buffers = int(self.write_chunk), int(self.write_buffers)  # converted above
        if buffers < chunk:
            why = f"must hold at least one write_chunk ({format_size(chunk)})"
            raise ConfigError(_problem("write_buffers", buffers, why))
        object.__setattr__(self, "allowed_users", self.allowed_users | _own_and_root())
        capacity = measure_shm()
        budget = resolve_budget(self.shm_budget, capacity=capacity)
        object.__setattr__(self, "shm_budget_bytes", budget)
        retained = _share(self.retain_budget, budget)
        object.__setattr__(self, "retain_budget_bytes", min(retained, budget))
        share = _share(self.retain_user_budget, self.retain_budget_bytes)
        object.__setattr__(self, "retain_user_budget_bytes", min(share, self.retain_budget_bytes))
        object.__setattr__(
            self, "retain_min_free_bytes", _share(self.retain_min_free, capacity.shm_total)
        )
        if self.lease_seconds > self.max_lease_seconds:
            why = f"must not exceed [retention] max_lease_seconds ({self.max_lease_seconds:g})"
            raise ConfigError(_problem("lease_seconds", self.lease_seconds, why))
        warnings = []
        if retained > budget:
            warnings.append(
                f"[retention] budget = {_toml_repr(self.retain_budget)} is above the "
                f"shared-memory budget ({budget} bytes); retention is limited by it instead"
            )
        if budget > capacity.mem_available:
            warnings.append(
                f"[limits] shm_budget = {_toml_repr(self.shm_budget)} resolves to {budget} bytes "
                f"({format_size(budget)}), more than the memory available now "
                f"({format_size(capacity.mem_available)}); registrations are also checked "
                "against available memory, so large ones may be refused"
            )
        if self.max_bytes is not None and self.max_bytes > budget:
            warnings.append(
                f"[limits] max_bytes = {self.max_bytes} is above the shared-memory budget "
                f"({budget} bytes); a client is limited by the budget instead"
            )
        object.__setattr__(self, "warnings", tuple(warnings))

    def replace(self, **overrides: Any) -> Config:
        """Return a copy with command-line overrides applied; None means "flag not given".

        Keys are field names; values may be raw (e.g. shm_budget="50%", allowed_groups=
        ["train"]). Errors read like the file's but say "command line", so the operator knows
        the flag, not the file, is wrong.
        """
        changes = {k: v for k, v in overrides.items() if v is not None}
        unknown = sorted(set(changes) - set(_SCHEMA) - {"source"})
        if unknown:
            raise ConfigError(
                f"command line: unknown setting {name} (allowed: {', '.join(_SCHEMA)})"
                for name in unknown
            )
        problems = []
        for name, raw in changes.items():
            if name == "source":
                continue
            try:
                _SCHEMA[name][2](raw)
            except _Invalid as exc:
                problems.append(f"command line: {name} = {_toml_repr(raw)}: {exc}")
        if problems:
            raise ConfigError(problems)
        try:
            return dataclasses.replace(self, **changes)
        except ConfigError as exc:
            raise ConfigError(f"command line: {p}" for p in exc.problems) from None

    def diff(self, other: Config) -> dict[str, tuple[Any, Any]]:
        """`old.diff(new)` -> {setting: (old value, new value)}, to log what a reload changed."""
        names = [
            *_SCHEMA,
            "shm_budget_bytes",
            "retain_budget_bytes",
            "retain_user_budget_bytes",
            "retain_min_free_bytes",
        ]
        return {
            n: (getattr(self, n), getattr(other, n))
            for n in names
            if getattr(self, n) != getattr(other, n)
        }


# ---------------------------------------------------------------------------------- loading


def _unknown(label: str, allowed: list[str], name: str) -> str:
    hint = difflib.get_close_matches(name, allowed, n=1)
    suffix = f"; did you mean {hint[0]}?" if hint else ""
    return f"unknown {label} (allowed: {', '.join(allowed)}){suffix}"


def load_config(path: Path | None = None) -> Config:
    """Read and validate the daemon's TOML configuration.

    With `path=None` the packaged location /etc/shmstage/shmstaged.toml is used when it
    exists, and built-in defaults otherwise (a developer's `shmstaged` needs no file). An
    explicitly named file that cannot be read is an error, never a silent fallback.
    """
    if path is None:
        if not DEFAULT_CONFIG_PATH.exists():
            try:
                return Config()
            except ConfigError as exc:
                raise ConfigError(f"built-in defaults: {p}" for p in exc.problems) from None
        path = DEFAULT_CONFIG_PATH
    where = str(path)
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read configuration: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {exc}") from None

    problems: list[str] = []
    values: dict[str, Any] = {}
    for table, body in document.items():
        if table not in _TABLES and not isinstance(body, dict) and table in _HOME:
            problems.append(
                f"{where}: {table} = {_toml_repr(body)} is outside any table: it belongs under "
                f"[{_HOME[table]}] (write it below that table's header)"
            )
            continue
        if table not in _TABLES:
            problems.append(f"{where}: " + _unknown(f"table [{table}]", list(_TABLES), table))
            continue
        if not isinstance(body, dict):
            problems.append(f"{where}: {table} = {_toml_repr(body)}: expected a table [{table}]")
            continue
        for key, raw in body.items():
            name = _BY_TABLE_KEY.get((table, key))
            if name is None:
                label = f"key [{table}] {key}"
                if key in _HOME:  # a real setting, in the wrong table
                    problems.append(f"{where}: unknown {label}: it belongs under [{_HOME[key]}]")
                else:
                    problems.append(f"{where}: " + _unknown(label, _TABLES[table], key))
                continue
            try:
                values[name] = _SCHEMA[name][2](raw)
            except _Invalid as exc:
                problems.append(f"{where}: {_problem(name, raw, str(exc))}")
    if problems:
        raise ConfigError(problems)
    try:
        return Config(**values, source=Path(path))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {p}" for p in exc.problems) from None
