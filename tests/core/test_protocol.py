"""The wire protocol, without sockets: bytes and descriptors in, frames and errors out."""

from __future__ import annotations

import os
import struct

import msgpack
import pytest

from shmstage.protocol import (
    FD_OPS,
    MAX_DECODED_CONTAINERS,
    MAX_FDS_PER_FRAME,
    PROTOCOL_VERSION,
    REPORT_PARTS,
    SMALL_FRAME_BYTES,
    Connection,
    ErrorCode,
    Packed,
    ProtocolError,
    Role,
    chunk_fds,
    decode_packed,
    encode_frame,
    pack_map,
)

HELLO = {"version": PROTOCOL_VERSION, "client": "test", "pid": 1}


def raw(message: object) -> bytes:
    payload = msgpack.packb(message)
    return struct.pack(">I", len(payload)) + payload


def greeted_daemon_side() -> tuple[Connection, Connection]:
    client, daemon = Connection(Role.CLIENT), Connection(Role.DAEMON)
    daemon.receive_data(client.send("hello", 1, HELLO))
    assert daemon.next_frame().op == "hello"
    return client, daemon


def test_a_frame_round_trips_across_arbitrary_chunking() -> None:
    client, daemon = Connection(Role.CLIENT), Connection(Role.DAEMON)
    data = client.send("hello", 7, HELLO) + client.send(
        "register", 8, {"tensors": [["w", "F32", [2], None]], "slots": 2}
    )
    frames = []
    for i in range(len(data)):  # one byte at a time
        daemon.receive_data(data[i : i + 1])
        while (frame := daemon.next_frame()) is not None:
            frames.append(frame)
    assert [(f.op, f.id) for f in frames] == [("hello", 7), ("register", 8)]
    assert frames[1].body == {"tensors": [["w", "F32", [2], None]], "slots": 2}


def test_needs_more_data_returns_none() -> None:
    daemon = Connection(Role.DAEMON)
    daemon.receive_data(Connection(Role.CLIENT).send("hello", 1, HELLO)[:5])
    assert daemon.next_frame() is None


def test_clean_eof_between_frames_raises_eoferror() -> None:
    _, daemon = greeted_daemon_side()
    daemon.receive_data(b"")
    with pytest.raises(EOFError):
        daemon.next_frame()


def test_eof_inside_a_frame_is_a_protocol_error() -> None:
    daemon = Connection(Role.DAEMON)
    daemon.receive_data(Connection(Role.CLIENT).send("hello", 1, HELLO)[:-1])
    daemon.receive_data(b"")
    with pytest.raises(ProtocolError) as info:
        daemon.next_frame()
    assert info.value.code is ErrorCode.BAD_FRAME


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"\x00\x00\x00\x03\xc1\xc1\xc1", ErrorCode.BAD_FRAME),  # 0xc1 is never valid msgpack
        (raw([1, 2, 3]), ErrorCode.BAD_FRAME),
        (raw({"op": "hello", "version": 1, "client": "x", "pid": 1}), ErrorCode.BAD_FRAME),
        (raw({"op": "fly", "id": 1}), ErrorCode.UNKNOWN_OP),
        (raw({"op": "register", "id": 1, "tensors": [], "slots": 1}), ErrorCode.OUT_OF_ORDER),
        (
            raw({"op": "hello", "id": 1, "version": 99, "client": "x", "pid": 1}),
            ErrorCode.UNSUPPORTED_VERSION,
        ),
        (raw({"op": "hello", "id": 1, "version": 2, "client": 5, "pid": 1}), ErrorCode.BAD_REQUEST),
        (
            raw({"op": "hello", "id": 1, "version": 2, "client": "x", "pid": 1, "evil": 1}),
            ErrorCode.BAD_REQUEST,
        ),
        (b"\x00\x00\x00\x00", ErrorCode.BAD_FRAME),
        (struct.pack(">I", 1 << 31), ErrorCode.FRAME_TOO_LARGE),
        (b"\x00\x00\x00\x05\xd4\x01\x02\x00\x00", ErrorCode.BAD_FRAME),  # ext type
    ],
    ids=[
        "garbage",
        "not-a-map",
        "no-id",
        "unknown-op",
        "before-hello",
        "version",
        "wrong-type",
        "unknown-field",
        "empty",
        "oversized",
        "ext-type",
    ],
)
def test_malformed_input_kills_the_connection_with_a_typed_error(
    data: bytes, code: ErrorCode
) -> None:
    daemon = Connection(Role.DAEMON)
    daemon.receive_data(data)
    with pytest.raises(ProtocolError) as info:
        daemon.next_frame()
    assert info.value.code is code
    with pytest.raises(ProtocolError):  # dead for good: a byte stream cannot resync
        daemon.next_frame()


