"""Holding off Python's cyclic garbage collector while a save or a restore runs.

A save or restore of thousands of tensors allocates tens of thousands of short-lived
containers (the encoded tree, copy lists, the restored tensors and their views); with the
collector on they trip full collections, each a traversal of every object in a torch
process (~100 ms measured in a save; 80 ms in a new process's first restore of 500
tensors), inside the time the caller waits. They are acyclic and freed by reference
counting, so pausing loses nothing; a collector the caller disabled stays disabled. The
daemon pauses it the same way (``shmstage.collection``) while it reads a large layout.
"""

from __future__ import annotations

from shmstage.collection import collection_paused

__all__ = ["collection_paused"]
