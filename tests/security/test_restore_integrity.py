"""A restarted trainer gets its own bytes back, or a clear refusal — never another user's.

Two attacks by a real second user, as reproduced: (a) it pre-creates the victim's
destination in /tmp (mode 0777) and later swaps the files for a checkpoint of its own,
which carries valid checksums because it saved it through the daemon; (b) in a shared
group root (2770, no sticky bit) it renames the victim's run directory and plants its own
checkpoint at the same path, and, where it may only add entries (a sticky root), plants
one whose ``committed_unix`` lies far in the future. The victim's ``save()`` refuses
directories others may change; its ``latest()`` takes the daemon's own record from memory
whatever became of the path, and reads files only when written for it
(``listing.not_written_for``).
"""

from __future__ import annotations

import grp
import os
import shutil
import textwrap
import uuid
from pathlib import Path

from sec_helpers import GROUP, User, run_as

#: The victim's tensor and the attacker's: the victim must only ever see ``VICTIMS``.
VICTIMS, ATTACKERS = 1.0, 666.0

#: What the victim's restart runs: latest() as the restart script would call it, each
#: outcome printed (source, whether every value is the victim's, the reason) or the error.
RESTART = """
def restart(**kwargs):
    try:
        got = latest(socket="{sock}", **kwargs)
    except CheckpointError as exc:
        say("REFUSED", exc)
        return
    mine = bool((got.state["w"] == {victims}).all())
    say("RESTORED", got.source, got.verified, mine, got.reason)
"""


def _restart(victim: User, sock: object, calls: str) -> list[str]:
    out = run_as(victim, RESTART.format(sock=sock, victims=VICTIMS) + textwrap.dedent(calls))
    return [line for line in out.splitlines() if line.startswith(("RESTORED", "REFUSED"))]


def _save(user: User, sock: object, path: Path, value: float, *, retain: bool = False) -> str:
    """``user`` saves ``{"w": [value] * 8}`` to ``path`` (durable), or says why not;
    ``retain``: the trainer then dies as far as the daemon is concerned (close(retain=True)),
    which leaves its newest checkpoint in memory for the restart."""
    return run_as(
        user,
        f"""
        stager = Stager("{sock}")
        try:
            stager.save({{"w": torch.full((8,), {value})}}, "{path}").wait(60)
            say("SAVED")
        except DestinationError as exc:
            say("REFUSED", exc)
        stager.close(retain={retain})
        """,
    )


def test_a_tmp_destination_pre_created_by_another_user_is_refused_and_a_swap_never_restores(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    daemon = shared_daemon()
    squat = Path(f"/tmp/shmstage-sec-{uuid.uuid4().hex[:12]}")  # the victim's destination
    run_dir = Path(f"{squat}-run")
    try:
        run_as(attacker, f'os.mkdir("{squat}"); os.chmod("{squat}", 0o777); say("MADE")')
        # Into the squatted directory, or a new checkpoint inside it: both refused, named.
        for into in (squat, squat / "step-1"):
            out = _save(victim, daemon.socket, into, VICTIMS)
            assert "REFUSED" in out and str(squat) in out, out
            assert f"belongs to uid {attacker.uid}" in out
        assert os.listdir(squat) == []
        # The read side holds even where a save's directory became writable by others
        # afterwards (the victim's own `chmod -R a+w`): the attacker swaps the checkpoint
        # for one it saved through the daemon (valid checksums), and the victim restarts.
        run_as(victim, f'os.mkdir("{run_dir}", 0o755); say("MADE")')
        assert "SAVED" in _save(victim, daemon.socket, run_dir / "step-1", VICTIMS, retain=True)
        run_dir.chmod(0o777)
        own = arena / attacker.name / "own"  # the attacker's own checkpoint, saved as usual
        assert "SAVED" in _save(attacker, daemon.socket, own, ATTACKERS)
        run_as(
            attacker,
            f"""
            stolen = open("{run_dir}/step-1/model.safetensors", "rb").read()  # readable
            os.rename("{run_dir}/step-1", "{run_dir}/.gone")
            os.rename("{own}", "{run_dir}/step-1")
            say("SWAPPED", len(stolen))
            """,
        )
        lines = _restart(
            victim,
            daemon.socket,
            f"""
            restart()
            restart(under="{run_dir}")
            restart(under="{run_dir}", source="files")
            """,
        )
        memory, under, files = lines
        for line in (memory, under):
            assert line.startswith("RESTORED memory True True"), line  # its own, verified
        assert "was replaced" in memory and f"belongs to uid {attacker.uid}" in memory
        assert files.startswith("REFUSED no complete checkpoint"), files
        assert f"{run_dir}/step-1: the directory belongs to uid {attacker.uid}" in files
    finally:
        shutil.rmtree(squat, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def test_in_a_shared_group_root_a_renamed_run_directory_or_a_planted_newer_checkpoint_loses(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    daemon = shared_daemon()
    gid = grp.getgrnam(GROUP).gr_gid
    shared = arena / "shared"  # as docs/operations.md used to recommend: 2770, no sticky
    shared.mkdir()
    os.chown(shared, 0, gid)
    shared.chmod(0o2770)
    out = _save(victim, daemon.socket, shared / "step-0", VICTIMS)
    assert "REFUSED" in out and "mode 2770" in out and "chmod +t" in out, out
    run_dir = shared / "victim-run"  # the fix the refusal names: a run directory per user
    run_as(victim, f'os.mkdir("{run_dir}", 0o755); say("MADE")')
    assert "SAVED" in _save(victim, daemon.socket, run_dir / "step-1", VICTIMS, retain=True)
    # The group may rename entries of the root: the attacker moves the victim's run away
    # and plants its own checkpoint at the very path the daemon recorded.
    run_as(attacker, f'os.rename("{run_dir}", "{shared}/stolen"); os.mkdir("{run_dir}")')
    assert "SAVED" in _save(attacker, daemon.socket, run_dir / "step-1", ATTACKERS)
    memory, under, files = _restart(
        victim,
        daemon.socket,
        f"""
        restart()
        restart(under="{run_dir}")
        restart(under="{run_dir}", source="files")
        """,
    )
    assert memory.startswith("RESTORED memory True True") and "was replaced" in memory, memory
    assert under.startswith("RESTORED memory True True"), under
    assert "moved, replaced or deleted" in under
    assert files.startswith("REFUSED") and f"belongs to uid {attacker.uid}" in files, files

    # With the sticky bit (the guide's shared root) nobody renames another's entries, but
    # anyone may add one: a checkpoint "committed" far in the future must not win.
    shared.chmod(0o3770)
    assert "SAVED" in _save(victim, daemon.socket, shared / "step-1", VICTIMS)
    assert "SAVED" in _save(attacker, daemon.socket, shared / "step-9", ATTACKERS)
    run_as(
        attacker,
        f"""
        path = "{shared}/step-9/shmstage-manifest.json"
        document = json.load(open(path))
        document["save"]["committed_unix"] = time.time() + 10**7
        open(path, "w").write(json.dumps(document))
        say("PLANTED")
        """,
    )
    (newest,) = _restart(victim, daemon.socket, f'restart(under="{shared}", source="files")')
    assert newest.startswith("RESTORED files True True"), newest
