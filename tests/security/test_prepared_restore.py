"""``prepare_restore`` adopts only its caller's own retained layout, never another user's.

A prepared restart takes a retained layout over writable (``restore.adoption``): the
daemon hands one over only to a registration of its own user (``adopt_only``), and the
prepare leases only its caller's newest checkpoint to learn which. So another user — even
a member of ``restore_groups``, who may lease the victim's checkpoint read-only — prepares
nothing from the victim's memory, adopts nothing of it, and leaves it retained for the
victim, whose own prepared restart then gets its bytes back from the adopted layout.
"""

from __future__ import annotations

from pathlib import Path

from sec_helpers import GROUP, User, run_as

VICTIMS = 1.0


def test_another_users_prepare_adopts_nothing_and_the_owners_restores_its_own_bytes(
    shared_daemon, victim: User, attacker: User, arena: Path
) -> None:
    daemon = shared_daemon(toml=f'restore_groups = ["{GROUP}"]\n')
    (arena / victim.name).chmod(0o755)  # its restore group may read the files, too
    ckpt = arena / victim.name / "c"
    run_as(
        victim,
        f"""
        stager = Stager("{daemon.socket}", slots=2)
        stager.save({{"w": torch.full((1024,), {VICTIMS})}}, "{ckpt}").wait(60)
        stager.close(retain=True)  # as a trainer that dies does
        """,
    )
    daemon.wait_log("retained layout")
    out = run_as(
        attacker,
        f"""
        prepare_restore("cpu", socket="{daemon.socket}")
        time.sleep(1.0)  # the prepare's thread asks the daemon meanwhile
        try:
            got = latest(socket="{daemon.socket}")
            say("RESTORED", got.source, got.path)
        except CheckpointError as exc:
            say("REFUSED", exc)
        """,
    )
    assert "REFUSED" in out and "no checkpoint to restore" in out, out
    assert "segments adopted" not in daemon.log()
    out = run_as(
        victim,
        f"""
        prepare_restore("cpu", socket="{daemon.socket}")
        got = latest(socket="{daemon.socket}")
        mine = bool((got.state["w"] == {VICTIMS}).all())
        say("RESTORED", got.source, got.verified, mine, "adopt" in got.phases)
        """,
    )
    assert "RESTORED memory True True True" in out, out
    assert daemon.log().count("segments adopted from a retained layout") == 1
