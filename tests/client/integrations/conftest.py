"""Integration-test fixtures: the module's shmstaged's socket, a channel name.

One daemon serves a whole module (``module_daemon``, tests/client/conftest.py): the
integrations' tests each save under their own directory or publish on their own channel
(``name``), so they do not see each other, and a module pays the daemon's start-up once. A
test that needs a daemon of its own (a fault hook, a config, one it kills) starts it with
``harness.start_daemon``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

#: What importing each integration module does in a fresh interpreter in which Lightning
#: and torchtitan are absent (a None entry in sys.modules makes every import of that name
#: fail, as when it is not installed: neither can be uninstalled here): the vllm packages
#: the vllm module imported (none, it imports vLLM on first use), and the ImportError that
#: using the Lightning and torchtitan classes raises. One interpreter for the three
#: modules: each costs an import of torch.
FRESH_IMPORTS = """
import json, sys
for name in ("lightning", "pytorch_lightning", "lightning_fabric", "torchtitan"):
    sys.modules[name] = None
import shmstage_client.integrations.vllm
found = {"vllm": sorted(n for n in sys.modules if n.split(".")[0] == "vllm")}
import shmstage_client.integrations.lightning as lightning
import shmstage_client.integrations.torchtitan as torchtitan
for key, module, name in [
    ("lightning", lightning, "ShmStageCheckpointIO"),
    ("torchtitan", torchtitan, "ShmStageCheckpointManager"),
]:
    try:
        getattr(module, name)
        found[key] = "no ImportError"
    except ImportError as exc:
        found[key] = "ImportError: " + str(exc)
print(json.dumps(found))
"""


@pytest.fixture(scope="session")
def fresh_imports() -> dict[str, Any]:
    """``FRESH_IMPORTS``' findings, for the three modules' tests (once a worker)."""
    done = subprocess.run(
        [sys.executable, "-c", FRESH_IMPORTS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])
