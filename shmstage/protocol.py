"""The shmstage wire protocol as a pure state machine over bytes (sans-IO, after h11).

A frame is a 4-byte big-endian length followed by one msgpack map::

    {"op": str, "id": int, "nfds": int, ...op fields}

``nfds`` says how many file descriptors travelled with the frame (SCM_RIGHTS). The kernel
hands descriptors to the reader alongside the bytes, so the transport feeds them to
:meth:`Connection.receive_data` together with the bytes they arrived with, and the
connection hands them out, first in first out, to the frames that declare them. Descriptors
nobody claims once every complete frame is parsed are a protocol violation: they are closed,
never leaked into the daemon.

The connection knows nothing about sockets; it only turns bytes into :class:`Frame` events
and events into bytes. Anything malformed — a bad length, undecodable msgpack, an unknown
op, a field of the wrong type, a frame out of order — raises :class:`ProtocolError`, after
which the stream cannot be resynchronised and the connection is dead: the caller sends the
error frame (:meth:`Connection.error_frame`) and closes.
"""

from __future__ import annotations

import contextlib
import enum
import os
import struct
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

#: 2: layouts of many tensors pack their small ones into shared segments (``packing``).
PROTOCOL_VERSION: Final = 2
#: A layout of 100,000 tensors describes itself in ~12 MiB; nothing legitimate is larger.
DEFAULT_MAX_FRAME_BYTES: Final = 32 * 1024 * 1024
#: Linux passes at most SCM_MAX_FD (253) descriptors per sendmsg.
MAX_FDS_PER_FRAME: Final = 253
#: Descriptors may be queued ahead of their frame's bytes, but never without bound.
MAX_PENDING_FDS: Final = 4 * MAX_FDS_PER_FRAME
#: What a daemon accepts from a client: only ``commit`` (at most 4), ``lease`` and
#: ``latest`` (at most 1) carry descriptors.
DAEMON_MAX_PENDING_FDS: Final = 8
#: The client ops whose handler takes the descriptors that came with them (any other op
#: carrying one is refused and the descriptors closed), and how many each may carry.
FD_OPS: Final = {"commit": (3, 4), "lease": (1, 1), "latest": (0, 1)}
#: Where a restored checkpoint came from, as a client reports it (``restored``).
RESTORE_SOURCES: Final = ("memory", "files")
#: Frames of every op but the two that carry a structure are small: refused above this
#: before they are decoded, so a 31 MiB "hello" costs nothing.
SMALL_FRAME_BYTES: Final = 64 * 1024
LARGE_OPS: Final = frozenset({"register", "commit", "publish"})
#: Decoding frames above ``_COUNTED_ABOVE`` bytes counts the containers it builds and stops
#: past this many: a frame of tiny maps expands 25-60x when decoded, so bytes alone do not
#: bound the memory (or the event loop's time) one frame can take. A commit's structure
#: costs about 7 containers per tensor, a register about 2.
MAX_DECODED_CONTAINERS: Final = 1_000_000
_COUNTED_ABOVE: Final = 256 * 1024
_LENGTH = struct.Struct(">I")


class ErrorCode(enum.StrEnum):
    """Typed error codes; each travels with a human message naming the thing and the fix."""

    BAD_FRAME = "bad_frame"
    FRAME_TOO_LARGE = "frame_too_large"
    OUT_OF_ORDER = "out_of_order"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_OP = "unknown_op"
    BAD_REQUEST = "bad_request"
    NOT_ALLOWED = "not_allowed"
    UNKNOWN_LAYOUT = "unknown_layout"
    NO_FREE_SLOT = "no_free_slot"
    SLOT_NOT_OWNED = "slot_not_owned"
    SHM_EXHAUSTED = "shm_exhausted"
    LIMIT_EXCEEDED = "limit_exceeded"
    STORAGE = "storage"
    EXISTS = "exists"
    SHUTTING_DOWN = "shutting_down"
    #: The daemon does not hold (any more) the checkpoint asked for: read the files.
    NOT_RETAINED = "not_retained"
    INTERNAL = "internal"


class Packed(bytes):
    """A field's msgpack encoding, kept undecoded by the frame decoder (``KEPT_PACKED``):
    its receiver decodes it with ``decode_packed`` — or not at all, when it equals one it
    decoded and checked already."""


