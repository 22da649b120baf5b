"""The README and docs/ say what the code does: every name they promise exists, every link
lands, and the README stays a first read.

Documentation drifts silently: a configuration key added without its row, a test renamed
while a guarantee table still cites it, a metric renamed under an operator's dashboard, a
page moved under a link. Each check here asks the code itself — the daemon's own answer to
an unknown key, a live daemon's metrics, the test files — never a list kept beside the docs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from harness import RunningDaemon, shmstaged_command

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md")), *sorted((REPO / "examples").rglob("*.md"))]
SOURCES = ["shmstage", "daemon", "client", "bench", "scripts", "tests", "systemd", "Makefile"]

#: The two commands a newcomer types first, exactly as the README's first block says them.
FIRST_COMMANDS = """\
make demo   # bootstrap .venv, start shmstaged, train a small model that checkpoints through it, restore, print stall vs torch.save
make test   # bootstrap .venv (plus test tools), run the whole suite against real shmstaged processes
"""  # noqa: E501


def text_of(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def outside_code(text: str) -> str:
    """The page without its fenced code blocks (a ``# comment`` there is no heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors_of(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces to
    hyphens."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", outside_code(text_of(page)), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def links_of(page: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", outside_code(text_of(page)))


def source_text() -> str:
    parts = []
    for name in SOURCES:
        root = REPO / name
        files = [root] if root.is_file() else root.rglob("*")
        for path in files:
            if path.is_file() and path.suffix in {"", ".py", ".sh", ".c", ".toml", ".service"}:
                parts.append(path.read_text(encoding="utf-8", errors="replace"))
    return "\n".join(parts)


def test_the_readme_opens_with_the_two_commands_and_stays_a_first_read() -> None:
    readme = text_of(README)
    first_block = re.search(r"^```sh\n(.*?)^```", readme, flags=re.S | re.M)
    assert first_block is not None and first_block.group(1) == FIRST_COMMANDS
    assert readme.index(first_block.group(0)) < readme.index("\n## "), "commands come first"
    lines = readme.count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move detail to docs/ (limit 300)"
    assert "## Security" in readme and "docs/security.md" in readme


def test_no_page_points_outside_the_repository() -> None:
    for page in PAGES:
        text = text_of(page)
        assert "../shared" not in text and "/work/" not in text, f"{page.name} leaves the tree"


def test_every_link_lands_on_a_file_and_heading_that_exist() -> None:
    broken = []
    for page in PAGES:
        for link in links_of(page):
            if re.match(r"[a-z]+:", link):
                continue  # http(s), mailto: not ours to check offline
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.name}: {link} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors_of(path):
                broken.append(f"{page.name}: {link} (no such heading in {path.name})")
    assert not broken, "\n".join(broken)


def test_every_kept_benchmark_result_is_cited_and_every_cited_one_is_kept() -> None:
    kept = {p.name for p in (DOCS / "perf").iterdir()} if (DOCS / "perf").exists() else set()
    cited = set()
    for page in PAGES:
        cited |= set(re.findall(r"perf/([\w.\-]+\.(?:json|txt|png))", text_of(page)))
    assert cited <= kept, f"cited but not in docs/perf: {sorted(cited - kept)}"
    assert kept <= cited, f"raw results nobody cites (remove them): {sorted(kept - cited)}"


def test_every_configuration_key_has_its_row_and_every_row_is_a_key(tmp_path: Path) -> None:
    """The daemon names the keys it accepts when it refuses an unknown one; operations.md
    must have a row for each, under its table, and no row for a key it refuses."""
    tables = ["server", "limits", "storage", "retention", "log"]
    probe = tmp_path / "probe.toml"
    probe.write_text("".join(f"[{table}]\nnot_a_key = 1\n" for table in tables))
    check = subprocess.run(
        [*shmstaged_command(), "--config", str(probe), "--check-config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 78, check.stderr
    accepted = {
        table: set(keys.split(", "))
        for table, keys in re.findall(
            r"unknown key \[(\w+)\] not_a_key \(allowed: ([^)]*)\)", check.stderr
        )
    }
    assert set(accepted) == set(tables), check.stderr
    operations = text_of(DOCS / "operations.md")
    for table in tables:
        section = re.search(rf"^### `\[{table}\]`\n(.*?)(?=^##)", operations, flags=re.S | re.M)
        assert section is not None, f"operations.md has no section for [{table}]"
        rows = set(re.findall(r"^\| `(\w+)` \|", section.group(1), flags=re.M))
        keys = accepted[table]
        assert keys <= rows, f"[{table}] keys without a row: {keys - rows}"
        assert rows <= keys, f"[{table}] rows the daemon refuses: {rows - keys}"


def test_every_test_a_page_cites_exists() -> None:
    defined = set()
    for path in (REPO / "tests").rglob("test_*.py"):
        defined |= set(re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), flags=re.M))
    missing = [
        f"{page.name}: {name}"
        for page in PAGES
        for name in re.findall(r"`(test_\w+?)(?:\.py)?`", text_of(page))
        if name not in defined and not any((REPO / "tests").rglob(f"{name}.py"))
    ]
    assert not missing, "tests cited but not found:\n" + "\n".join(missing)


def test_every_environment_variable_a_page_names_is_read_somewhere() -> None:
    code = source_text()
    named = set()
    for page in PAGES:
        named |= set(re.findall(r"\bSHMSTAGE_[A-Z_]+[A-Z]\b", text_of(page)))
    unknown = sorted(name for name in named if name not in code)
    assert not unknown, f"documented but never read: {unknown}"


def test_the_metrics_operations_md_lists_are_the_ones_the_daemon_serves(
    daemon: RunningDaemon,
) -> None:
    served = subprocess.run(
        [sys.executable, "-m", "shmstage.cli", "metrics", "--socket", str(daemon.socket)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    names = set(re.findall(r"^# HELP (shmstage_\w+)", served, flags=re.M))
    counted = set(re.findall(r"^# TYPE (shmstage_\w+) (?:counter|histogram)", served, flags=re.M))
    documented = set()
    for page in PAGES:
        found = re.findall(r"\b(shmstage_\w+?(?:_total|_seconds|_bytes))\b", text_of(page))
        documented |= set(found)
    assert documented <= names, f"documented, not served: {sorted(documented - names)}"
    operations = text_of(DOCS / "operations.md")
    absent = sorted(n for n in counted if n not in operations)
    assert not absent, f"served counters and histograms operations.md does not list: {absent}"