def test_an_oversized_length_is_refused_before_the_payload_arrives() -> None:
    daemon = Connection(Role.DAEMON, max_frame_bytes=1024)
    daemon.receive_data(struct.pack(">I", 1025))
    with pytest.raises(ProtocolError) as info:
        daemon.next_frame()
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE


def test_only_register_commit_and_publish_may_be_large_known_before_they_arrive() -> None:
    """A 31 MiB "hello" is refused from its first 64 bytes: nothing is buffered or decoded."""
    daemon = Connection(Role.DAEMON)
    head = msgpack.packb({"op": "hello", "id": 1, "nfds": 0, "client": "x" * 100})
    daemon.receive_data(struct.pack(">I", 31 << 20) + head)
    with pytest.raises(ProtocolError, match="only commit, publish, register may exceed") as info:
        daemon.next_frame()
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE
    _client, greeted = greeted_daemon_side()
    body = {"op": "status", "id": 2, "nfds": 0, "pad": "y" * (SMALL_FRAME_BYTES + 1)}
    greeted.receive_data(raw(body))
    with pytest.raises(ProtocolError, match="a status frame of"):
        greeted.next_frame()


def test_a_large_register_is_accepted() -> None:
    client, daemon = greeted_daemon_side()
    tensors = [[f"layer.{i}.weight", "BF16", [1024, 1024], None] for i in range(20_000)]
    daemon.receive_data(client.send("register", 2, {"tensors": tensors, "slots": 2}))
    frame = daemon.next_frame()
    assert frame.op == "register" and len(frame.body["tensors"]) == 20_000


def test_a_frame_of_tiny_maps_is_stopped_at_its_decoding_budget() -> None:
    """Two bytes per empty map would decode to 30-60x their size; the count stops it, in a
    frame as in a commit's tree, which the frame keeps packed until it is decoded."""
    _client, daemon = greeted_daemon_side()
    count = MAX_DECODED_CONTAINERS + 10
    tiny = b"\xdd" + struct.pack(">I", count) + b"\x80" * count  # an array32 of empty maps
    head = msgpack.packb({"op": "register", "id": 2, "nfds": 0})  # a fixmap of 3 entries...
    payload = b"\x84" + head[1:] + msgpack.packb("tensors") + tiny  # ...made one of 4
    daemon.receive_data(struct.pack(">I", len(payload)) + payload)
    with pytest.raises(ProtocolError, match="decodes to more than") as info:
        daemon.next_frame()
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE
    with pytest.raises(ProtocolError, match="decode to more than") as info:
        decode_packed(tiny)
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE


def test_a_packed_field_no_larger_than_the_budget_decodes_uncounted_and_whole() -> None:
    """A field of at most ``MAX_DECODED_CONTAINERS`` bytes holds fewer containers than that
    (each takes a byte at least), so it is decoded without counting them: the most it can
    hold, empty maps in one array, all come back."""
    count = MAX_DECODED_CONTAINERS - 5
    tiny = b"\xdd" + struct.pack(">I", count) + b"\x80" * count
    assert len(tiny) == MAX_DECODED_CONTAINERS
    decoded = decode_packed(tiny)
    assert len(decoded) == count and decoded[0] == decoded[-1] == {}
    with pytest.raises(ProtocolError, match="undecodable"):
        decode_packed(tiny[:-1])  # one map short: malformed, whether counted or not


