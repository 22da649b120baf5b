"""Versioned JSON documents on disk (the manifest, the DCP commit marker).

Each carries a ``format`` name and a ``version``; a reader refuses anything else with a
message that says which document and what to do, rather than misreading a newer format.
"""

from __future__ import annotations

import json
from typing import Any


def parse(
    data: bytes, *, fmt: str, version: int, where: str, kind: str, error: type[Exception]
) -> dict[str, Any]:
    """The decoded document, checked for format and version; raises ``error`` otherwise."""
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(document, dict) or document.get("format") != fmt:
        raise error(f"{where} is not a {kind}")
    if document.get("version") != version:
        raise error(
            f"{where} has format version {document.get('version')!r}; this shmstage reads "
            f"version {version} — upgrade shmstage"
        )
    return document


def render(document: dict[str, Any]) -> bytes:
    """Readable, exact JSON: NaN is refused rather than written as a non-standard token."""
    return json.dumps(document, indent=1, ensure_ascii=False, allow_nan=False).encode()
