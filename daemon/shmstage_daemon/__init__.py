"""shmstaged: owns staging segments, enforces slot ownership, streams checkpoints to storage.

This package never imports torch: the daemon must start in milliseconds, stay small, and
keep running whatever CUDA version a trainer brings.
"""

__version__ = "0.1.0"
