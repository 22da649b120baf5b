"""Retained memory between real users: what another user's checkpoint in memory may be
written by while it is read, and who pays for memory kept for a restart (issue 32, items
5 and 7; the rules are in ``shmstage_daemon.retention``).

The attacks are the issue's own, at a smaller scale: the owner of a checkpoint that a
reader of its restore group leases rewrites the leased bytes keeping their CRC-32C (CRC is
affine: flipping bits whose contributions cancel leaves it unchanged), and a user holds
retained memory against the budget, the TTL and everyone's registrations by leasing it.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness import wait_for
from sec_helpers import GROUP, Actor, User, run_as

from shmstage.control import ControlClient

#: What the programs below share: a raw protocol session, a lease by path as ``load``
#: takes it, and a change of a buffer that keeps its CRC-32C.
RAW = """
        import crc32c
        from shmstage.layout import Layout, TensorSpec
        from shmstage.manifest import digest as manifest_digest
        ids = iter(range(1, 1 << 30))
        def session(path):
            s = socket.socket(socket.AF_UNIX); s.settimeout(30); s.connect(path)
            conn = Connection(Role.CLIENT)
            s.sendall(conn.send("hello", next(ids), {"version": protocol.PROTOCOL_VERSION,
                                                     "client": "x", "pid": os.getpid()}))
            frame(s, conn)
            return s, conn
        def frame(s, conn):
            while (f := conn.next_frame()) is None:
                data, fds, _, _ = socket.recv_fds(s, 1 << 20, 253)
                conn.receive_data(data, fds)
            return f
        def answer(s, conn, op, body, fds=()):
            socket.send_fds(s, [conn.send(op, next(ids), body, len(fds))], list(fds))
            reply = frame(s, conn)
            got = []
            while reply.op in ("leased", "registered") and len(got) < reply.body["segments"]:
                got += frame(s, conn).fds
            return reply, got
        def lease(s, conn, ckpt):
            fd = os.open(ckpt + "/model.safetensors", os.O_RDONLY)
            digest = manifest_digest(open(ckpt + "/shmstage-manifest.json", "rb").read())
            try:
                return answer(s, conn, "lease", {"digest": digest}, [fd])
            finally:
                os.close(fd)
        def file_tensor(ckpt):
            data = open(ckpt + "/model.safetensors", "rb").read()
            n = int.from_bytes(data[:8], "little")
            begin, end = json.loads(data[8 : 8 + n])["w"]["data_offsets"]
            return data[8 + n + begin : 8 + n + end]
        def keep_crc(buf):
            '''Flip bits of buf's first 8 bytes whose CRC-32C contributions cancel.'''
            zero, basis = crc32c.crc32c(bytes(len(buf))), {}
            for bit in range(64):
                d = bytearray(len(buf)); d[bit // 8] = 1 << (bit % 8)
                image, combo = crc32c.crc32c(bytes(d)) ^ zero, 1 << bit
                while image and (image.bit_length() - 1) in basis:
                    other, other_combo = basis[image.bit_length() - 1]
                    image, combo = image ^ other, combo ^ other_combo
                if not image:
                    break
                basis[image.bit_length() - 1] = (image, combo)
            before = crc32c.crc32c(bytes(buf))
            for bit in range(64):
                if combo >> bit & 1:
                    buf[bit // 8] ^= 1 << (bit % 8)
            assert crc32c.crc32c(bytes(buf)) == before
"""
W = "torch.arange(1024, dtype=torch.float32)"


def restore_group_daemon(shared_daemon, toml: str = ""):
    return shared_daemon(toml=f'restore_groups = ["{GROUP}"]\n{toml}')


def readable_home(arena: Path, user: User) -> str:
    """The owner's checkpoint root, readable by its restore group (as a shared run's is)."""
    (arena / user.name).chmod(0o755)
    return str(arena / user.name)


def test_a_leased_slot_is_not_adopted_writable_by_its_owner(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    """The reader leases the owner's retained checkpoint; the owner registers the same
    structure again. It gets fresh segments, not writable descriptors to what the reader
    reads, so the reader's bytes stay the files' bytes."""
    daemon = restore_group_daemon(shared_daemon)
    ckpt = readable_home(arena, attacker) + "/c"
    run_as(
        attacker,
        f"""
        stager = Stager("{daemon.socket}", slots=1)
        stager.save({{"w": {W}}}, "{ckpt}").wait(60)
        stager.close(retain=True)  # as a trainer that dies does
        """,
    )
    go = arena / "go"
    reader = Actor(
        victim,
        RAW
        + f"""
        s, conn = session("{daemon.socket}")
        reply, fds = lease(s, conn, "{ckpt}")
        assert reply.op == "leased", reply.body
        say("LEASED", json.dumps([os.fstat(fd).st_ino for fd in fds]))
        while not os.path.exists("{go}"):
            time.sleep(0.02)
        leased = mmap.mmap(fds[0], 4096, prot=mmap.PROT_READ)[:4096]
        expected = file_tensor("{ckpt}")
        say("READ", json.dumps({{"same": leased == expected,
                                 "crc_ok": crc32c.crc32c(leased) == crc32c.crc32c(expected)}}))
        """,
    )
    leased = set(json.loads(reader.wait_line("LEASED").split(" ", 1)[1]))
    out = run_as(
        attacker,
        RAW
        + f"""
        s, conn = session("{daemon.socket}")
        layout = Layout((TensorSpec("w", "F32", (1024,)),))
        reply, fds = answer(s, conn, "register", {{"tensors": layout.to_wire(), "slots": 1}})
        assert reply.op == "registered", reply.body
        for fd in fds:  # rewrite whatever it may write, keeping each tensor's CRC
            mapped = mmap.mmap(fd, 4096)
            buf = bytearray(mapped[:4096]); keep_crc(buf); mapped[:4096] = bytes(buf)
        say("GOT", json.dumps({{"adopted": reply.body["adopted"],
                                "inodes": [os.fstat(fd).st_ino for fd in fds]}}))
        """,
    )
    got = json.loads(out.split("GOT ", 1)[1])
    go.touch()
    read = json.loads(reader.wait_line("READ").split(" ", 1)[1])
    reader.finish()
    assert got["adopted"] == 0 and not leased & set(got["inodes"]), (got, leased)
    assert read == {"same": True, "crc_ok": True}


def test_another_users_checkpoint_is_not_read_from_memory_while_its_owner_can_write_it(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    """The owner's connection is gone (the layout is retained) but its process keeps the
    slot mapped writable and rewrites it keeping the CRC. A reader of its restore group
    gets the files' bytes, never source=memory verified=True bytes that differ from them."""
    daemon = restore_group_daemon(shared_daemon)
    ckpt = readable_home(arena, attacker) + "/c"
    owner = Actor(
        attacker,
        RAW
        + f"""
        stager = Stager("{daemon.socket}", slots=1)
        stager.save({{"w": {W}}}, "{ckpt}").wait(60)
        view = stager._layouts.current.slots[0][0]  # the slot's writable mapping, kept
        buf = bytearray(view.numpy().tobytes()); keep_crc(buf)
        view.copy_(torch.frombuffer(buf, dtype=torch.float32))
        stager._connection._sock.shutdown(socket.SHUT_RDWR)  # the daemon sees it go
        say("READY")
        time.sleep(120)
        """,
    )
    try:
        owner.wait_line("READY")
        daemon.wait_log("retained layout")
        out = run_as(
            victim,
            f"""
            r = load("{ckpt}", with_info=True, socket="{daemon.socket}")
            files = load("{ckpt}", source="files")
            same = torch.equal(r.state["w"].view(torch.int32), files["w"].view(torch.int32))
            say(json.dumps({{"source": r.source, "verified": r.verified, "same": same,
                             "reason": r.reason}}))
            """,
        )
    finally:
        owner.kill()
    result = json.loads(out)
    assert result["same"], result
    assert result["source"] == "files" and "open for writing" in result["reason"], result


def test_a_user_cannot_hold_retained_memory_past_its_limits_by_leasing_it(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    """The issue's 440 MiB held past a 30 s TTL against a 128 MiB budget and a 96 MiB
    max_bytes, at a twelfth: 12 MiB layouts retained one after another by a user that
    leases each (and re-leases them) so that nothing gives them back. Its own max_bytes
    counts what it retains, a lease lives at most the grace once its memory is due, and
    the victim's registration finds room."""
    daemon = shared_daemon(
        toml='[limits]\nshm_budget = "64MiB"\nmax_bytes = "12MiB"\n'
        '[retention]\nttl = 2\nbudget = "16MiB"\nrevoke_grace = 1\nlease_seconds = 4\n'
        "max_lease_seconds = 4\n"
    )
    home = str(arena / attacker.name)
    hoarder = Actor(
        attacker,
        RAW
        + f"""
        kept, outcomes = {{}}, set()
        def hold(i):
            # lease checkpoint i on a new connection, then let the previous lease go
            s, conn = session("{daemon.socket}")
            reply, fds = lease(s, conn, "{home}/c" + str(i))
            for fd in fds:
                os.close(fd)
            outcome = reply.op if reply.op == "leased" else reply.body["code"]
            outcomes.add(outcome)
            if i in kept:
                kept[i].close()
            kept[i] = s
            return outcome
        for i in range(5):
            stager = Stager("{daemon.socket}", slots=1)
            state = {{f"w{{i}}": torch.full((3 << 20,), float(i))}}
            stager.save(state, "{home}/c" + str(i)).wait(60)
            hold(i)
            stager.close(retain=True)
        say("HOARDED")
        end = time.monotonic() + 8
        while time.monotonic() < end:  # re-lease before anything can run out, until all
            if all([hold(i) == "not_retained" for i in range(5)]):  # are given back
                break
            time.sleep(0.5)
        say("OUTCOMES", json.dumps(sorted(outcomes)))
        """,
    )
    try:
        hoarder.wait_line("HOARDED", timeout=120)
        with ControlClient(daemon.socket) as control:
            memory = control.status()["memory"]
        assert memory["retained_bytes"] <= 12 << 20, memory  # 60 MiB before
        out = run_as(
            victim,
            f"""
            with Stager("{daemon.socket}", slots=1) as stager:
                stager.save({{"w": torch.ones(3 << 20)}}, "{arena}/{victim.name}/c").wait(60)
            say("SAVED")
            """,
        )
        assert "SAVED" in out  # shm_exhausted before: 60 of 64 MiB were leased

        def attackers() -> list[dict]:
            with ControlClient(daemon.socket) as control:
                checkpoints = control.status()["memory"]["checkpoints"]
            return [c for c in checkpoints if c["uid"] == attacker.uid and c["retained"]]

        # Within the ttl, the grace and a sweep, re-leased all along; then some.
        wait_for(lambda: not attackers(), 2 + 1 + 1.5 + 5, "the attacker's retained layouts to go")
        outcomes = json.loads(hoarder.wait_line("OUTCOMES", timeout=30).split(" ", 1)[1])
        assert "not_retained" in outcomes
    finally:
        hoarder.kill()


def test_a_bigger_newer_retention_does_not_evict_another_users_checkpoint(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    """Retained memory over the budget is given back from the user retaining the most:
    the victim's small checkpoint stays in memory for its restart."""
    daemon = shared_daemon(toml='[retention]\nbudget = "16MiB"\n')
    for user, numel in ((victim, 1 << 20), (attacker, 7 << 19)):  # 4 MiB, then 14 MiB
        run_as(
            user,
            f"""
            stager = Stager("{daemon.socket}", slots=1)
            stager.save({{"w": torch.ones({numel})}}, "{arena}/{user.name}/c").wait(60)
            stager.close(retain=True)
            """,
        )
    out = run_as(
        victim,
        f"""
        r = latest(socket="{daemon.socket}")
        say(r.source, bool(torch.equal(r.state["w"], torch.ones(1 << 20))))
        """,
    )
    assert "memory True" in out, out
    assert f"retained layout 2 of uid {attacker.uid} given back (budget)" in daemon.log()
