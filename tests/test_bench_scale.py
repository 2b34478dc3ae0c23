"""`python -m bench scale`: not a test of speed, but of what a reader of its result relies on.
Every point stands beside its in-database reference, the ratios say what the points say, the
consumers' figures add up, each target names the sizes it compares and is judged as it says
(a CPU-bound consumers curve by the CPU an event costs), and the summary and chart are written.

The end-to-end run takes a minute or two: it is marked `slow`."""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench import report, scale
from bench.harness import event_position, outbox_end
from consumer.core.events import Position
from tests.conftest import ROOT
from tests.support.backend import (
    burn_xids_past_a_power_of_ten,
    insert_call,
    outbox_in_delivery_order,
)


def _consumers_curve(ratio: float, efficiency: float, *, cpu_bound: bool) -> dict[str, Any]:
    """A consumers curve of 1 and 16 as bench/scale.py writes it, reduced to what the target
    reads."""
    return {
        "cpus": 2,
        "points": [
            {"consumers": 1, "cpu_bound": False, "machine_busy_share": 0.6},
            {"consumers": 16, "cpu_bound": cpu_bound, "machine_busy_share": 0.98},
        ],
        "ratios": {"16_to_1": ratio},
        "cpu_efficiency": {"16_to_1": efficiency},
    }


@pytest.mark.parametrize(
    ("ratio", "efficiency", "cpu_bound", "met"),
    [
        (8.5, 0.9, False, True),  # linear enough
        (7.9, 0.9, False, False),  # short of half of linear, with CPU to spare
        (1.6, 0.8, True, True),  # CPU-bound: each event costs 1/0.8 of one consumer's
        (1.6, 0.4, True, False),  # CPU-bound, and each event costs 2.5 times as much
    ],
)
def test_consumers_target_is_judged_by_cpu_once_the_machine_is_saturated(
    ratio: float, efficiency: float, cpu_bound: bool, met: bool
) -> None:
    checks = report.targets(
        {"scale": {"consumers": _consumers_curve(ratio, efficiency, cpu_bound=cpu_bound)}}
    )
    check = checks["scale_16_consumers_vs_1"]
    assert (check["measured"], check["met"]) == (ratio, met)
    assert ("CPU-bound" in check["target"]) is cpu_bound


def test_backlog_targets_name_their_sizes_and_take_the_lower_ratio() -> None:
    largest: dict[str, Any] = {
        "backlog": 10_000_000,
        "status_and_cleanup": {"status": {"report_ms": 120.5}},
    }
    backlog = {
        "window": 100_000,
        "points": [{"backlog": 100_000}, largest],
        "ratios": {"null_largest_to_smallest": 0.84, "http_largest_to_smallest": 0.97},
    }
    checks = report.targets({"scale": {"backlog": backlog}})
    assert checks["scale_drain_10m_vs_100k"]["measured"] == 0.84
    assert not checks["scale_drain_10m_vs_100k"]["met"]
    assert (checks["status_ms_at_10m"]["measured"], checks["status_ms_at_10m"]["met"]) == (
        120.5,
        False,
    )
    # Without status timings (bench/outbox_scale.py missing or failed) there is no such target.
    largest["status_and_cleanup"] = {"error": "it failed"}
    assert "status_ms_at_10m" not in report.targets({"scale": {"backlog": backlog}})


def test_sizes_read_as_written() -> None:
    assert scale._sizes("100k, 1m,10_000_000") == (100_000, 1_000_000, 10_000_000)
    assert scale._sizes("1.5m") == (1_500_000,)
    for bad in ("0", "1.5", "ten", "-3k"):
        with pytest.raises(argparse.ArgumentTypeError):
            scale._sizes(bad)


async def test_drain_windows_end_in_delivery_order_across_a_txid_digit_boundary(
    private_backend_dsn: str,
) -> None:
    """A drain of the outbox's first N events stops at the N-th in delivery order. Ordered by
    the txid's text, '10000' sorts before '9999': the drains of the first 100,000 events of a
    10M outbox ran on to about 1,000,000 before they were stopped."""
    for i in range(3):
        await insert_call(private_backend_dsn, f"short-txid-{i}")
    await burn_xids_past_a_power_of_ten(private_backend_dsn)
    for i in range(3):
        await insert_call(private_backend_dsn, f"long-txid-{i}")
    outbox = [
        Position(row.txid, row.seq) for row in await outbox_in_delivery_order(private_backend_dsn)
    ]
    assert len(str(outbox[0].txid)) < len(str(outbox[-1].txid))
    assert [await event_position(private_backend_dsn, n) for n in range(1, 7)] == outbox
    assert await event_position(private_backend_dsn, 7) is None
    assert await outbox_end(private_backend_dsn) == outbox[-1]


