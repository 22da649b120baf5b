"""A restarted trainer's adopted layout, passed from its restore to its first Stager.

``prepare_restore`` adopts the layout the trainer's previous process left retained (its
own: the daemon hands a retained layout over only to a registration of the same user and
structure), maps its slots writable and pins them with CUDA while the model is built;
``latest()`` copies the checkpoint straight out of the pinned slot. What is left then —
the connection that owns the layout, the mapped and pinned slots — is offered here, and
the process's next ``Stager`` takes it (``claim``), so that its first save copies into
pinned memory it neither registers nor maps, and creates no segment. The daemon refills
no slot before that Stager asks for one, after the restore read it.

Neither wing imports the other: the restore wing offers, the save wing claims, and
whatever nobody claims within its ``keep`` seconds is given back — unpinned, unmapped,
and the connection closed, so that the daemon retains the layout again as it was.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from shmstage import segment
from shmstage.layout import Layout
from shmstage.paths import default_socket_path
from shmstage_client.connection import DaemonConnection
from shmstage_client.pinning import PinnedRanges

log = logging.getLogger("shmstage.client")


@dataclass
class AdoptedLayout:
    """A layout this process's connection owns, every slot mapped writable (one
    ``segment.Region`` each, as the daemon packs them) and those in ``pinned`` registered
    with CUDA; ``held``: the slot holding the checkpoint the restore read."""

    connection: DaemonConnection
    layout_id: int
    layout: Layout
    regions: list[segment.Region]
    held: int
    #: The slots the layout's Stager wants in all (the daemon's ``default_slots``).
    target_slots: int
    pinned: dict[int, PinnedRanges] = field(default_factory=dict)
    #: Set once nothing maps or pins into the slots any more (the restore's background
    #: pinning of the slots the first saves fill ended): only then may they be used or
    #: unmapped.
    settled: threading.Event = field(default_factory=threading.Event)
    _closed: bool = False

    @property
    def socket(self) -> Path:
        return self.connection.path

    def close(self) -> None:
        """Unpin, unmap, then close the connection: the daemon retains the layout again
        (it holds a checkpoint) once no writable mapping of it is left here."""
        if self._closed:
            return
        self._closed = True
        if not self.settled.wait(SETTLE_TIMEOUT):  # unmapping under a prefault would fault
            log.warning(
                "layout %d: its slots were still being pinned after %g s; left mapped",
                self.layout_id,
                SETTLE_TIMEOUT,
            )
            self.connection.close()
            return
        for ranges in self.pinned.values():
            ranges.release()  # before unmapping, or the range's next registration fails
        self.pinned.clear()
        for region in self.regions:
            region.close()
        self.regions = []
        self.connection.close()


#: How long a Stager waits for the restore's pinning of the slots its first saves fill
#: (bounded: past it the Stager registers a layout of its own), and a close for it.
SETTLE_TIMEOUT: Final = 60.0

_lock = threading.Lock()
_offered: AdoptedLayout | None = None
_timer: threading.Timer | None = None
#: The daemon and the undoing of a restore's adoption still being prepared (``expect``).
_expected: tuple[Path, Callable[[], None]] | None = None


def expect(socket: Path, give_back: Callable[[], None]) -> None:
    """A restore is adopting a layout of daemon ``socket`` for this process (``give_back``
    undoes that). A Stager made before that restore offers the layout cannot take it
    over, and its first save would register fresh segments beside it: it gives it back
    instead (``claim``), so that the daemon retains it again and the Stager's
    registration adopts it as any restarted trainer's does."""
    global _expected
    with _lock:
        _expected = socket, give_back


def expected_no_more(give_back: Callable[[], None]) -> None:
    """The restore ``give_back`` came from is done with (taken, given back)."""
    global _expected
    with _lock:
        if _expected is not None and _expected[1] == give_back:
            _expected = None


def offer(adopted: AdoptedLayout, keep: float) -> None:
    """Leave ``adopted`` for the process's next Stager for ``keep`` seconds; one at a time
    (an earlier one not yet claimed is given back)."""
    global _offered, _timer
    with _lock:
        earlier, _offered = _offered, adopted
        if _timer is not None:
            _timer.cancel()
        _timer = threading.Timer(keep, withdraw, args=(adopted,))
        _timer.daemon = True
        _timer.start()
    if earlier is not None and earlier is not adopted:
        earlier.close()


def claim(socket: str | os.PathLike[str] | None) -> AdoptedLayout | None:
    """The adopted layout on offer for a Stager of daemon ``socket`` (None: the default),
    now this caller's to use and close; None when there is none."""
    global _offered, _expected
    path = Path(socket) if socket is not None else default_socket_path()
    with _lock:
        adopted = _offered if _offered is not None and _offered.socket == path else None
        expected = _expected if _expected is not None and _expected[0] == path else None
        if adopted is None and expected is not None:
            _expected = None
        else:
            expected = None
    if expected is not None:
        expected[1]()
    if adopted is None or not adopted.settled.wait(SETTLE_TIMEOUT):
        return None
    with _lock:
        if _offered is not adopted or not adopted.connection.alive:
            return None
        _offered = None
        if _timer is not None:
            _timer.cancel()
    log.info("layout %d: the restore's adopted, pinned slots are this Stager's", adopted.layout_id)
    return adopted


def withdraw(adopted: AdoptedLayout | None = None) -> None:
    """Give back what is on offer (only ``adopted``, when given), if nobody claimed it."""
    global _offered
    with _lock:
        if _offered is None or (adopted is not None and _offered is not adopted):
            return
        gone, _offered = _offered, None
    log.debug("layout %d: no Stager claimed the restore's adopted layout", gone.layout_id)
    gone.close()
