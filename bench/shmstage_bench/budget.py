"""Fitting the peers scenario into ``--budget``: every row runs or says why, and the closing
limit bracket always has its time.

An 8 GiB run on an H100 needs about 600 s with three repeats of every method, and the GPU
machine gives a call 540 s: the last methods used to be killed at the budget's edge and the
direct-I/O limit was never measured again after the rows (so their ratio to it rode on
when each ran). The plan here is pure arithmetic over seconds, so that it can be tested
without timing anything:

* the parent gives each method's process a *share* of what is left, after keeping back the
  closing bracket's time (a guess until the limit's first run is measured, then that run's
  own seconds): limits and shmstage rows get what they need, less a floor for each peer
  still to come; a peer gets an even split of what is left between the methods still to run;
* inside the process, :class:`RepeatPlan` runs the first save, then each repeat only while
  the last save's time still fits before the share ends, and says how many of the asked
  repeats ran ("1 repeat of 3 (budget: ...)"). A first save pays one-off costs, so the
  first repeat is tried when half of the first save's time fits (``FIRST_REPEAT_GUESS``):
  a row with one steady save beats one with none, and one that does not end by the
  share's end is abandoned there, the row keeping its first save and saying so;
* a method whose share is too small to start is a row saying so, never a silent gap.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

#: What each peer still to run is guaranteed when a limit or shmstage row takes its share,
#: and when a method before it stretches: about a peer's setup and first save at 8 GiB on
#: the H100 (20-35 s; 2026-11-27, whose slower disk left the last three peers 12-17 s
#: when the stretch kept 16 s for each).
PEER_FLOOR_S = 25.0
#: The same for a limit or shmstage row still to run.
OTHER_FLOOR_S = 20.0
#: Below this, a method's process is not started: it could not even build its state dict.
MIN_SHARE_S = 8.0
#: Kept back beyond a share for the process itself: start, state-dict build, close, result.
PROCESS_GRACE_S = 20.0
#: What a first save may take however little of its share setup left (< the grace).
FIRST_SAVE_FLOOR_S = 10.0
#: The closing bracket's measured seconds are multiplied by this (its pace drifts).
BRACKET_MARGIN = 1.25
#: The part of its share a method may overrun for its first repeat (a row with one steady
#: save beats one with none; the methods after it share what is left).
STRETCH = 0.5
#: What the first repeat is expected to take, as a part of the first save: one-off costs
#: (workers, buffers, pinning) make first saves slower. On the H100 (8 GiB, 2026-11-27) a
#: steady save took 0.42 of the first for nvidia-resiliency-ext's shared-memory mode, 0.44
#: for DLRover, 0.55 for ML Flashpoint, 0.6 for DCP save, 1.0-1.16 for torch.save and
#: DCP async_save; guessed short, a repeat is abandoned at the share's end (and says so).
FIRST_REPEAT_GUESS = 0.5


def closing_reserve(left: float, pending: int, measured_s: float | None) -> float:
    """Seconds kept back for measuring the bracketed limit again after the rows.

    Once its first run has been timed that is its own cost (with a margin); before, one
    more method's even share of what is left.
    """
    if measured_s is not None:
        return measured_s * BRACKET_MARGIN + 5.0
    return max(left, 0.0) / (pending + 1)


def share(left: float, kinds: Sequence[str], reserve: float) -> float:
    """Seconds the next method (``kinds[0]``) may spend, given ``left`` seconds of budget.

    ``kinds`` lists the next method and those after it ("limit", "shmstage" or "peer").
    A limit or shmstage row takes what it needs up to what the methods after it leave (at
    least an even split); a peer gets an even split, so that a peer that hangs costs its
    share, not the run.
    """
    pool = left - reserve
    even = pool / len(kinds)
    if kinds[0] == "peer":
        return even
    after = kinds[1:]
    peers_after = sum(1 for k in after if k == "peer")
    others_after = len(after) - peers_after
    return max(pool - PEER_FLOOR_S * peers_after - OTHER_FLOOR_S * others_after, even)


def too_small(seconds: float, pending: int, reserve: float, left: float) -> str:
    """Why a method with this share is not started, or "" when it may start."""
    if seconds >= MIN_SHARE_S:
        return ""
    return (
        f"not run (budget): {max(left, 0):.0f} s of the --budget left for {pending} "
        f"method(s) and the closing limit bracket ({reserve:.0f} s kept for it); this one's "
        f"share would be {max(seconds, 0):.0f} s, under the {MIN_SHARE_S:.0f} s a method needs"
    )


@dataclass
class Planner:
    """In the parent: each method's share in turn, and the closing bracket's reserve.

    ``kinds``: the methods' kinds in run order; ``bracket_at``: the index of the limit that
    is measured again after the rows (None: no closing bracket).
    """

    kinds: list[str]
    bracket_at: int | None = None
    bracket_s: float | None = None  # its first run, once timed

    def next(self, i: int, left: float | None) -> tuple[float | None, float, str]:
        """Method ``i``'s share given ``left`` seconds of budget, its stretch (see
        :class:`RepeatPlan`) and why it may not start ("" when it may)."""
        if left is None:
            return None, 0.0, ""
        pending = len(self.kinds) - i
        reserve = 0.0
        if self.bracket_at is not None:
            reserve = closing_reserve(left, pending, self.bracket_s)
        seconds = share(left, self.kinds[i:], reserve)
        # what the methods after it could give up and still run their first saves
        floors = sum(PEER_FLOOR_S if k == "peer" else OTHER_FLOOR_S for k in self.kinds[i + 1 :])
        spare = left - reserve - seconds - floors
        stretch = max(0.0, min(seconds * STRETCH, spare))
        return seconds, stretch, too_small(seconds, pending, reserve, left)

    def ran(self, i: int, seconds: float, ok: bool) -> None:
        """Method ``i``'s process took ``seconds``; a failed bracketed limit frees its reserve
        (there is nothing to bracket with)."""
        if i == self.bracket_at:
            if ok:
                self.bracket_s = seconds
            else:
                self.bracket_at = None


@dataclass
class RepeatPlan:
    """Inside a method's process: which of the asked repeats fit in its share of the budget.

    ``deadline`` is a ``time.monotonic()`` instant, or ``None`` without a budget.
    """

    wanted: int
    deadline: float | None = None
    share_s: float | None = None
    stretch_s: float = 0.0
    ran: int = 0
    last_save_s: float | None = None
    #: The repeat running now was let through on FIRST_REPEAT_GUESS alone.
    guessed: bool = False

    @classmethod
    def starting_now(cls, wanted: int, share_s: float | None, stretch_s: float) -> RepeatPlan:
        deadline = None if share_s is None else time.monotonic() + share_s
        return cls(wanted, deadline, share_s, stretch_s)

    def _end(self) -> float | None:
        """The first repeat may run into the stretch: one steady sample is the row's median."""
        if self.deadline is None:
            return None
        return self.deadline + (self.stretch_s if self.ran == 0 else 0.0)

    def next_fits(self, now: float) -> bool:
        """Whether the next repeat, costing what the last save did (the first: a part of
        it, ``FIRST_REPEAT_GUESS``), ends before the deadline."""
        end = self._end()
        self.guessed = False
        if self.ran >= self.wanted:
            return False
        if end is None or self.last_save_s is None:
            return True
        if now + self.last_save_s <= end:
            return True
        self.guessed = self.ran == 0 and now + self.last_save_s * FIRST_REPEAT_GUESS <= end
        return self.guessed

    def abandoned_at_share_end(self) -> str:
        """The row's note when a repeat was abandoned where the share ended (a repeat slower
        than the save before it, or a first repeat let through on FIRST_REPEAT_GUESS): the
        plan's guess missed, the method did not fail, and the row keeps its saves."""
        why = (
            "tried on the chance that it was faster"
            if self.guessed
            else "planned on the last save's time"
        )
        return (
            f"{self.ran} repeat{'' if self.ran == 1 else 's'} of {self.wanted} (budget: its "
            f"share was {self.share_s:.0f} s; a save took {self.last_save_s:.1f} s, and the "
            f"next, {why}, had not ended when the share did: abandoned)"
        )

    def save_timeout(self, now: float, save_timeout: float | None) -> float | None:
        """One save's own limit: ``--save-timeout``, but not past the share's end — except
        that a first save always gets ``FIRST_SAVE_FLOOR_S`` (out of the process's grace),
        so that a setup that ate the share still leaves a row with one save."""
        end = self._end()
        if end is None:
            return save_timeout
        floor = FIRST_SAVE_FLOOR_S if self.last_save_s is None else 1.0
        left = max(end - now, floor)
        return left if save_timeout is None else min(save_timeout, left)

    def done(self, seconds: float, *, first: bool) -> None:
        """Record a save that took ``seconds`` (wall time, its clean-up included)."""
        self.last_save_s = seconds
        self.guessed = False
        if not first:
            self.ran += 1

    def cut_short(self) -> str:
        """The row's note when fewer repeats ran than were asked, else ""."""
        if self.ran >= self.wanted:
            return ""
        took = f"; a save took {self.last_save_s:.1f} s" if self.last_save_s is not None else ""
        return (
            f"{self.ran} repeat{'' if self.ran == 1 else 's'} of {self.wanted} "
            f"(budget: its share was {self.share_s:.0f} s{took})"
        )

    def hung_reason(self, timeout: float | None, save_timeout: float | None) -> str:
        """Why a save that gave no result in ``timeout`` was abandoned."""
        if timeout is not None and save_timeout is not None and timeout < save_timeout:
            return f"its share of the --budget ({self.share_s:.0f} s) ended"
        return ""
