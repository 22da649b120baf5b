"""shmstage core: wire protocol, segments, layouts and the on-disk format (no torch)."""

__version__ = "0.1.0"
