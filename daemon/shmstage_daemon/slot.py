"""Slots: one full set of segments for a layout, owned by exactly one party at a time.

FREE --acquire(client)--> FILLING(client) --commit--> PERSISTING(job) --job end--> FREE
FILLING --cancel / client gone--> FREE

While FILLING only the acquiring client may commit or cancel it; while PERSISTING only the
daemon's job reads it, and no client can acquire it. This is the daemon-enforced answer to
staging buffers being refilled while a writer still reads them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shmstage.segment import SegmentRef


class SlotState(enum.Enum):
    FREE = "free"
    FILLING = "filling"
    PERSISTING = "persisting"


class SlotError(Exception):
    """An operation the slot's current owner does not permit."""


@dataclass
class Slot:
    index: int
    segments: list[SegmentRef]
    state: SlotState = SlotState.FREE
    holder: int | None = None  # session id while FILLING
    job: int | None = None  # job id while PERSISTING
    fills: int = field(default=0)

    def acquire(self, session: int) -> None:
        if self.state is not SlotState.FREE:
            raise SlotError(f"slot {self.index} is {self.state.value}")
        self.state, self.holder = SlotState.FILLING, session

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