def test_a_large_commit_keeps_its_tree_packed_for_the_daemon_to_decode_once() -> None:
    """A commit's tree of 20,000 tensors is skipped over, not decoded, with the frame: the
    daemon decodes and checks it once per layout and tree (``requests.commit_tree``)."""
    client, daemon = greeted_daemon_side()
    tree = {"d": [[f"layer{i}", {"T": f"layer{i}"}] for i in range(20_000)]}
    body = {
        "layout": 1,
        "slot": 0,
        "data_file": "model.safetensors",
        "data_tmp": "t",
        "manifest_tmp": "m",
        "metadata": {"step": 3},
    }
    packed = msgpack.packb(tree, use_bin_type=True)
    daemon.receive_data(client.send("commit", 2, body, prepacked={"tree": packed}))
    frame = daemon.next_frame()
    assert isinstance(frame.body["tree"], Packed) and frame.body["tree"] == packed
    assert decode_packed(frame.body["tree"]) == tree
    assert {k: v for k, v in frame.body.items() if k != "tree"} == body


def test_a_daemon_holds_few_descriptors_ahead_of_their_frame() -> None:
    """Only commit carries descriptors (at most 4): a flood of them is refused and closed."""
    _client, daemon = greeted_daemon_side()
    pipes = [os.pipe() for _ in range(5)]
    fds = [fd for pair in pipes for fd in pair]
    with pytest.raises(ProtocolError, match="file descriptors queued"):
        daemon.receive_data(b"\x00", fds)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_second_hello_is_out_of_order() -> None:
    _client, daemon = greeted_daemon_side()
    daemon.receive_data(raw({"op": "hello", "id": 2, **HELLO}))
    with pytest.raises(ProtocolError) as info:
        daemon.next_frame()
    assert info.value.code is ErrorCode.OUT_OF_ORDER


def test_deep_nesting_is_refused_not_a_crash() -> None:
    _client, daemon = greeted_daemon_side()
    nested: object = []
    for _ in range(5000):
        nested = [nested]
    payload = b"\x91" * 5000 + b"\x90"  # 5000 nested one-element arrays, built by hand
    daemon.receive_data(struct.pack(">I", len(payload)) + payload)
    with pytest.raises(ProtocolError):
        daemon.next_frame()


def test_descriptors_are_handed_to_the_frame_that_declares_them() -> None:
    client, daemon = greeted_daemon_side()
    r, w = os.pipe()
    daemon.receive_data(
        client.send(
            "commit",
            3,
            {
                "layout": 1,
                "slot": 0,
                "data_file": "a.safetensors",
                "data_tmp": "t",
                "manifest_tmp": "m",
                "tree": None,
                "metadata": {},
                "file_metadata": {},
            },
            nfds=2,
        ),
        [r, w],
    )
    frame = daemon.next_frame()
    assert frame.fds == (r, w)
    for fd in frame.fds:
        os.close(fd)


def test_undeclared_descriptors_are_closed_and_refused() -> None:
    client, daemon = greeted_daemon_side()
    r, w = os.pipe()
    daemon.receive_data(client.send("status", 2, {}), [r])
    assert daemon.next_frame().op == "status"
    with pytest.raises(ProtocolError, match="no frame declared"):
        daemon.next_frame()
    with pytest.raises(OSError):
        os.fstat(r)  # closed by the connection, not leaked
    os.close(w)


def test_missing_descriptors_are_refused() -> None:
    client, daemon = greeted_daemon_side()
    daemon.receive_data(client.send("status", 2, {}, nfds=1))
    with pytest.raises(ProtocolError, match="declares 1 file descriptors but 0"):
        daemon.next_frame()


def test_daemon_cannot_send_client_ops_and_nothing_precedes_the_greeting() -> None:
    daemon = Connection(Role.DAEMON)
    with pytest.raises(ValueError):
        daemon.send("hello", 1, HELLO)
    with pytest.raises(ValueError):
        daemon.send("status", 1, {"status": {}})
    assert daemon.error_frame(ErrorCode.NOT_ALLOWED, "no")  # errors may precede a greeting


def test_encoder_refuses_what_the_peer_would_refuse() -> None:
    with pytest.raises(ValueError):
        encode_frame("status", 1, {"blob": b"x" * 2000}, max_bytes=1000)
    with pytest.raises(ValueError):
        encode_frame("status", 1, {}, nfds=MAX_FDS_PER_FRAME + 1, max_bytes=1000)


