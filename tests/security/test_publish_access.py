"""A published channel is its owner's: another real user follows it only once the owner
shares it with a group the daemon's ``[server] publish_groups`` allows, and then only ever
gets read-only descriptors of the publisher's slots, the checksums of no version but one
it pins itself, and no line of the owner's channels in ``shmstage status``.

The victim publishes through a root daemon that admits both users' group and allows
sharing with it; the attacker tries to follow the channel before it is shared (and a
channel that does not exist: the same answer), then follows it once shared, reads the
victim's bytes, and tries to write them through the descriptors the daemon sent it.
"""

from __future__ import annotations

import grp
import json
from pathlib import Path

from sec_helpers import GROUP, Actor, User, run_as

from shmstage.cli import format_status
from shmstage.control import ControlClient

#: The victim's publisher: step 1 unshared; once ``share`` exists, step 2 shared with the
#: trainers' group; a share the daemon does not allow is refused. Lives until killed.
PUBLISHER = """
stager = Stager("{sock}")
stager.reserve({{"w": torch.zeros(8)}})
stager.publish({{"w": torch.full((8,), 1.0)}}, "policy", step=1)
say("PUBLISHED")
try:
    stager.publish({{"w": torch.full((8,), 9.0)}}, "policy", step=5, share=[{own_gid}])
except DaemonRefused as exc:
    say("NOT-ALLOWED", exc)
while not os.path.exists("{flag}"):
    time.sleep(0.05)
stager.publish({{"w": torch.full((8,), 2.0)}}, "policy", step=2, share=["{group}"])
own = subscribe("policy", socket="{sock}").wait(timeout=10)  # the victim's own pin
say("SHARED", own.state(verify=True)["w"].tolist(), own.verified)
say("STATUS", json.dumps(ControlClient("{sock}").status()["channels"]))
time.sleep(3600)
"""

#: What status shows a user of the channels.
STATUS = 'say("STATUS", json.dumps(ControlClient("{sock}").status()["channels"]))'

#: The attacker follows the victim's channel (or one that does not exist).
FOLLOW = """
for name in ("policy", "no-such-channel"):
    try:
        subscriber = subscribe(name, owner={owner}, socket="{sock}")
    except DaemonRefused as exc:
        say("REFUSED", name, exc)
        continue
    with subscriber, subscriber.wait(timeout=10) as version:
        say("READ", name, version.step, version.state()["w"].tolist())
"""

#: The attacker's own protocol client: subscribe, pin, and try to write what it got.
WRITE_THROUGH = """
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect("{sock}")
conn = Connection(Role.CLIENT)
def request(op, rid, body):
    sock.sendall(conn.send(op, rid, body))
def frame():
    while (got := conn.next_frame()) is None:
        data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 253)
        conn.receive_data(data, fds)
    return got
def try_writing(fds, tag):  # is each read-only, and can it be written three ways?
    for fd in fds:
        say(tag + "MODE", fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY)
        for attempt in ("mmap", "write", "truncate"):
            try:
                if attempt == "mmap":
                    mmap.mmap(fd, 8, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                elif attempt == "write":
                    os.pwrite(fd, b"x", 0)
                else:
                    os.ftruncate(fd, 0)
                say(tag + "WROTE", attempt)
            except OSError as exc:
                say(tag + "DENIED", attempt, exc.errno)
request("hello", 1, {{"version": protocol.PROTOCOL_VERSION, "client": "x", "pid": 1}})
frame()
request("subscribe", 2, {{"name": "policy", "owner": {owner}}})
channel = frame().body["channel"]
request("pin", 3, {{"channel": channel, "newer_than": None}})
pinned = frame().body
got = frame()
say("SEGMENTS", got.op, len(got.fds), pinned["step"])
try_writing(got.fds, "")
request("ring", 4, {{"channel": channel}})  # the ring's other slot, ahead of a version
ring = frame().body
say("RING", ring["ring"] == pinned["ring"], len(ring["slots"]), pinned["slot"] in ring["slots"])
got = frame()
say("RING-SEGMENTS", got.op, len(got.fds))
try_writing(got.fds, "RING-")
mine = pinned["pin"]
for pin in range(1, mine + 8):  # every pin id around: only its own answers
    request("checksums", 100 + pin, {{"pin": pin, "seconds": 0}})
    got = frame()
    say("CHECKSUMS", pin == mine, got.op, got.body.get("code"))
"""