#: Fields a frame of these ops keeps as ``Packed``: a commit's or a publish's structure,
#: which the daemon decodes and checks once per layout and structure, not on every save
#: or version (``commits``, ``publishing``).
KEPT_PACKED: Final = {"commit": "tree", "publish": "tree"}


def decode_packed(packed: bytes) -> Any:
    """A ``Packed`` field decoded as the frame decoder would have decoded it: containers
    counted (``MAX_DECODED_CONTAINERS``), extension types refused. Raises ProtocolError.

    Every map and list takes at least a byte, so a field of no more bytes than the budget
    cannot exceed it and is not counted (a first commit's tree of 10,000 tensors decodes
    in half the time)."""
    counted = _Budget().hooks() if len(packed) > MAX_DECODED_CONTAINERS else {}
    try:
        return msgpack.unpackb(
            packed, raw=False, strict_map_key=True, ext_hook=_refuse_ext, use_list=True, **counted
        )
    except _OverBudget:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE,
            f"{len(packed)} bytes decode to more than {MAX_DECODED_CONTAINERS} maps and lists",
        ) from None
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(ErrorCode.BAD_FRAME, f"undecodable: {exc}") from None


def packed_unpacker(packed: bytes) -> msgpack.Unpacker:
    """An unpacker of ``packed`` that decodes as ``decode_packed`` does, for a reader that
    decodes only parts of it (and skips the rest): every container its ``unpack`` calls
    build counts against one budget; it raises on the budget or an extension type."""
    unpacker = msgpack.Unpacker(
        raw=False,
        strict_map_key=True,
        ext_hook=_refuse_ext,
        use_list=True,
        max_buffer_size=max(len(packed), 1),
        **_Budget().hooks(),
    )
    unpacker.feed(packed)
    return unpacker


class ProtocolError(Exception):
    """A peer broke the protocol; the message is safe to send back to it."""

    def __init__(self, code: ErrorCode, message: str, request_id: int = 0) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class Role(enum.Enum):
    CLIENT = "client"
    DAEMON = "daemon"


# Field schemas: op -> (who may send it, {field: accepted types}). Optional fields are
# listed in _OPTIONAL. Deeper validation (a layout's tensors, names) belongs to the module
# that owns the concept; the protocol guarantees only shape and primitive types.
_INT = (int,)
_STR = (str,)
_NUM = (int, float)
_BOOL = (bool,)
_LIST = (list,)
_MAP = (dict,)
_ANY = (object,)
_NONE = (type(None),)