def test_fds_are_chunked_to_the_kernel_limit() -> None:
    chunks = chunk_fds(list(range(600)))
    assert [len(c) for c in chunks] == [253, 253, 94]


def test_client_side_checks_daemon_frames() -> None:
    client = Connection(Role.CLIENT)
    client.send("hello", 1, HELLO)
    daemon = Connection(Role.DAEMON)
    client.receive_data(
        daemon.send(
            "welcome",
            1,
            {"version": PROTOCOL_VERSION, "daemon": "d", "instance": "i", "limits": {}},
        )
    )
    assert client.next_frame().op == "welcome"
    client.receive_data(raw({"op": "register", "id": 2, "tensors": [], "slots": 1}))
    with pytest.raises(ProtocolError) as info:
        client.next_frame()
    assert info.value.code is ErrorCode.UNKNOWN_OP


def test_prepacked_fields_encode_exactly_as_packing_them_here() -> None:
    """A commit's tree is packed once while the state dict is checked, then spliced in."""
    body = {"layout": 1, "slot": 0, "data_file": "model.safetensors"}
    tree = {"d": [["w", {"T": "w"}], ["step", 2**64 - 1]]}
    spliced = encode_frame(
        "commit", 5, body, 3, max_bytes=1 << 20, prepacked={"tree": msgpack.packb(tree)}
    )
    assert spliced == encode_frame("commit", 5, {**body, "tree": tree}, 3, max_bytes=1 << 20)
    # A prepacked value for a key that is already there replaces it in place.
    assert pack_map({"a": 1, "b": 2}, {"a": msgpack.packb("x")}) == msgpack.packb(
        {"a": "x", "b": 2}
    )
    with pytest.raises(ValueError, match="frame limit"):
        encode_frame("commit", 5, body, max_bytes=64, prepacked={"tree": b"\xc0" * 100})


def test_report_is_a_client_op_with_optional_parts() -> None:
    client, daemon = greeted_daemon_side()
    daemon.receive_data(client.send("report", 2, {"job": 4, "stall_seconds": 0.25}))
    assert daemon.next_frame().body == {"job": 4, "stall_seconds": 0.25}
    parts = {name: 0.01 for name in REPORT_PARTS}
    daemon.receive_data(client.send("report", 3, {"job": 4, "stall_seconds": 1, **parts}))
    assert daemon.next_frame().body["copy_seconds"] == 0.01
    daemon.receive_data(client.send("report", 4, {"job": 4}))  # the stall is the point
    with pytest.raises(ProtocolError, match="lacks field 'stall_seconds'"):
        daemon.next_frame()


def test_register_may_say_how_many_descriptors_the_client_takes_per_message() -> None:
    client, daemon = greeted_daemon_side()
    body = {"tensors": [["w", "F32", [2], None]], "max_fds": 100}
    daemon.receive_data(client.send("register", 2, body))
    assert daemon.next_frame().body["max_fds"] == 100
    daemon.receive_data(client.send("register", 3, {**body, "max_fds": "many"}))
    with pytest.raises(ProtocolError, match=r"register\.max_fds must be int"):
        daemon.next_frame()


def test_a_commit_may_name_a_pending_directory_and_its_final_name() -> None:
    client, daemon = greeted_daemon_side()
    body = {
        "layout": 1,
        "slot": 0,
        "data_file": "model.safetensors",
        "data_tmp": ".model.safetensors.0123456789abcdef.shmstage-tmp",
        "manifest_tmp": ".shmstage-manifest.json.0123456789abcdef.shmstage-tmp",
        "pending_dir": ".shmstage-pending.0123456789abcdef",
        "final_dir": "step-100",
        "tree": None,
    }
    daemon.receive_data(client.send("commit", 2, body))
    assert daemon.next_frame().body["final_dir"] == "step-100"