#: The attacker, before the victim shares: asks for the ring of every channel id around
#: (only its own channel, which it follows, answers), asks the daemon to hold a pin of
#: each for it until a version comes (only its own channel's is held, and runs out), and
#: offers every layout id around as the ring of its own channel (none of them is its).
RING_PROBE = """
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect("{sock}")
conn = Connection(Role.CLIENT)
def request(op, rid, body):
    sock.sendall(conn.send(op, rid, body))
def frame():
    while (got := conn.next_frame()) is None:
        data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 253)
        conn.receive_data(data, fds)
    return got
request("hello", 1, {{"version": protocol.PROTOCOL_VERSION, "client": "x", "pid": 1}})
frame()
request("subscribe", 2, {{"name": "policy"}})
own = frame().body["channel"]
for channel in range(1, own + 8):
    request("ring", 10 + channel, {{"channel": channel}})
    got = frame()
    say("RING", channel == own, got.op, got.body.get("code"), got.body.get("ring"), len(got.fds))
for channel in range(1, own + 8):
    request("pin", 200 + channel, {{"channel": channel, "newer_than": None, "hold": 0.5}})
    got = frame()
    say("HELD", channel == own, got.op, got.body.get("code"), len(got.fds))
for layout in range(1, 9):
    request("offer", 100 + layout, {{"layout": layout, "name": "policy"}})
    got = frame()
    say("OFFER", got.op, got.body.get("code"))
"""


