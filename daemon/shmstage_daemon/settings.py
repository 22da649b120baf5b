"""The daemon's settings, as the configuration file and command line make them.

One object for the daemon's life: a SIGHUP reload writes the reloadable fields into it
(``RELOADABLE``), so whoever holds it reads the current value at each use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shmstage.protocol import DEFAULT_MAX_FRAME_BYTES
from shmstage_daemon import retention, scheduler
from shmstage_daemon.admission import Allowlist
from shmstage_daemon.store import Limits


@dataclass
class Settings:
    socket_path: Path
    limits: Limits
    allowlist: Allowlist = field(default_factory=Allowlist.default)
    writer_threads: int = 16
    #: The shared data writers (see ``scheduler``); all need a restart to change.
    io_threads: int = scheduler.DEFAULT_IO_THREADS
    write_chunk: int = scheduler.DEFAULT_CHUNK_BYTES
    write_buffers: int = scheduler.DEFAULT_MEMORY_BYTES
    direct_io: bool = True
    fsync: bool = True
    shutdown_timeout: float = 60.0
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    default_slots: int = 2
    #: Seconds between checks that put back to its size a segment a client resized through
    #: its descriptor (``Segments.keep_sizes``): the longest the memory it grew one by goes
    #: uncharged, or a reader of one it shrank is refused.
    size_check_interval: float = 10.0
    config_source: Path | None = None
    #: Groups whose members see every user's clients and jobs in ``shmstage status``.
    operator_gids: frozenset[int] = frozenset()
    #: Where instances' journal directories live; memory-backed unless allow_disk_journal.
    journal_root: Path = Path("/dev/shm")
    allow_disk_journal: bool = False
    #: Groups a publisher may share a channel with; their members may subscribe to it.
    publish_gids: frozenset[int] = frozenset()
    #: Checkpoints kept in memory for a restarted trainer, and leases on them.
    retention: retention.RetentionPolicy = field(default_factory=retention.RetentionPolicy)

    #: What a SIGHUP reload can change in a running daemon; the rest needs a restart.
    RELOADABLE = (
        "limits",
        "allowlist",
        "fsync",
        "shutdown_timeout",
        "default_slots",
        "size_check_interval",
        "operator_gids",
        "retention",
        "publish_gids",
    )
