"""PyTorch DCP through shmstage: ``dcp.async_save(state, storage_writer=ShmStageWriter(path))``.

``ShmStagePublisher`` publishes a sharded trainer's weights to readers on the node, one
version per step made of every local rank's shards (``publisher``).

DCP does the global coordination; each node's shmstaged stages and writes that node's ranks'
shards. Every rank's data lands in its own ``.safetensors`` file that stock
``torch.distributed.checkpoint.HuggingFaceStorageReader`` can load and reshard; non-tensor
items go to a sidecar that ``ShmStageReader`` reads; the coordinator publishes the checkpoint
(atomically, with a commit marker) only once every rank's data is durable.
"""

from shmstage_client.dcp.directory import MARKER_NAME, verify
from shmstage_client.dcp.publisher import ShmStagePublisher
from shmstage_client.dcp.reader import ShmStageReader
from shmstage_client.dcp.writer import PROCESS_MODE_REFUSED, ShmStageWriter, StageStats

__all__ = [
    "MARKER_NAME",
    "PROCESS_MODE_REFUSED",
    "ShmStagePublisher",
    "ShmStageReader",
    "ShmStageWriter",
    "StageStats",
    "verify",
]
