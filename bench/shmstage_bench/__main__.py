"""``python -m shmstage_bench``; the guard matters because peers spawn processes."""

import sys

from . import main


def _publish_argv(argv: list[str]) -> list[str] | None:
    """The arguments of ``--scenario publish`` (its own parser: ``publish``), else None."""
    if "--scenario=publish" in argv:
        return [arg for arg in argv if arg != "--scenario=publish"]
    for i, arg in enumerate(argv[:-1]):
        if arg == "--scenario" and argv[i + 1] == "publish":
            return argv[:i] + argv[i + 2 :]
    return None


if __name__ == "__main__":
    publish_argv = _publish_argv(sys.argv[1:])
    if publish_argv is not None:
        from .publish import main as publish

        sys.exit(publish(publish_argv))
    sys.exit(main())
