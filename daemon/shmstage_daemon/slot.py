"""Slots: one full set of segments for a layout, owned by exactly one party at a time.

FREE --acquire(client)--> FILLING(client) --commit--> PERSISTING(job) --job end--> FREE
FILLING --cancel / client gone--> FREE

While FILLING only the acquiring client may commit or cancel it; while PERSISTING only the
daemon's job reads it, and no client can acquire it. This is the daemon-enforced answer to
staging buffers being refilled while a writer still reads them.

A slot also remembers the checkpoint it holds (``Held``): from the moment its commit is
acknowledged — the bytes are complete then — until the slot is acquired again for a refill.
Readers restoring from memory lease it (``leases``); a leased slot is never acquired, so
what they read cannot change under them. A slot may also be a published version of a
channel (``version``, see ``channels``), which subscribers pin (``pins``) the same way.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from shmstage.segment import SegmentRef

FileId = tuple[int, int]  # (st_dev, st_ino)
#: Slot keys, unique in the daemon's life: a subscriber maps each slot once by its key.
_serials = itertools.count(1)


class SlotState(enum.Enum):
    FREE = "free"
    FILLING = "filling"
    PERSISTING = "persisting"


class SlotError(Exception):
    """An operation the slot's current owner does not permit."""


@dataclass
class Held:
    """The checkpoint a slot's bytes are, and where its files are (identities, not paths
    the daemon would ever open)."""

    job: int
    uid: int
    nbytes: int
    acknowledged_unix: float
    #: The data file (the client's temporary file, which keeps its inode under its final
    #: name), the directory it is written in, and that directory's parent.
    data_id: FileId
    directory_id: FileId
    parent_id: FileId | None
    #: Where the daemon saw the checkpoint (for status and ``latest``; never opened).
    directory: str
    data_file: str
    tree: Any
    metadata: dict[str, Any]
    #: Set when the job made it durable: when, the digest of the manifest it wrote, and
    #: each tensor's CRC-32C (layout order) as that manifest records them.
    durable_unix: float | None = None
    digest: str = ""
    checksums: list[int] | None = None

    @property
    def durable(self) -> bool:
        return self.durable_unix is not None


@dataclass
class Slot:
    index: int
    segments: list[SegmentRef]
    state: SlotState = SlotState.FREE
    holder: int | None = None  # session id while FILLING
    job: int | None = None  # job id while PERSISTING
    fills: int = field(default=0)
    #: The checkpoint these bytes are, from its acknowledgement until the next acquire.
    held: Held | None = None
    #: Ids of the readers' leases on it; while any is left, it is not acquired.
    leases: set[int] = field(default_factory=set)
    #: The channel version these bytes are (``channels.Version``), until the next acquire,
    #: and the ids of subscribers' pins on it: pinned, it is not acquired either.
    version: Any = None
    pins: set[int] = field(default_factory=set)
    serial: int = field(default_factory=lambda: next(_serials))

    @property
    def leased(self) -> bool:
        """Read by someone (a lease or a pin): never acquired, given back or adopted."""
        return bool(self.leases or self.pins)

    @property
    def age(self) -> int:
        """Which free slot a fill takes first: the one holding the oldest checkpoint or
        version (job and version ids come from one counter and only grow), one holding
        nothing before any."""
        held = -1 if self.held is None else self.held.job
        return max(held, -1 if self.version is None else self.version.id)

    def acquire(self, session: int) -> None:
        if self.state is not SlotState.FREE:
            raise SlotError(f"slot {self.index} is {self.state.value}")
        if self.leased:
            raise SlotError(f"slot {self.index} is leased or pinned by a reader")
        self.state, self.holder = SlotState.FILLING, session
        self.held = self.version = None  # its bytes are about to change

    def _check_holder(self, session: int, action: str) -> None:
        if self.state is not SlotState.FILLING or self.holder != session:
            raise SlotError(
                f"slot {self.index} is {self.state.value} and not held by this client; "
                f"acquire it before you {action} it"
            )

    def commit(self, session: int, job: int) -> None:
        self._check_holder(session, "commit")
        self.state, self.holder, self.job = SlotState.PERSISTING, None, job
        self.fills += 1

    def cancel(self, session: int) -> None:
        self._check_holder(session, "cancel")
        self.state, self.holder = SlotState.FREE, None

    def finish(self, job: int) -> None:
        if self.state is not SlotState.PERSISTING or self.job != job:
            raise SlotError(f"slot {self.index} is not persisting job {job}")
        self.state, self.job = SlotState.FREE, None