def test_a_lease_names_a_checkpoint_by_digest_and_brings_its_data_file() -> None:
    client, daemon = greeted_daemon_side()
    r, w = os.pipe()
    daemon.receive_data(client.send("lease", 2, {"digest": "ab" * 32}, nfds=1), [r])
    frame = daemon.next_frame()
    assert (frame.op, frame.body, frame.fds) == ("lease", {"digest": "ab" * 32}, (r,))
    daemon.receive_data(client.send("lease", 3, {"digest": "cd", "seconds": 5, "max_fds": 8}))
    assert daemon.next_frame().body == {"digest": "cd", "seconds": 5, "max_fds": 8}
    daemon.receive_data(client.send("lease", 4, {"seconds": 5}))
    with pytest.raises(ProtocolError, match="lacks field 'digest'"):
        daemon.next_frame()
    os.close(r)
    os.close(w)


def test_latest_renew_unlease_and_restored_are_client_ops() -> None:
    client, daemon = greeted_daemon_side()
    for op, body in [
        ("latest", {}),
        ("latest", {"structure": "ff" * 32, "seconds": 1.5, "max_fds": 253}),
        ("renew", {"lease": 3}),
        ("renew", {"lease": 3, "seconds": 10}),
        ("unlease", {"lease": 3}),
        ("restored", {"source": "memory", "seconds": 0.1, "bytes": 4096}),
    ]:
        daemon.receive_data(client.send(op, 2, body))
        frame = daemon.next_frame()
        assert (frame.op, frame.body) == (op, body)
    daemon.receive_data(client.send("unlease", 9, {"lease": "one"}))
    with pytest.raises(ProtocolError, match=r"unlease\.lease must be int"):
        daemon.next_frame()


def test_only_commit_lease_and_latest_carry_descriptors() -> None:
    assert set(FD_OPS) == {"commit", "lease", "latest"}
    assert FD_OPS["lease"] == (1, 1) and FD_OPS["latest"] == (0, 1)


def test_the_daemon_answers_a_lease_with_its_segments_and_the_structure_for_latest() -> None:
    daemon, client = Connection(Role.DAEMON), Connection(Role.CLIENT)
    client.receive_data(daemon.send("welcome", 1, {"version": 2, "daemon": "d", "instance": "i",
                                                   "limits": {}}))
    assert client.next_frame().op == "welcome"
    leased = {
        "lease": 1,
        "seconds": 60.0,
        "job": 7,
        "segments": 2,
        "sizes": [4, 0],
        "durable": False,
        "digest": "",
        "directory": "/ckpt/step-7",
        "data_file": "model.safetensors",
        "acknowledged_unix": 1.5,
    }
    structure = {"tensors": [["w", "F32", [1], None]], "tree": {"T": "w"}, "metadata": {}}
    for body in (leased, {**leased, **structure}):
        client.receive_data(daemon.send("leased", 2, body))
        assert client.next_frame().body == body
    for op, body in [
        ("lease_fds", {"lease": 1, "first": 0}),
        ("renewed", {"lease": 1, "seconds": 30.0}),
        ("unleased", {"lease": 1, "held": False}),
        ("registered", {"layout": 1, "slots": 2, "segments": 2, "adopted": 2}),
        ("acquired", {"layout": 1, "slot": 0, "waited": 0.5, "leased": True}),
    ]:
        client.receive_data(daemon.send(op, 3, body))
        assert client.next_frame().body == body
    assert ErrorCode("not_retained") is ErrorCode.NOT_RETAINED


def test_a_subscription_is_answered_then_continued_by_version_frames_of_its_id() -> None:
    """The one frame the daemon sends unasked carries the subscribe request's id."""
    client, daemon = greeted_daemon_side()
    daemon.receive_data(client.send("subscribe", 5, {"name": "policy"}))
    assert daemon.next_frame().body == {"name": "policy"}
    client.receive_data(daemon.send("welcome", 1, {
        "version": PROTOCOL_VERSION, "daemon": "d", "instance": "i", "limits": {}
    }))  # fmt: skip
    stream = daemon.send("subscribed", 5, {"channel": 1, "newest": None})
    for step in (3, 4):
        stream += daemon.send("version", 5, {"channel": 1, "step": step})
    client.receive_data(stream)
    frames = [client.next_frame() for _ in range(4)]
    assert [(f.op, f.id) for f in frames] == [
        ("welcome", 1), ("subscribed", 5), ("version", 5), ("version", 5)
    ]  # fmt: skip
    assert [f.body["step"] for f in frames[2:]] == [3, 4]


