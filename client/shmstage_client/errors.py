"""What can go wrong with a save, as exception types a trainer can catch precisely."""

from __future__ import annotations


class SaveError(Exception):
    """Base of every failure of ``Stager.save`` or ``SaveHandle.wait``."""


class DaemonUnavailable(SaveError):
    """shmstaged cannot be reached (not running, wrong socket, no permission)."""


class DaemonLost(SaveError):
    """The connection to shmstaged broke: the daemon died, restarted or dropped us."""


class DaemonRefused(SaveError):
    """shmstaged answered a request with an error; ``code`` is the protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"shmstaged refused: {message} [{code}]")
        self.code = code
        self.message = message


class SlotUnavailable(DaemonRefused):
    """No staging slot was free (fail-fast mode, or the wait timed out)."""


class StagingLimitExceeded(DaemonRefused):
    """The save would exceed shared memory or a per-client limit."""


class UnsupportedValue(SaveError, TypeError):
    """The state dict holds something shmstage cannot store; nothing was written."""


class CheckpointExists(SaveError, FileExistsError):
    """The destination already holds a checkpoint; shmstage never overwrites one."""


class DestinationError(SaveError):
    """The checkpoint path cannot be used (empty, a file, a dangling symlink, not writable);
    the message says what it is and the fix. Nothing was written."""


class PersistError(SaveError):
    """The daemon could not write the checkpoint; partial files were removed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"checkpoint was not written: {message} [{code}]")
        self.code = code
        self.message = message


class SaveTimeout(SaveError, TimeoutError):
    """A bounded wait ran out before the daemon answered."""