_CLIENT_OPS: dict[str, dict[str, tuple[type, ...]]] = {
    "hello": {"version": _INT, "client": _STR, "pid": _INT},
    # ``max_fds``: how many descriptors the client can take in one message (its free
    # descriptors, see RLIMIT_NOFILE); the daemon sends the segments in batches that size.
    # ``planned_slots``: the slots the client will have once it adds the others
    # ("add_slots"): the limits must allow them now, and a retained layout this
    # registration adopts keeps up to that many. ``adopt_only``: adopt a retained layout
    # of this user and structure, or create nothing (refused "not_retained").
    "register": {
        "tensors": _LIST, "slots": _INT, "max_fds": _INT, "planned_slots": _INT,
        "adopt_only": _BOOL,
    },
    # More slots for a registered layout (up to ``slots`` in all): a client registers one
    # slot for its first save and asks for the others once that save is on its way.
    "add_slots": {"layout": _INT, "slots": _INT, "max_fds": _INT},
    "acquire": {"layout": _INT, "wait": _BOOL, "timeout": _NUM + _NONE},
    "cancel": {"layout": _INT, "slot": _INT},
    "commit": {
        "layout": _INT,
        "slot": _INT,
        "data_file": _STR,
        "data_tmp": _STR,
        "manifest_tmp": _STR,
        # A save to a new directory: the client made the hidden ``pending_dir`` in the
        # destination's parent, and the daemon publishes it by renaming it to ``final_dir``.
        # Descriptors: parent, pending directory, data file, manifest file. Without these
        # fields the files go into an existing directory: directory, data file, manifest.
        "pending_dir": _STR,
        "final_dir": _STR,
        "tree": _ANY,
        "metadata": _MAP,
        "file_metadata": _MAP,
        # Clients before the "report" op sent their copy and slot-wait times here.
        "stage_seconds": _NUM,
        "slot_wait_seconds": _NUM,
        # False: sent while the copy still runs, so that the daemon checks and journals it
        # meanwhile; the daemon answers "prepared" and starts nothing until "ready".
        "ready": _BOOL,
    },
    "ready": {
        "layout": _INT,
        "slot": _INT,
        "job": _INT,
        "stage_seconds": _NUM,
        "slot_wait_seconds": _NUM,
    },
    # One-way, never answered (an error only if it is malformed): what a committed save cost
    # the trainer, sent after save() returned, since only then is the stall known.
    "report": {
        "job": _INT,
        "stall_seconds": _NUM,
        "prepare_seconds": _NUM,
        "setup_seconds": _NUM,
        "slot_wait_seconds": _NUM,
        "copy_seconds": _NUM,
        "commit_seconds": _NUM,
    },
    "release": {"layout": _INT},
    "status": {},
    "metrics": {},
    # Restoring from the daemon's memory. "lease": the exact checkpoint whose data file
    # the client opened (one descriptor, read-only) and whose manifest hashes to
    # ``digest`` (``manifest.digest``). "latest": the caller's newest acknowledged
    # checkpoint, optionally of one structure (``layout.Layout.digest``) and, with one
    # descriptor, in that parent directory. Both are answered by "leased" and the
    # segments' read-only descriptors in "lease_fds" frames, or by "not_retained".
    "lease": {"digest": _STR, "seconds": _NUM, "max_fds": _INT},
    "latest": {"structure": _STR, "seconds": _NUM, "max_fds": _INT},
    "renew": {"lease": _INT, "seconds": _NUM},
    "unlease": {"lease": _INT},
    # One-way, never answered: how a restore went, for the metrics.
    "restored": {"source": _STR, "seconds": _NUM, "bytes": _INT},
    # Publishing (``channels``): the filled ``slot`` becomes version ``step`` of the
    # caller's channel ``name``, visible to subscribers at once; with ``job`` it is the
    # slot of that committed save (its tree and metadata are the commit's). ``share``:
    # gids whose members may subscribe too (each must be allowed by the daemon). A rank of
    # a sharded publisher sends its ``part`` of ``parts``, each shard's global shape by flat
    # key (``shapes``), and how long the step's first part waits for the rest (``within``).
    "publish": {
        "layout": _INT,
        "slot": _INT,
        "name": _STR,
        "step": _INT,
        "job": _INT,
        "tree": _ANY,
        "metadata": _MAP,
        "share": _LIST,
        "part": _INT,
        "parts": _INT,
        "shapes": _MAP,
        "within": _NUM,
    },
    # A subscription is a request that stays open: "subscribed" answers it, then each new
    # version of the channel is announced by a "version" frame carrying its id.
    "subscribe": {"name": _STR, "owner": _INT},
    # Pin the channel's newest version (newer than ``newer_than``): answered by "pinned"
    # and, for a slot this connection was not sent yet, its read-only segments in
    # "ring_fds" frames. ``hold``: when there is no such version yet, the daemon keeps the
    # request up to that many seconds (at most the welcome's
    # ``limits.max_pin_hold_seconds``; a daemon without it refuses the field) and pins the
    # first one made visible meanwhile — the answer is the wake-up — or answers
    # "no_newer" once the hold ran out.
    "pin": {
        "channel": _INT, "newer_than": _INT + _NONE, "seconds": _NUM, "max_fds": _INT,
        "hold": _NUM,
    },
    # Stop holding this connection's pin request ``request`` (its caller stopped waiting):
    # a request still held is answered "no_newer" at once; then "unheld" answers this.
    "unhold": {"request": _INT},
    "unpin": {"pin": _INT},
    # The checksums of a version this connection pins, waiting up to ``seconds`` (0, the
    # default: only those known now) while the daemon computes them; "checksummed" answers.
    "checksums": {"pin": _INT, "seconds": _NUM, "part": _INT},
    # The caller's ``layout`` is the ring of its channel ``name`` from now, before its
    # first version there (its next versions come from it): readers may map it ahead
    # ("ring"); ``share`` as for "publish". Answered by "offered"; followers are told by a
    # "ring_ready" frame on their subscription.
    "offer": {"layout": _INT, "name": _STR, "share": _LIST},
    # Every slot of the followed channel's current ring, pinning nothing, so that a
    # reader maps and registers them before its first version: answered by "ring_slots"
    # and each slot's read-only segments in "slot_fds" frames (slots this connection was
    # sent already are not sent again).
    "ring": {"channel": _INT, "max_fds": _INT},
}
_DAEMON_OPS: dict[str, dict[str, tuple[type, ...]]] = {
    # ``default_slots``: the slots a registration without ``slots`` gets.
    "welcome": {
        "version": _INT,
        "daemon": _STR,
        "instance": _STR,
        "limits": _MAP,
        "default_slots": _INT,
    },
    # ``adopted``: segments taken over from a retained layout of the same user and
    # structure (none of them was created for this registration).
    "registered": {"layout": _INT, "slots": _INT, "segments": _INT, "adopted": _INT},
    # Answers "add_slots": the layout's slots now, and how many new segments follow in
    # "segment_fds" frames (``first`` counting from the first new one).
    "slots_added": {"layout": _INT, "slots": _INT, "segments": _INT},
    "segment_fds": {"layout": _INT, "first": _INT},
    # ``leased``: the wait was (also) for a reader's lease on a free slot to end.
    "acquired": {"layout": _INT, "slot": _INT, "waited": _NUM, "leased": _BOOL},
    "cancelled": {"layout": _INT, "slot": _INT},
    "prepared": {"layout": _INT, "slot": _INT, "job": _INT},
    "committed": {"layout": _INT, "slot": _INT, "job": _INT},
    "job_done": {"job": _INT, "ok": _BOOL, "result": _MAP},
    "released": {"layout": _INT},
    "status": {"status": _MAP},
    "metrics": {"metrics": _MAP},
    "error": {"code": _STR, "message": _STR, "fatal": _BOOL},
    # A lease: the slot's segments cannot be refilled until "unlease", the connection's
    # end, or ``seconds`` from now. ``digest`` is empty and ``durable`` false while the
    # checkpoint is still being written; ``tensors``, ``tree``, ``metadata`` (the
    # structure) and ``checksums`` (each tensor's CRC-32C in layout order, null until
    # durable) come with "latest": the daemon's own record, so that its caller trusts no
    # manifest found at a path that another user may have changed since.
    "leased": {
        "lease": _INT,
        "seconds": _NUM,
        "job": _INT,
        "segments": _INT,
        "sizes": _LIST,
        "durable": _BOOL,
        "digest": _STR,
        "directory": _STR,
        "data_file": _STR,
        "acknowledged_unix": _NUM,
        "tensors": _LIST,
        "tree": _ANY,
        "metadata": _MAP,
        "checksums": (list, type(None)),
    },
    "lease_fds": {"lease": _INT, "first": _INT},
    "renewed": {"lease": _INT, "seconds": _NUM},
    # ``held``: the lease was still in force until now, so nothing refilled the slot
    # while the client read it (false: it had expired, and what was read may be torn).
    "unleased": {"lease": _INT, "held": _BOOL},
    # ``visible``: whether this publish made the version visible (false: a part of a
    # sharded version whose other parts have not all arrived).
    "published": {"name": _STR, "step": _INT, "subscribers": _INT, "visible": _BOOL},
    # ``newest``: the step of the channel's newest version, if it has one now.
    "subscribed": {"channel": _INT, "newest": _INT + _NONE},
    # The one frame the daemon sends unasked: a new version of a subscribed channel is
    # visible. It carries the id of the client's "subscribe" request, whose answers it
    # continues; versions published meanwhile may be folded into the newest.
    "version": {"channel": _INT, "step": _INT},
    # ``ring``: the publisher's layout (a new one: map its slots afresh); ``slot``: the
    # slot's key in that ring (stable while the ring lives); ``tensors`` (the ring's
    # structure) only with the ring's first pin on this connection; ``tree`` only when it
    # differs from the last one sent on this connection (at 10,000 tensors, decoding it
    # took a reader ~45 ms per version); ``segments``: how many descriptors follow in
    # "ring_fds" frames (0 when this connection has them).
    "pinned": {
        "pin": _INT,
        "step": _INT,
        "seconds": _NUM,
        "ring": _INT,
        "slot": _INT,
        "segments": _INT,
        "sizes": _LIST,
        "tensors": _LIST,
        "tree": _ANY,
        "metadata": _MAP,
        # Each tensor's CRC-32C (layout order), once the daemon computed them after the
        # version became visible (or, for ``save(..., publish=)``, its job did); absent
        # until then ("checksums" asks for them later).
        "checksums": _LIST,
        # A sharded version: each part's ring, slot, segments, sizes, shapes (and tensors,
        # tree, checksums as above); ring, slot and sizes above are part 0's.
        "parts": _LIST,
    },
    # Answers a held "pin" whose hold ran out with no version newer than asked;
    # ``newest``: the channel's newest step then.
    "no_newer": {"channel": _INT, "newest": _INT + _NONE},
    # ``held``: the request was still held, and was answered "no_newer" (false: it was
    # answered already, or is being answered: its answer — a pin, perhaps — still comes).
    "unheld": {"request": _INT, "held": _BOOL},
    # ``checksums``: null when there are none (yet: within the time asked for).
    "checksummed": {"pin": _INT, "checksums": (list, type(None))},
    "ring_fds": {"pin": _INT, "first": _INT, "part": _INT},
    # Answers "ring": ``ring`` null when the channel has no ring now (no version yet, or
    # its publisher went: ask again after the next "version"); otherwise its id (the
    # "ring" of later "pinned" frames), ``sizes``, ``tensors`` (only when this connection
    # was sent none of its slots), ``slots``: the keys of the slots whose ``segments``
    # descriptors each follow, slot by slot, in "slot_fds" frames. The bytes are not
    # pinned: only a pinned version's are that version's.
    "ring_slots": {
        "ring": _INT + _NONE,
        "sizes": _LIST,
        "tensors": _LIST,
        "slots": _LIST,
        "segments": _INT,
    },
    "slot_fds": {"ring": _INT, "slot": _INT, "first": _INT},
    # ``subscribers``: the followers told (by "ring_ready").
    "offered": {"name": _STR, "subscribers": _INT},
    # Sent unasked, like "version", on a subscription: the channel has a new ring to map
    # ahead of its next version ("ring").
    "ring_ready": {"channel": _INT, "ring": _INT},
    # ``held``: the pin was in force until now (false: it had expired).
    "unpinned": {"pin": _INT, "held": _BOOL},
}
#: The parts of a save's stall a "report" may carry besides ``stall_seconds``.
REPORT_PARTS: Final = (
    "prepare_seconds",
    "setup_seconds",
    "slot_wait_seconds",
    "copy_seconds",
    "commit_seconds",
)
_OPTIONAL: dict[str, frozenset[str]] = {
    "commit": frozenset(
        {
            "file_metadata",
            "metadata",
            "stage_seconds",
            "slot_wait_seconds",
            "ready",
            "pending_dir",
            "final_dir",
        }
    ),
    "ready": frozenset({"stage_seconds", "slot_wait_seconds"}),
    # Without "slots" the daemon uses its configured default_slots; without "max_fds" it
    # sends as many descriptors per message as Linux allows.
    "register": frozenset({"slots", "max_fds", "planned_slots", "adopt_only"}),
    "add_slots": frozenset({"max_fds"}),
    "welcome": frozenset({"default_slots"}),
    "report": frozenset(REPORT_PARTS),
    "lease": frozenset({"seconds", "max_fds"}),
    "latest": frozenset({"structure", "seconds", "max_fds"}),
    "renew": frozenset({"seconds"}),
    "registered": frozenset({"adopted"}),
    "acquired": frozenset({"leased"}),
    "leased": frozenset({"tensors", "tree", "metadata", "checksums"}),
    "publish": frozenset(
        {"job", "tree", "metadata", "share", "part", "parts", "shapes", "within"}
    ),
    "published": frozenset({"visible"}),
    "subscribe": frozenset({"owner"}),
    "pin": frozenset({"newer_than", "seconds", "max_fds", "hold"}),
    "checksums": frozenset({"seconds", "part"}),
    "pinned": frozenset({"tensors", "tree", "checksums", "parts"}),
    "ring_fds": frozenset({"part"}),
    "ring": frozenset({"max_fds"}),
    "offer": frozenset({"share"}),
    "ring_slots": frozenset({"sizes", "tensors", "slots", "segments"}),
}
_HANDSHAKE = {Role.CLIENT: "hello", Role.DAEMON: "welcome"}


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded message. ``fds`` are owned by whoever takes the frame: close them."""

    op: str
    id: int
    body: dict[str, Any]
    fds: tuple[int, ...] = field(default=())
    #: Its encoded size, for accounting what it may cost to keep (a journal entry).
    size: int = 0


def encode_frame(
    op: str,
    request_id: int,
    body: dict[str, Any],
    nfds: int = 0,
    *,
    max_bytes: int,
    prepacked: Mapping[str, bytes] | None = None,
) -> bytes:
    """Encode one frame; refuses what the peer would refuse rather than sending it.

    ``prepacked``: fields whose msgpack encoding the caller already has (a commit's tree,
    packed while the state dict was checked), spliced in as they are: the bytes are those
    of packing the values here, without packing them twice.
    """
    if nfds > MAX_FDS_PER_FRAME:
        raise ValueError(f"{nfds} descriptors in one frame; Linux passes at most 253")
    message = {"op": op, "id": request_id, "nfds": nfds, **body}
    if prepacked:
        payload = pack_map(message, prepacked)
    else:
        payload = msgpack.packb(message, use_bin_type=True)
    if len(payload) > max_bytes:
        raise ValueError(
            f"{op} frame of {len(payload)} bytes exceeds the {max_bytes}-byte frame limit"
        )
    return _LENGTH.pack(len(payload)) + payload


def pack_map(fields: Mapping[str, Any], prepacked: Mapping[str, bytes]) -> bytes:
    """A msgpack map of ``fields`` in their order, where ``prepacked`` holds the encoding of
    some values already (used in place; keys only in ``prepacked`` come last)."""
    packer = msgpack.Packer(use_bin_type=True)
    extra = [key for key in prepacked if key not in fields]
    parts = [packer.pack_map_header(len(fields) + len(extra))]
    for key, value in fields.items():
        parts.append(packer.pack(key))
        parts.append(prepacked[key] if key in prepacked else packer.pack(value))
    for key in extra:
        parts.append(packer.pack(key))
        parts.append(prepacked[key])
    return b"".join(parts)


class Connection:
    """One side of a shmstage conversation.

    ``role`` is the side *we* are. Frames we receive are checked against what the other
    side may send, in the order it may send them: the client's ``hello`` must come first and
    only once; the daemon's ``welcome`` must answer it before anything else.
    """

    def __init__(
        self,
        role: Role,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        close_fd: Callable[[int], None] = os.close,
        max_pending_fds: int | None = None,
    ) -> None:
        self.role = role
        self.max_frame_bytes = max_frame_bytes
        if max_pending_fds is None:
            max_pending_fds = DAEMON_MAX_PENDING_FDS if role is Role.DAEMON else MAX_PENDING_FDS
        self.max_pending_fds = max_pending_fds
        self._close_fd = close_fd
        self._buffer = bytearray()
        self._fds: deque[int] = deque()
        self._peer_greeted = False
        self._we_greeted = False
        self._eof = False
        self.dead: ProtocolError | None = None
        self._peer_ops = _CLIENT_OPS if role is Role.DAEMON else _DAEMON_OPS

    # -- receiving ---------------------------------------------------------------

    def receive_data(self, data: bytes, fds: Iterable[int] = ()) -> None:
        """Feed bytes (``b""`` means end of stream) and the descriptors that came with them."""
        fds = list(fds)
        if self.dead is not None:
            self._close_all(fds)
            return
        if not data and not fds:
            self._eof = True
            return
        self._buffer += data
        self._fds.extend(fds)
        if len(self._fds) > self.max_pending_fds:
            self._fail(
                ProtocolError(
                    ErrorCode.BAD_FRAME,
                    f"{len(self._fds)} file descriptors queued without frames to claim them",
                )
            )

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None when more bytes are needed.

        Raises ProtocolError (and the connection is dead) on any violation; raises EOFError
        when the peer closed the stream cleanly between frames.
        """
        if self.dead is not None:
            raise self.dead
        if len(self._buffer) < _LENGTH.size:
            return self._idle()
        (length,) = _LENGTH.unpack_from(self._buffer)
        if length > self.max_frame_bytes:
            self._fail(
                ProtocolError(
                    ErrorCode.FRAME_TOO_LARGE,
                    f"frame of {length} bytes exceeds the limit of {self.max_frame_bytes}",
                )
            )
        if length == 0:
            self._fail(ProtocolError(ErrorCode.BAD_FRAME, "empty frame"))
        if length > SMALL_FRAME_BYTES and self.role is Role.DAEMON:
            self._check_large(length)
        if len(self._buffer) < _LENGTH.size + length:
            if self._eof:
                self._fail(ProtocolError(ErrorCode.BAD_FRAME, "stream ended inside a frame"))
            return None
        payload = bytes(self._buffer[_LENGTH.size : _LENGTH.size + length])
        del self._buffer[: _LENGTH.size + length]
        return self._decode(payload)

    @property
    def buffered(self) -> int:
        """Bytes received but not yet a frame: nonzero while a frame is arriving."""
        return len(self._buffer)

    def _check_large(self, length: int) -> None:
        """Only ``register`` and ``commit`` may be large; known from the op, which a client
        sends first, before the rest of the frame has even arrived."""
        head = bytes(self._buffer[_LENGTH.size : _LENGTH.size + 64])
        if len(head) < 64 and len(self._buffer) < _LENGTH.size + length:
            return  # not enough of it yet to read the op
        op = _first_op(head)
        if op not in LARGE_OPS:
            self._fail(
                ProtocolError(
                    ErrorCode.FRAME_TOO_LARGE,
                    f"a {op or 'frame without op first'} frame of {length} bytes; only "
                    f"{', '.join(sorted(LARGE_OPS))} may exceed {SMALL_FRAME_BYTES} bytes",
                )
            )

    def _idle(self) -> None:
        """Between frames: unclaimed descriptors or a torn length prefix are violations."""
        if self._fds and not self._buffer:
            self._fail(
                ProtocolError(
                    ErrorCode.BAD_FRAME,
                    f"{len(self._fds)} file descriptors arrived that no frame declared",
                )
            )
        if self._eof:
            if self._buffer:
                self._fail(ProtocolError(ErrorCode.BAD_FRAME, "stream ended inside a frame"))
            raise EOFError("peer closed the connection")
        return None

    def _decode(self, payload: bytes) -> Frame:
        try:
            # unpackb bounds every container and string by the payload length, so a small
            # frame cannot ask for a huge allocation; ext types are refused outright.
            hooks = _Budget().hooks() if len(payload) > _COUNTED_ABOVE else {}
            kept = KEPT_PACKED.get(_first_op(payload[:64]) or "") if hooks else None
            if kept is not None:
                message = _unpack_keeping(payload, kept, hooks)
            else:
                message = msgpack.unpackb(
                    payload,
                    raw=False,
                    strict_map_key=True,
                    ext_hook=_refuse_ext,
                    use_list=True,
                    **hooks,
                )
        except _OverBudget:
            self._fail(
                ProtocolError(
                    ErrorCode.FRAME_TOO_LARGE,
                    f"frame of {len(payload)} bytes decodes to more than "
                    f"{MAX_DECODED_CONTAINERS} maps and lists",
                )
            )
        except Exception as exc:  # msgpack raises several unrelated types
            self._fail(ProtocolError(ErrorCode.BAD_FRAME, f"undecodable frame: {exc}"))
        if not isinstance(message, dict):
            self._fail(ProtocolError(ErrorCode.BAD_FRAME, "a frame must be a msgpack map"))
        request_id = message.pop("id", None)
        op = message.pop("op", None)
        nfds = message.pop("nfds", 0)
        if not isinstance(request_id, int) or isinstance(request_id, bool) or request_id < 0:
            self._fail(ProtocolError(ErrorCode.BAD_FRAME, "frame lacks a non-negative int id"))
        if not isinstance(nfds, int) or isinstance(nfds, bool) or not 0 <= nfds <= 253:
            self._fail(ProtocolError(ErrorCode.BAD_FRAME, "nfds must be an int in 0..253"))
        if len(self._fds) < nfds:
            self._fail(
                ProtocolError(
                    ErrorCode.BAD_FRAME,
                    f"frame declares {nfds} file descriptors but {len(self._fds)} arrived",
                    request_id,
                )
            )
        fds = tuple(self._fds.popleft() for _ in range(nfds))
        try:
            self._check(op, message, request_id)
        except ProtocolError as exc:
            self._close_all(fds)
            self._fail(exc)
        return Frame(op, request_id, message, fds, len(payload))

    def _check(self, op: object, body: dict[str, Any], request_id: int) -> None:
        if not isinstance(op, str) or op not in self._peer_ops:
            raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown operation {op!r}", request_id)
        handshake = _HANDSHAKE[Role.CLIENT if self.role is Role.DAEMON else Role.DAEMON]
        if op == handshake:
            if self._peer_greeted:
                raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"second {op}", request_id)
            if body.get("version") != PROTOCOL_VERSION and isinstance(body.get("version"), int):
                raise ProtocolError(
                    ErrorCode.UNSUPPORTED_VERSION,
                    f"protocol version {body['version']} is not supported; this side speaks "
                    f"version {PROTOCOL_VERSION} — upgrade the older of client and daemon",
                    request_id,
                )
        elif not self._peer_greeted and op != "error":
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"{op} before {handshake}", request_id)
        schema = self._peer_ops[op]
        optional = _OPTIONAL.get(op, frozenset())
        for name, types in schema.items():
            if name not in body:
                if name in optional:
                    continue
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"{op} lacks field {name!r}", request_id)
            value = body[name]
            if types is not _ANY and (
                not isinstance(value, types) or (isinstance(value, bool) and bool not in types)
            ):
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST,
                    f"{op}.{name} must be {'/'.join(t.__name__ for t in types)}, "
                    f"not {type(value).__name__}",
                    request_id,
                )
        unknown = set(body) - set(schema)
        if unknown:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"{op} has unknown fields {sorted(unknown)}", request_id
            )
        if op == handshake:
            self._peer_greeted = True

    def _fail(self, error: ProtocolError) -> None:
        self.dead = error
        self._close_all(self._fds)
        self._fds.clear()
        self._buffer.clear()
        raise error

    def _close_all(self, fds: Iterable[int]) -> None:
        for fd in fds:
            with contextlib.suppress(OSError):
                self._close_fd(fd)

    def close(self) -> None:
        """Drop buffered bytes and close descriptors nobody claimed."""
        self._close_all(self._fds)
        self._fds.clear()
        self._buffer.clear()

    # -- sending -----------------------------------------------------------------

    def send(
        self,
        op: str,
        request_id: int,
        body: dict[str, Any],
        nfds: int = 0,
        *,
        prepacked: Mapping[str, bytes] | None = None,
    ) -> bytes:
        """Bytes for one frame we send; the caller passes ``nfds`` descriptors with them."""
        ours = _DAEMON_OPS if self.role is Role.DAEMON else _CLIENT_OPS
        if op not in ours:
            raise ValueError(f"{self.role.value} cannot send {op!r}")
        handshake = _HANDSHAKE[self.role]
        if op == handshake:
            self._we_greeted = True
        elif not self._we_greeted and op != "error":
            raise ValueError(f"{op} before {handshake}")
        return encode_frame(
            op, request_id, body, nfds, max_bytes=self.max_frame_bytes, prepacked=prepacked
        )

    def error_frame(
        self, code: ErrorCode, message: str, request_id: int = 0, *, fatal: bool = False
    ) -> bytes:
        return self.send(
            "error", request_id, {"code": str(code), "message": message, "fatal": fatal}
        )


