"""One-line use of shmstage from the training frameworks users already run.

Each submodule imports its framework lazily (on first use of a class that needs it), so
``import shmstage_client`` never pulls in Lightning, transformers or torchtitan, and a user
installs only the extra they use: ``shmstage-client[lightning]``, ``[hf]``, ``[torchtitan]``.
"""
