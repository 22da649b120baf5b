"""The packaged systemd units, sysusers.d and tmpfiles.d files, checked by systemd's own tools.

`systemd-analyze verify` runs against a scratch root (`--root`) holding the host's stock
units plus ours and stub executables, because verify insists that ExecStart= exists and the
daemon is not installed on a development machine. The unit contents are then read as the
specification of how shmstaged must run: as a system user, with a watchdog, with /dev/shm
visible and the socket limited to the shmstage group.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

UNITS_DIR = Path(__file__).resolve().parents[2] / "systemd"
SERVICE = UNITS_DIR / "shmstaged.service"
SOCKET = UNITS_DIR / "shmstaged.socket"
SYSUSERS = UNITS_DIR / "shmstage.sysusers.conf"
TMPFILES = UNITS_DIR / "shmstage.tmpfiles.conf"
HOST_UNITS = Path("/usr/lib/systemd/system")
TIMEOUT_S = 60


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} not installed (apt-get install systemd); the bootstrap installs it")
    return path


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> every assignment in order (systemd keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}: assignment outside a section: {raw!r}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit.get(section, {}).get(key)
    assert values, f"[{section}] {key}= is missing"
    return values[-1]


@pytest.fixture
def scratch_root(tmp_path: Path) -> Path:
    """A filesystem root where our units are installed and their executables exist."""
    if not HOST_UNITS.is_dir():
        pytest.skip(f"{HOST_UNITS} missing: systemd's stock units are needed for the targets")
    root = tmp_path / "root"
    shutil.copytree(HOST_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for unit in (SERVICE, SOCKET):
        shutil.copy(unit, root / "etc/systemd/system" / unit.name)
    bindir = root / "usr/bin"
    bindir.mkdir(parents=True, exist_ok=True)
    (root / "bin").symlink_to("usr/bin")
    for name in ("shmstaged", "kill"):
        stub = bindir / name
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    return root


def test_systemd_analyze_verify_accepts_units_without_warnings(scratch_root: Path) -> None:
    tool = _need("systemd-analyze")
    result = subprocess.run(
        [tool, "verify", f"--root={scratch_root}", "--man=no", SERVICE.name, SOCKET.name],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # verify only warns about unknown keys and bad values; for us any remark is a failure.
    ours = [
        line
        for line in output.splitlines()
        if SERVICE.name in line or SOCKET.name in line
    ]
    assert ours == [], "\n".join(ours)


def test_service_runs_as_notify_service_with_watchdog_as_system_user() -> None:
    unit = parse_unit(SERVICE)
    assert _one(unit, "Service", "Type") == "notify"
    assert _one(unit, "Service", "NotifyAccess") == "main"
    assert _one(unit, "Service", "WatchdogSec") not in ("", "0", "infinity")
    assert _one(unit, "Service", "User") == "shmstage"
    assert _one(unit, "Service", "Group") == "shmstage"
    assert _one(unit, "Service", "ExecStart").split()[1:] == [
        "--config",
        "/etc/shmstage/shmstaged.toml",
    ]
    assert _one(unit, "Service", "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert _one(unit, "Service", "RuntimeDirectory") == "shmstage"
    # Removing /run/shmstage on stop would delete the socket shmstaged.socket listens on.
    assert _one(unit, "Service", "RuntimeDirectoryPreserve") == "yes"
    assert int(_one(unit, "Service", "LimitNOFILE")) >= 65536
    assert "shmstaged.socket" in _one(unit, "Unit", "Requires")


def test_service_is_hardened_without_hiding_dev_shm() -> None:
    service = parse_unit(SERVICE)["Service"]
    assert service["NoNewPrivileges"] == ["yes"]
    assert service["ProtectSystem"] == ["strict"]
    assert service["PrivateTmp"] == ["yes"]
    # Each of these would give the daemon a /dev/shm other than the trainers'.
    assert service.get("PrivateDevices", ["no"])[-1] == "no"
    assert service.get("PrivateIPC", ["no"])[-1] == "no"
    for key in ("TemporaryFileSystem", "InaccessiblePaths", "ReadOnlyPaths"):
        assert not any("/dev" in v for v in service.get(key, [])), key
    # RemoveIPC would unlink the staged segments whenever the service stops.
    assert service.get("RemoveIPC", ["no"])[-1] == "no"
    # Checkpoint storage must be made writable explicitly; the example is in a comment.
    assert "#ReadWritePaths=" in SERVICE.read_text()


def test_socket_is_group_restricted_and_at_the_packaged_path() -> None:
    from shmstage.paths import SYSTEM_SOCKET

    unit = parse_unit(SOCKET)
    assert _one(unit, "Socket", "ListenStream") == str(SYSTEM_SOCKET)
    assert _one(unit, "Socket", "SocketMode") == "0660"
    assert _one(unit, "Socket", "SocketGroup") == "shmstage"
    assert _one(unit, "Socket", "Accept") == "no"
    assert _one(unit, "Install", "WantedBy") == "sockets.target"


def test_sysusers_and_tmpfiles_create_the_user_and_socket_directory(tmp_path: Path) -> None:
    sysusers = _need("systemd-sysusers")
    tmpfiles = _need("systemd-tmpfiles")
    if os.geteuid() != 0:
        pytest.skip("systemd-tmpfiles --root must chown to the shmstage user: needs root")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    subprocess.run([sysusers, f"--root={root}", str(SYSUSERS)], check=True, timeout=TIMEOUT_S)
    passwd = {
        line.split(":")[0]: line.split(":")
        for line in (root / "etc/passwd").read_text().splitlines()
    }
    assert "shmstage" in passwd
    _, _, uid, gid, _, home, _ = passwd["shmstage"]
    # A system user: exempt from logind's RemoveIPC, which would delete its /dev/shm segments.
    assert int(uid) < 1000
    assert home == "/var/lib/shmstage"
    groups = {line.split(":")[0]: line.split(":")[2] for line in
              (root / "etc/group").read_text().splitlines()}
    assert groups["shmstage"] == gid

    subprocess.run(
        [tmpfiles, f"--root={root}", "--create", str(TMPFILES)], check=True, timeout=TIMEOUT_S
    )
    run_dir = (root / "run/shmstage").stat()
    assert (run_dir.st_uid, run_dir.st_gid) == (int(uid), int(gid))
    # Group members may reach the socket, everyone else may not even look.
    assert stat.S_IMODE(run_dir.st_mode) == 0o750