def _first_op(head: bytes) -> str | None:
    """The op of a frame whose first map entry is ``"op"`` (as every client sends it)."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(head) or 1)
    unpacker.feed(head)
    try:
        unpacker.read_map_header()
        if unpacker.unpack() != "op":
            return None
        op = unpacker.unpack()
    except Exception:  # truncated or not a map: not a frame we would decode
        return None
    return op if isinstance(op, str) else None


def _unpack_keeping(payload: bytes, kept: str, hooks: dict[str, Any]) -> dict[str, Any]:
    """A frame's map decoded but for field ``kept``, whose bytes are only skipped over
    (in C, building nothing) and kept as ``Packed``."""
    unpacker = msgpack.Unpacker(
        raw=False,
        strict_map_key=True,
        ext_hook=_refuse_ext,
        use_list=True,
        max_buffer_size=len(payload),
        **hooks,
    )
    unpacker.feed(payload)
    message: dict[str, Any] = {}
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        if key == kept:
            start = unpacker.tell()
            unpacker.skip()
            message[key] = Packed(payload[start : unpacker.tell()])
        else:
            message[key] = unpacker.unpack()
    if unpacker.tell() != len(payload):
        raise ValueError("extra data after the frame's map")
    return message


class _OverBudget(Exception):
    pass


class _Budget:
    """Counts the maps and lists one decode builds; stops it past the limit."""

    def __init__(self) -> None:
        self.left = MAX_DECODED_CONTAINERS

    def _count(self, container: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise _OverBudget
        return container

    def hooks(self) -> dict[str, Any]:
        # object_hook, not object_pairs_hook: the decoder builds the dict itself, which
        # takes a third less of the event loop's time on a frame of a million tiny maps
        return {"object_hook": self._count, "list_hook": self._count}


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not part of the protocol")


def chunk_fds(fds: Sequence[int]) -> list[Sequence[int]]:
    """Split descriptors into groups the kernel will pass in one sendmsg."""
    return [fds[i : i + MAX_FDS_PER_FRAME] for i in range(0, len(fds), MAX_FDS_PER_FRAME)]
