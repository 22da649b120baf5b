"""Metrics snapshots and their Prometheus text: what a scraper parses must be exact."""

from __future__ import annotations

import msgpack

from shmstage.metrics import Histogram, Registry, render


def test_histogram_buckets_are_cumulative_with_an_inf_bucket() -> None:
    h = Histogram([0.1, 1, 10])
    for value in (0.05, 0.1, 0.5, 5, 50):
        h.observe(value)
    snap = h.snapshot()
    assert snap["buckets"] == [[0.1, 2], [1, 3], [10, 4], ["+Inf", 5]]
    assert snap["count"] == 5 and snap["sum"] == 55.65


def test_render_follows_the_text_exposition_format() -> None:
    r = Registry("shmstage")
    r.counter("saves_total", "Saves, by result.", labelled=True)
    r.counter("bytes_total", "Bytes.")
    r.gauge("clients", "Clients.")
    r.histogram("persist_seconds", "Persist time.", [0.5, 2])
    r.inc("saves_total", result="ok")
    r.inc("saves_total", 2, result='we"ird\n')
    r.inc("bytes_total", 1 << 40)
    r.set("clients", 3)
    r.observe("persist_seconds", 1.25)
    # The snapshot is plain data: it travels over the daemon's socket as msgpack.
    snapshot = msgpack.unpackb(msgpack.packb(r.snapshot()), strict_map_key=False)
    assert render(snapshot).splitlines() == [
        "# HELP shmstage_saves_total Saves, by result.",
        "# TYPE shmstage_saves_total counter",
        'shmstage_saves_total{result="ok"} 1',
        'shmstage_saves_total{result="we\\"ird\\n"} 2',
        "# HELP shmstage_bytes_total Bytes.",
        "# TYPE shmstage_bytes_total counter",
        "shmstage_bytes_total 1099511627776",
        "# HELP shmstage_clients Clients.",
        "# TYPE shmstage_clients gauge",
        "shmstage_clients 3",
        "# HELP shmstage_persist_seconds Persist time.",
        "# TYPE shmstage_persist_seconds histogram",
        'shmstage_persist_seconds_bucket{le="0.5"} 0',
        'shmstage_persist_seconds_bucket{le="2"} 1',
        'shmstage_persist_seconds_bucket{le="+Inf"} 1',
        "shmstage_persist_seconds_sum 1.25",
        "shmstage_persist_seconds_count 1",
    ]


def test_unlabelled_metrics_exist_before_anything_happened() -> None:
    r = Registry("x")
    r.counter("errors_total", "Errors.")
    r.histogram("stall_seconds", "Stall.", [1])
    text = render(r.snapshot())
    assert "x_errors_total 0" in text and "x_stall_seconds_count 0" in text
