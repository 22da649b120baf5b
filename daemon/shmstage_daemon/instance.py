"""Daemon instances: the rules live in the core (``shmstage.instance``), shared with gc.

Kept as a module so ``shmstage_daemon.instance`` keeps working for code that imported it.
"""

from shmstage.instance import InstanceLock, Reaped, live_instances, lock_path, reap, reap_dead

__all__ = ["InstanceLock", "Reaped", "live_instances", "lock_path", "reap", "reap_dead"]