def test_publish_may_be_large_and_its_fields_are_checked() -> None:
    client, daemon = greeted_daemon_side()
    tree = {f"layer.{i}": f"layer.{i}" for i in range(20_000)}
    body = {"layout": 1, "slot": 0, "name": "policy", "step": 7, "tree": tree, "share": []}
    daemon.receive_data(client.send("publish", 2, body))
    assert daemon.next_frame().body["step"] == 7
    _client, daemon = greeted_daemon_side()
    daemon.receive_data(raw({"op": "pin", "id": 3, "nfds": 0, "channel": 1, "newer_than": "7"}))
    with pytest.raises(ProtocolError, match=r"pin\.newer_than must be int/NoneType, not str"):
        daemon.next_frame()


def test_a_held_pin_is_answered_by_its_pin_or_no_newer_and_may_be_unheld() -> None:
    """A reader's "pin" may ask the daemon to hold it (``hold`` seconds) until a version
    newer than ``newer_than`` is visible; "unhold" stops that."""
    client, daemon = greeted_daemon_side()
    held = {"channel": 1, "newer_than": 6, "max_fds": 8, "hold": 2.5}
    daemon.receive_data(client.send("pin", 3, held) + client.send("unhold", 4, {"request": 3}))
    assert [daemon.next_frame().body for _ in range(2)] == [held, {"request": 3}]
    daemon.receive_data(raw({"op": "pin", "id": 5, "nfds": 0, "channel": 1, "hold": "60"}))
    with pytest.raises(ProtocolError, match=r"pin\.hold must be int/float, not str"):
        daemon.next_frame()
    client, daemon = greeted_daemon_side()
    client.receive_data(daemon.send("welcome", 1, {
        "version": PROTOCOL_VERSION, "daemon": "d", "instance": "i",
        "limits": {"max_pin_hold_seconds": 60},
    }))  # fmt: skip
    client.next_frame()
    for op, body in [
        ("no_newer", {"channel": 1, "newest": 6}),
        ("no_newer", {"channel": 1, "newest": None}),
        ("unheld", {"request": 3, "held": True}),
    ]:
        client.receive_data(daemon.send(op, 3, body))
        assert client.next_frame().body == body
    with pytest.raises(ValueError, match="client cannot send 'no_newer'"):
        client.send("no_newer", 1, {"channel": 1, "newest": None})


def test_a_pinned_versions_checksums_are_asked_for_and_answered_null_when_there_are_none() -> None:
    client, daemon = greeted_daemon_side()
    daemon.receive_data(client.send("checksums", 4, {"pin": 3}) + client.send(
        "checksums", 5, {"pin": 3, "seconds": 2.5}
    ))  # fmt: skip
    assert [daemon.next_frame().body for _ in range(2)] == [
        {"pin": 3}, {"pin": 3, "seconds": 2.5}
    ]  # fmt: skip
    daemon.receive_data(raw({"op": "checksums", "id": 6, "nfds": 0, "pin": 3, "seconds": "1"}))
    with pytest.raises(ProtocolError, match=r"checksums\.seconds must be int/float, not str"):
        daemon.next_frame()
    client, daemon = greeted_daemon_side()
    client.receive_data(daemon.send("welcome", 1, {
        "version": PROTOCOL_VERSION, "daemon": "d", "instance": "i", "limits": {}
    }))  # fmt: skip
    client.next_frame()
    for sums in ([0xDEADBEEF, 0], None):
        client.receive_data(daemon.send("checksummed", 4, {"pin": 3, "checksums": sums}))
        assert client.next_frame().body == {"pin": 3, "checksums": sums}


def test_a_client_cannot_send_what_only_the_daemon_sends() -> None:
    client, _daemon = greeted_daemon_side()
    with pytest.raises(ValueError, match="client cannot send 'version'"):
        client.send("version", 1, {"channel": 1, "step": 1})