def _ratio_of(points: list[dict[str, Any]], key: str) -> float:
    return float(points[-1][key]["events_per_sec"] / points[0][key]["events_per_sec"])


def _check_curve(curve: dict[str, Any], events: int | None) -> None:
    """Each point has the reference beside both sinks, each sink's figure is the median of its
    runs (one here), and each ratio is the quotient of the points it names."""
    for point in curve["points"]:
        for key in ("in_database", "null", "http"):
            (run,) = point[key]["runs"]
            assert point[key]["events_per_sec"] == run["events_per_sec"] > 0, key
            if events is not None and key != "in_database":
                # A drain of a window goes on until its consumer is stopped.
                assert run["events"] >= events, (key, run["events"])
        assert math.isclose(
            point["null_to_in_database"],
            point["null"]["events_per_sec"] / point["in_database"]["events_per_sec"],
            rel_tol=0.01,
        )
    for key in ("null", "http", "in_database"):
        assert math.isclose(
            curve["ratios"][f"{key}_largest_to_smallest"],
            _ratio_of(curve["points"], key),
            rel_tol=0.01,
        ), key


@pytest.mark.slow
def test_bench_scale_end_to_end(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            *(sys.executable, "-m", "bench", "scale", "--private", "--rounds", "1"),
            *("--backlogs", "3k,6k", "--consumers", "1,2", "--consumer-events", "3000"),
            *("--payloads", "300,4096", "--payload-events", "2000"),
            *("--tables", "1,3", "--table-events", "3000"),
            *("--name", "scale", "--out", str(tmp_path)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = orjson.loads((tmp_path / "scale.json").read_bytes())
    s = figures["scale"]

    backlog = s["backlog"]
    assert backlog["window"] == 3000
    assert [p["backlog"] for p in backlog["points"]] == [3000, 6000]
    _check_curve(backlog, 3000)

    payload = s["payload"]
    assert [p["payload_bytes"] for p in payload["points"]] == [300, 4096]
    small, large = (p["bytes_per_event"] for p in payload["points"])
    assert 250 < small < 400 and 3900 < large < 4300, (small, large)
    for point in payload["points"]:
        for key in ("in_database", "null", "http"):
            figures_of = point[key]
            expected = figures_of["events_per_sec"] * point["bytes_per_event"] / 1e6
            assert math.isclose(figures_of["mb_per_sec"], expected, abs_tol=0.06), key
    _check_curve(payload, None)

    tables = s["tables"]
    assert [p["tables"] for p in tables["points"]] == [1, 3]
    assert all(p["events"] == 3000 for p in tables["points"])
    _check_curve(tables, 3000)

    consumers = s["consumers"]
    assert [p["consumers"] for p in consumers["points"]] == [1, 2]
    for point in consumers["points"]:
        (run,) = point["runs"]
        assert run["events"] == point["consumers"] * 3000
        assert math.isclose(run["events_per_sec"], run["events"] / run["seconds"], rel_tol=1e-6)
        # Together they are as fast as the slowest one times their number.
        assert math.isclose(
            run["slowest_consumer_events_per_sec"] * point["consumers"],
            run["events_per_sec"],
            rel_tol=1e-6,
        )
        assert run["fastest_consumer_events_per_sec"] >= run["slowest_consumer_events_per_sec"]
        # Shares of the machine's CPUs (ticks of 10 ms: a drain this short may show none).
        assert run["measured_share"] >= 0 and 0 <= run["machine_busy_share"] <= 1.05
        assert run["in_database"]["events"] == 3000
    one, two = consumers["points"]
    assert math.isclose(
        consumers["ratios"]["2_to_1"], two["events_per_sec"] / one["events_per_sec"], rel_tol=0.01
    )

    targets = figures["targets"]
    assert {"scale_drain_6k_vs_3k", "scale_2_consumers_vs_1"} <= set(targets)
    assert targets["scale_drain_6k_vs_3k"]["measured"] == min(
        backlog["ratios"]["null_largest_to_smallest"], backlog["ratios"]["http_largest_to_smallest"]
    )
    out = result.stdout
    assert "scale, backlog: drains of the outbox's first 3,000 events:" in out
    assert "scale, consumers reading the same 3,000 events at once (null sink" in out
    for name, check in targets.items():
        mark = "ok  " if check["met"] else "MISS"
        assert f"[{mark}] {name}: {check['measured']}" in out, name
    assert (tmp_path / "scale.png").stat().st_size > 1000
