"""Pure checks of what a client sent: each returns the checked value or raises
``RequestError`` naming the field and the fix. No state and no I/O beyond ``fstat`` and
``fcntl`` on descriptors the request itself carried, so handlers call them first and a
test calls them with a frame it built.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import stat
from typing import Any

import msgpack

from shmstage import tree
from shmstage.layout import Layout
from shmstage.protocol import (
    MAX_FDS_PER_FRAME,
    ErrorCode,
    Frame,
    Packed,
    ProtocolError,
    decode_packed,
)
from shmstage_daemon import job, treediff
from shmstage_daemon.transport import close_fds

#: Segment descriptors go out in groups at most this size (one frame each), or smaller
#: when the client says it can take fewer at a time (``register.max_fds``).
FDS_PER_FRAME = MAX_FDS_PER_FRAME
MAX_METADATA_ENTRIES = 10_000


class RequestError(Exception):
    """A request this client got wrong; answered with an error frame, session lives on."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def destination(frame: Frame) -> job.Destination:
    """The commit's destination, owning its descriptors from here on: a new directory
    (parent, pending directory, data, manifest) or an existing one (directory, data,
    manifest), as the fields say."""
    fds, body = frame.fds, frame.body
    fields = ("pending_dir" in body) + ("final_dir" in body)
    count, what = (
        (4, "parent directory, pending directory, data file, manifest file")
        if fields
        else (3, "directory, data file, manifest file")
    )
    problem = (
        "commit.pending_dir and commit.final_dir go together"
        if fields == 1
        else f"commit needs {count} descriptors ({what}), got {len(fds)}"
        if len(fds) != count
        else ""
    )
    if problem:
        close_fds(fds)
        raise RequestError(ErrorCode.BAD_REQUEST, problem)
    names_ = (body["data_file"], body["data_tmp"], body["manifest_tmp"])
    if not fields:
        return job.Destination(fds[0], fds[1], fds[2], *names_)
    return job.Destination(
        fds[1],
        fds[2],
        fds[3],
        *names_,
        parent_fd=fds[0],
        pending_dir=body["pending_dir"],
        final_dir=body["final_dir"],
    )


def commit_contents(body: dict[str, Any]) -> tuple[dict[str, str], Any]:
    """A commit's file metadata and metadata, checked: what the data file's header and the
    manifest will hold besides the tree (``commit_tree``)."""
    file_metadata = string_map(body.get("file_metadata", {}), "file_metadata")
    metadata = body.get("metadata", {})
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise RequestError(ErrorCode.BAD_REQUEST, "metadata has too many entries")
    check_json(metadata, "commit.metadata")
    return file_metadata, metadata


def commit_tree(value: Any, layout: Layout, seen: tuple[bytes, Any] | None) -> tuple[bytes, Any]:
    """A commit's tree as it came (``Packed``, as a frame's decoder keeps it) and decoded,
    checked against ``layout`` — unless it is exactly the one ``seen`` (the layout's last
    commit's, checked then): a save of the same structure and plain values decodes and
    checks nothing, however many tensors it has, and one whose plain values changed only
    what changed (``treediff``)."""
    packed = value if isinstance(value, Packed) else Packed(msgpack.packb(value, use_bin_type=True))
    if seen is not None and seen[0] == packed:
        return seen
    if seen is not None and isinstance(value, Packed):  # only what changed, decoded
        reused = treediff.patched(seen[0], seen[1], packed, layout.key_set)
        if reused is not None:
            return packed, reused
    if isinstance(value, Packed):
        try:
            value = decode_packed(packed)
        except ProtocolError as exc:
            raise RequestError(exc.code, f"commit.tree: {exc.message}") from None
    check_tree(value, layout)
    return packed, value


def fds_per_message(frame: Frame) -> int:
    """Descriptors per message the client takes (``max_fds``), checked."""
    batch = frame.body.get("max_fds", FDS_PER_FRAME)
    if not 1 <= batch <= FDS_PER_FRAME:
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"{frame.op}.max_fds {batch} must be 1..{FDS_PER_FRAME} descriptors per message",
        )
    return batch


def readable_fd(fd: int, op: str, kind: Any, what: str) -> os.stat_result:
    """A descriptor the client opened for reading (not O_PATH: that proves no access)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    st = os.fstat(fd)
    if flags & getattr(os, "O_PATH", 0) or flags & os.O_ACCMODE not in (os.O_RDONLY, os.O_RDWR):
        raise RequestError(ErrorCode.BAD_REQUEST, f"{op}: the descriptor is not open for reading")
    if not kind(st.st_mode):
        raise RequestError(ErrorCode.BAD_REQUEST, f"{op}: the descriptor is not {what}")
    return st


def check_file_fd(name: str, fd: int, dir_fd: int) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise RequestError(ErrorCode.BAD_REQUEST, f"{name}: descriptor is not a regular file")
    if st.st_nlink != 1:  # a fresh temporary file has exactly its one name
        raise RequestError(
            ErrorCode.BAD_REQUEST, f"{name}: the file has {st.st_nlink} links, not a fresh one"
        )
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE not in (os.O_WRONLY, os.O_RDWR):
        raise RequestError(ErrorCode.BAD_REQUEST, f"{name}: descriptor is not open for writing")
    try:
        named = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise RequestError(
            ErrorCode.BAD_REQUEST, f"{name} does not exist in the checkpoint directory"
        ) from None
    if (named.st_dev, named.st_ino) != (st.st_dev, st.st_ino):
        raise RequestError(ErrorCode.BAD_REQUEST, f"{name} is not the file whose descriptor came")
    return st


def string_map(value: object, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise RequestError(ErrorCode.BAD_REQUEST, f"{what} must map strings to strings")
    if len(value) > MAX_METADATA_ENTRIES:
        raise RequestError(ErrorCode.BAD_REQUEST, f"{what} has too many entries")
    return value


def check_json(value: object, what: str) -> None:
    """Refuse now what the manifest (strict JSON) could not hold, rather than after the ack."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise RequestError(
            ErrorCode.BAD_REQUEST, f"{what} must be plain JSON values: {exc}"
        ) from None


def check_tree(encoded: object, layout: Layout) -> None:
    """The structure must decode and refer only to tensors the layout has.

    Otherwise the daemon would publish a checkpoint whose manifest refers to tensors that
    are not there, which ``verify`` and ``load`` then reject.
    """
    try:
        keys = tree.tensor_keys(encoded)
    except (ValueError, TypeError, RecursionError) as exc:
        raise RequestError(ErrorCode.BAD_REQUEST, f"commit.tree is malformed: {exc}") from None
    unknown = set(keys) - layout.key_set
    if unknown:
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"commit.tree refers to tensors the layout does not have: {sorted(unknown)[:5]}",
        )
    # No JSON check needed: a tree tensor_keys accepts holds only None, bools, ints,
    # strings, lists and one-entry dicts with string tags, all of which JSON can hold.


def finite(value: object) -> float | None:
    """A client-reported duration fit for the metrics (NaN or infinity would poison sums)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None
