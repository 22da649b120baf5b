"""shmstage client: stage a trainer's state dict into shmstaged and load checkpoints back.

from shmstage_client import Stager, load

with Stager() as stager:
    handle = stager.save(model_and_optimizer_state, "/ckpt/step-1000")  # copy only
    ...                                                                # keep training
    # or: stager.guard(optimizer) once, then save(..., block=False): the copy runs behind
    # the next forward and backward, and the optimizer's step waits for it
    handle.wait()                                                      # durable
state = load("/ckpt/step-1000")         # from shmstaged's memory when it still holds it
prepare_restore("cuda")                  # restart script, before building the model: staging made
restored = latest(device="cuda")         # after a crash: the newest checkpoint, no path needed
stager.publish(model.state_dict(), "policy", step=7)   # readers on this node: a version
with subscribe("policy").wait(newer_than=6) as version:  # another process: woken, pinned
    model.load_state_dict(version.state(device="cuda"))
"""

from shmstage.checkpoint import CheckpointError, ChecksumError
from shmstage_client.errors import (
    CheckpointExists,
    DaemonLost,
    DaemonRefused,
    DaemonUnavailable,
    DestinationError,
    PersistError,
    SaveError,
    SaveTimeout,
    SlotUnavailable,
    StagingLimitExceeded,
    UnsupportedValue,
)
from shmstage_client.restore.restoring import Restored, latest, load, prepare_restore, restore
from shmstage_client.save.guard import Guard
from shmstage_client.save.handle import SaveEvent, SaveHandle, SaveResult, SaveTimings
from shmstage_client.save.publish import Published
from shmstage_client.save.staged import Staged
from shmstage_client.save.stager import ReserveInfo, Stager
from shmstage_client.subscribe.sharded import IncompleteTensor, ShardedVersion
from shmstage_client.subscribe.subscriber import NoNewVersion, Subscriber, subscribe
from shmstage_client.subscribe.version import ChecksumsUnavailable, Version, VersionExpired

__version__ = "0.1.0"
__all__ = [
    "CheckpointError",
    "CheckpointExists",
    "ChecksumError",
    "ChecksumsUnavailable",
    "DaemonLost",
    "DaemonRefused",
    "DaemonUnavailable",
    "DestinationError",
    "Guard",
    "IncompleteTensor",
    "NoNewVersion",
    "PersistError",
    "Published",
    "ReserveInfo",
    "Restored",
    "SaveError",
    "SaveEvent",
    "SaveHandle",
    "SaveResult",
    "SaveTimeout",
    "SaveTimings",
    "ShardedVersion",
    "SlotUnavailable",
    "Staged",
    "Stager",
    "StagingLimitExceeded",
    "Subscriber",
    "UnsupportedValue",
    "Version",
    "VersionExpired",
    "latest",
    "load",
    "prepare_restore",
    "restore",
    "subscribe",
]
