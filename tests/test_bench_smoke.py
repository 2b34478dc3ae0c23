"""The benchmark still runs end to end (tiny sizes): it is not a test of speed."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench(*argv: str) -> subprocess.CompletedProcess[str]:
    """`python -m bench ...`, which must succeed."""
    result = subprocess.run(
        [sys.executable, "-m", "bench", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_bench_all_writes_results_and_a_chart(tmp_path: Path) -> None:
    result = _bench(
        *("all", "--quick", "--events", "3000", "--seconds", "1", "--rounds", "1"),
        *("--rate", "100", "--poll-interval", "0.3", "--name", "smoke", "--out", str(tmp_path)),
    )
    logs = re.search(r"logs in (\S+)", result.stderr)
    assert logs is not None, result.stderr[-3000:]
    assert not Path(logs.group(1)).exists(), "a run that succeeded leaves no logs behind"
    figures = orjson.loads((tmp_path / "smoke.json").read_bytes())
    drain = figures["drain"]
    assert drain["events"] == 3000
    for key in ("in_database", "python_loop", "read_walk", "product_http", "product_null"):
        assert drain[key]["events_per_sec"] > 0
    assert drain["product_http"]["consumer_peak_rss_mb"] > 0
    # Where the CPU went: the references always say it (the product only when its drain
    # spans more than one poll, which 3,000 events may not).
    assert {"python", "postgres backend", "total"} <= set(drain["python_loop"]["cpu_us_per_event"])
    assert "CPU us/event" in result.stdout
    assert {run["mode"] for run in figures["latency"]} == {"notify", "poll-only"}
    assert set(figures["producer"]["tps"]) >= {"untracked", "tracked_wakeups_on", "minimal_trigger"}
    assert figures["producer"]["tracked_to_minimal_trigger"] > 0
    assert "against a minimal outbox row trigger" in result.stdout
    assert set(figures["producer"]["tps"]) >= {"bulk_untracked", "bulk_tracked_no_notify"}
    assert figures["producer"]["bulk_tracked_to_minimal_trigger"] > 0
    assert "100-row statements, tracked (no NOTIFY)" in result.stdout
    cpu = figures["producer"]["cpu_us_per_tx"]
    assert cpu["untracked"]["total"] > 0
    assert {"postgres", "pgbench", "consumer", "total", "steal"} <= set(cpu["tracked_wakeups_on"])
    assert "producer_tracked_wakeups_on_ratio" in figures["targets"]
    kinds = {
        f"{op}_{table}"
        for op in ("insert", "update")
        for table in ("untracked", "tracked", "minimal")
    }
    for timings in ("one_transaction", "own_transactions"):
        relay = figures["producer"]["relay_cost"][timings]["us_per_statement"]
        assert set(relay) == kinds
        assert all(us > 0 for us in relay.values())
    assert "single-row statements each its own transaction" in result.stdout
    assert (tmp_path / "smoke.png").stat().st_size > 1000
    assert "drain of 3,000 events" in result.stdout


@pytest.mark.skipif(
    shutil.which("valgrind") is None,
    reason="valgrind is not installed (Debian package valgrind; .ci/run installs it)",
)
def test_bench_instructions_counts_what_the_relay_adds(tmp_path: Path) -> None:
    result = _bench("instructions", "--quick", "--name", "count", "--out", str(tmp_path))
    counts = orjson.loads((tmp_path / "count.json").read_bytes())["instructions"]
    per_statement = counts["thousand_instructions_per_statement"]
    assert set(per_statement) == {
        f"{kind}_{table}"
        for kind in ("insert", "update")
        for table in ("untracked", "tracked", "minimal")
    }
    # Both triggers write a row more than the untracked statement: each adds instructions.
    for kind in ("insert", "update"):
        assert counts["relay_added"][kind] > 0
        assert counts["minimal_trigger_added"][kind] > 0
    assert "relay / minimal trigger" in result.stdout
    assert (tmp_path / "count.png").stat().st_size > 1000
