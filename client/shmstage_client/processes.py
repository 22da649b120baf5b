"""Whether a process of this node still runs: for leftovers named after the pid that made
them (a hidden save of a killed trainer, an exported version of a killed reader), which
may be removed only once that process is gone."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs. A zombie (killed, not yet reaped) does not: its
    leftovers are as dead as it is. A pid of another user's process counts as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return status.rsplit(")", 1)[-1].split()[:1] != ["Z"]