def test_another_user_follows_a_channel_only_once_shared_and_gets_read_only_descriptors(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    daemon = shared_daemon(toml=f'publish_groups = ["{GROUP}"]\n')
    flag = arena / "share-now"
    publisher = Actor(
        victim,
        PUBLISHER.format(sock=daemon.socket, flag=flag, group=GROUP, own_gid=victim.gid),
    )
    try:
        publisher.wait_line("PUBLISHED")
        refused = publisher.wait_line("NOT-ALLOWED")
        assert f"gid(s) [{victim.gid}]" in refused and "publish_groups" in refused
        before = run_as(attacker, FOLLOW.format(owner=victim.uid, sock=daemon.socket))
        lines = [line for line in before.splitlines() if line.startswith(("REFUSED", "READ"))]
        assert len(lines) == 2 and all(line.startswith("REFUSED") for line in lines), lines
        # a channel that exists and one that does not get the same refusal
        assert lines[0].split(" ", 2)[2] == lines[1].split(" ", 2)[2].replace(
            "'no-such-channel'", "'policy'"
        )
        assert f"uid {attacker.uid} may not follow channel" in lines[0]
        probe = run_as(attacker, RING_PROBE.format(sock=daemon.socket))
        rings = [line.split()[1:] for line in probe.splitlines() if line.startswith("RING")]
        assert ["True", "ring_slots", "None", "None", "0"] in rings, probe
        others = [ring for ring in rings if ring[0] == "False"]
        refused = ["False", "error", "bad_request", "None", "0"]
        assert others and all(ring == refused for ring in others), probe
        # a held pin is checked as a pin is: only its own channel's is held (till it ran out)
        holds = [line.split()[1:] for line in probe.splitlines() if line.startswith("HELD")]
        assert ["True", "no_newer", "None", "0"] in holds, probe
        others = [held for held in holds if held[0] == "False"]
        assert others and all(held == ["False", "error", "bad_request", "0"] for held in others)
        offers = [line for line in probe.splitlines() if line.startswith("OFFER")]
        assert len(offers) == 8 and all(" error " in line for line in offers), probe
        flag.touch()
        shared = publisher.wait_line("SHARED")
        assert "[2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0] True" in shared, shared
        # status lists a channel to its owner (and to root), never to another user
        (own,) = json.loads(publisher.wait_line("STATUS").split(" ", 1)[1])
        assert (own["name"], own["uid"], own["newest_step"], own["pins"]) == (
            "policy", victim.uid, 2, 1
        )  # fmt: skip
        assert own["shared_gids"] == [grp.getgrnam(GROUP).gr_gid] and own["checksummed"]
        seen = json.loads(run_as(attacker, STATUS.format(sock=daemon.socket)).split(" ", 1)[1])
        assert seen == [], seen
        with ControlClient(daemon.socket) as control:
            everyone = control.status()
        assert [c["name"] for c in everyone["channels"]] == ["policy"]
        text = format_status(everyone)
        assert "CHANNELS (1)" in text and "policy" in text, text
        after = run_as(attacker, FOLLOW.format(owner=victim.uid, sock=daemon.socket))
        assert "READ policy 2 [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]" in after, after
        assert "REFUSED no-such-channel" in after
        written = run_as(attacker, WRITE_THROUGH.format(owner=victim.uid, sock=daemon.socket))
        assert "SEGMENTS ring_fds 1 2" in written, written
        assert "MODE True" in written and "WROTE" not in written, written
        assert written.count("DENIED") == 6  # the pinned slot's and the ring's other slot
        assert "RING True 1 False" in written and "RING-SEGMENTS slot_fds 1" in written, written
        assert "RING-MODE True" in written and "RING-WROTE" not in written, written
        assert written.count("RING-DENIED") == 3
        # the daemon's checksums of a version: only of a pin this connection holds
        answers = [line.split()[1:] for line in written.splitlines() if "CHECKSUMS" in line]
        assert ["True", "checksummed", "None"] in answers, written
        others = [answer for answer in answers if answer[0] == "False"]
        assert others and all(answer[1:] == ["error", "bad_request"] for answer in others)
    finally:
        publisher.kill()
    assert "internal error" not in daemon.log()


#: The victim's two ranks (two connections of one process, same uid) publish the halves of
#: ``w`` as the two parts of each step: step 1 part 0 first, part 1 once ``flag`` exists,
#: then step 2 whole, shared with the trainers' group.
SHARDED_PUBLISHER = """
from shmstage_client.save.publish import Part, publish_flat
from shmstage_client.statedict import Flattened
ranks = [Stager("{sock}") for _ in range(2)]
def part(rank, step, share=()):
    shard = {{"w": torch.full((4,), float(10 * step + rank))}}
    flatten = lambda: Flattened.of(shard, {{"w": [4 * rank]}})
    done = publish_flat(ranks[rank], flatten, "policy", step=step, metadata=None, share=share,
                        part=Part(rank, 2, {{"w": [8]}}))
    return done.complete
say("PART0", part(0, 1))
while not os.path.exists("{flag}"):
    time.sleep(0.05)
with subscribe("policy", socket="{sock}") as own:
    try:
        own.wait(timeout=1).close()
        say("SEEN-EARLY")
    except NoNewVersion:
        say("NOTHING-YET")
    say("PART1", part(1, 1))
    with own.wait(timeout=10) as version:
        say("OWN", version.step, version.parts, version.state()["w"].tolist())
say("STEP2", part(0, 2, ["{group}"]), part(1, 2, ["{group}"]))
time.sleep(3600)
"""

#: The attacker adds a part of its own to "policy" (its own channel of that name: the
#: version stays unfinished), and names the victim's layouts in a raw publish.
FOREIGN_PART = """
from shmstage_client.save.publish import Part, publish_flat
from shmstage_client.statedict import Flattened
with Stager("{sock}") as stager:
    flatten = lambda: Flattened.of({{"w": torch.full((4,), -1.0)}}, {{"w": [4]}})
    mine = publish_flat(stager, flatten, "policy", step=1, metadata=None, share=(),
                        part=Part(1, 2, {{"w": [8]}}))
    say("OWN-PART", mine.complete)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect("{sock}")
conn = Connection(Role.CLIENT)
sock.sendall(conn.send("hello", 1, {{"version": protocol.PROTOCOL_VERSION, "client": "x",
                                     "pid": 1}}))
def frame():
    while (got := conn.next_frame()) is None:
        data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 253)
        conn.receive_data(data, fds)
    return got
frame()
for layout in range(1, 9):  # every layout id around: the victim's among them
    body = {{"layout": layout, "slot": 0, "name": "policy", "step": 1, "parts": 2, "part": 1,
             "tree": {{"d": [["w", {{"T": "w"}}]]}}, "shapes": {{"w": [8]}}}}
    sock.sendall(conn.send("publish", 10 + layout, body))
    got = frame()
    say("FOREIGN", got.op, got.body.get("code"))
"""


def test_another_user_can_neither_add_a_part_to_a_sharded_version_nor_read_it_unshared(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    daemon = shared_daemon(toml=f'publish_groups = ["{GROUP}"]\n')
    flag = arena / "part-1-now"
    publisher = Actor(victim, SHARDED_PUBLISHER.format(sock=daemon.socket, flag=flag, group=GROUP))
    try:
        assert publisher.wait_line("PART0") == "PART0 False"
        foreign = run_as(attacker, FOREIGN_PART.format(sock=daemon.socket))
        assert "OWN-PART False" in foreign, foreign  # its own channel's step 1, unfinished
        answers = [line for line in foreign.splitlines() if line.startswith("FOREIGN")]
        assert len(answers) == 8 and all(" error " in line for line in answers), answers
        assert "published" not in foreign
        refused = run_as(attacker, FOLLOW.format(owner=victim.uid, sock=daemon.socket))
        assert "REFUSED policy" in refused and "READ" not in refused, refused
        flag.touch()
        assert publisher.wait_line("NOTHING-YET"), "the attacker's part completed nothing"
        assert publisher.wait_line("PART1") == "PART1 True"
        own = publisher.wait_line("OWN")
        assert own == "OWN 1 2 [10.0, 10.0, 10.0, 10.0, 11.0, 11.0, 11.0, 11.0]", own
        assert publisher.wait_line("STEP2") == "STEP2 False True"
        shared = run_as(attacker, FOLLOW.format(owner=victim.uid, sock=daemon.socket))
        assert "READ policy 2 [20.0, 20.0, 20.0, 20.0, 21.0, 21.0, 21.0, 21.0]" in shared, shared
    finally:
        publisher.kill()
    assert "internal error" not in daemon.log()


#: The victim checkpoints (a job the daemon persists and keeps as the slot's checkpoint)
#: and lives on, so that its job's slot is there to be named.
SAVER = """
stager = Stager("{sock}")
handle = stager.save({{"w": torch.full((8,), 7.0)}}, "{home}/ckpt-1", offsets={{"w": [0]}})
handle.wait(30)
say("JOB", handle.job)
time.sleep(3600)
"""

#: The attacker publishes a part of "policy" naming a job: every job id around on its own
#: slot (staged, then committed: only its own job is its), and the victim's layouts.
FOREIGN_JOB = """
stager = Stager("{sock}")
staged = stager.stage({{"w": torch.full((4,), -1.0)}}, offsets={{"w": [0]}})
def part(job, layout=None, slot=None):
    body = {{"layout": staged.layout_id if layout is None else layout,
             "slot": staged.slot if slot is None else slot, "job": job, "name": "policy",
             "step": 1, "parts": 2, "part": 0, "shapes": {{"w": [8]}}}}
    try:
        answer = staged.connection.call("publish", body, timeout=10).body
        return "published", answer["visible"]
    except DaemonRefused as exc:
        return "refused", exc.code
for job in range(1, {victim_job} + 4):
    say("STAGED-SLOT", job, *part(job))
for layout in range(1, 9):
    say("VICTIM-LAYOUT", layout == staged.layout_id, *part({victim_job}, layout, 0))
handle = staged.commit("{home}/ckpt-1")
for job in range(1, handle.job + 3):
    say("COMMITTED-SLOT", job == handle.job, *part(job))
handle.wait(30)
stager.close()
"""


def test_another_user_cannot_publish_a_job_it_does_not_own_as_its_part_of_a_version(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    daemon = shared_daemon()
    saver = Actor(victim, SAVER.format(sock=daemon.socket, home=arena / victim.name))
    try:
        victim_job = int(saver.wait_line("JOB").split()[1])
        out = run_as(
            attacker,
            FOREIGN_JOB.format(
                sock=daemon.socket, home=arena / attacker.name, victim_job=victim_job
            ),
        )
        lines = [line.split() for line in out.splitlines()]
        staged = [line[2:] for line in lines if line[0] == "STAGED-SLOT"]
        assert staged and all(answer == ["refused", "slot_not_owned"] for answer in staged), out
        layouts = [line[1:] for line in lines if line[0] == "VICTIM-LAYOUT"]
        assert len(layouts) == 8 and all(  # its own layout's slot does not hold that job
            answer in (["False", "refused", "unknown_layout"], ["True", "refused",
                                                                 "slot_not_owned"])
            for answer in layouts
        ), out
        committed = [line[1:] for line in lines if line[0] == "COMMITTED-SLOT"]
        assert ["True", "published", "False"] in committed, out  # its own job: its part
        others = [answer for answer in committed if answer[0] == "False"]
        assert others and all(answer[1:] == ["refused", "slot_not_owned"] for answer in others)
    finally:
        saver.kill()
    assert "internal error" not in daemon.log()
