"""The benchmark end to end at tiny sizes: not a test of speed, but of what a reader of its result
relies on. Every measurement stands beside the references it is judged against, the ratios and
the derived figures say what the raw figures say, percentiles are ordered, every mode the run
was set up for is there (each with as many runs as rounds were asked for), each target reports
the figure it names, and the summary and the chart are written.

Both runs take minutes: they are marked `slow` (deselect with `-m "not slow"`; `make test` and
.ci/run run them)."""

from __future__ import annotations

import math
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from bench.harness import server_is_local
from bench.pgq import TICK_EVERY_SEC
from bench.producer import (
    BULK_MODES,
    DURABLE_MODES,
    KINDS,
    MODES,
    RELAY_COST_TABLES,
    RELAY_VS_PGQ,
    RELAY_VS_PGQ_STEADY,
    SESSION_PARTS,
    STEADY_MODES,
    STEADY_SHARE,
)
from bench.receivers import RATIOS, RECEIVER_PARTS, RECEIVERS
from bench.snapshot import LABELS as SNAPSHOT_LABELS
from bench.snapshot import RATIOS as SNAPSHOT_RATIOS
from bench.snapshot import READS as SNAPSHOT_READS_MEASURED
from bench.snapshot import SNAPSHOT_READS
from consumer.app import jetstream_kind
from consumer.devtools.devdb import Server
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

# The drain's references, each a way to move the same backlog without serversync, and the
# product's two runs measured against them.
DRAIN_REFERENCES = ("in_database", "python_loop", "read_walk")
DRAIN_PRODUCT = ("product_http", "product_null")
# Each drain ratio: (numerator, denominator) of events_per_sec.
DRAIN_RATIOS = {
    "http_to_in_database": ("product_http", "in_database"),
    "http_to_python_loop": ("product_http", "python_loop"),
    "null_to_in_database": ("product_null", "in_database"),
    "null_to_read_walk": ("product_null", "read_walk"),
}


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


def assert_ratio(ratio: float, numerator: float, denominator: float, what: str) -> None:
    """A ratio the result rounds (to 3 places, from figures it rounds to 1 or 2) is the quotient
    of the figures it reports."""
    assert denominator > 0, what
    assert math.isclose(ratio, numerator / denominator, rel_tol=0.01, abs_tol=0.002), (
        what,
        ratio,
        numerator,
        denominator,
    )


def assert_difference(added: float, minuend: float, subtrahend: float, what: str) -> None:
    """An 'added' figure is the difference of the two figures it reports (each rounded)."""
    assert math.isclose(added, minuend - subtrahend, abs_tol=0.11), (
        what,
        added,
        minuend,
        subtrahend,
    )


def check_drain(drain: dict[str, Any], parameters: dict[str, Any]) -> None:
    """Every reference and product run drained the whole backlog, at the rate its events and
    seconds give, and each ratio is the quotient of the two rates it names."""
    assert (drain["events"], drain["batch_size"]) == (parameters["events"], 1000)
    for key in (*DRAIN_REFERENCES, *DRAIN_PRODUCT):
        figures = drain[key]
        assert figures["events"] == parameters["events"], key
        assert figures["seconds"] > 0, key
        assert math.isclose(
            figures["events_per_sec"], figures["events"] / figures["seconds"], rel_tol=1e-6
        ), key
        cpu = figures.get("cpu_us_per_event") or {}
        if cpu:  # the total is the sum of the parts (each rounded to 0.01 us)
            parts = [v for part, v in cpu.items() if part != "total"]
            assert math.isclose(cpu["total"], sum(parts), abs_tol=0.01 * len(parts) + 0.01), (
                key,
                cpu,
            )
    assert set(drain["ratios"]) == set(DRAIN_RATIOS)
    for name, (top, bottom) in DRAIN_RATIOS.items():
        assert_ratio(
            drain["ratios"][name],
            drain[top]["events_per_sec"],
            drain[bottom]["events_per_sec"],
            name,
        )
    assert (drain["product_http"]["sink"], drain["product_null"]["sink"]) == ("http", "null")
    assert drain["product_http"]["consumer_peak_rss_mb"] > 0
    assert drain["product_http"]["receiver_peak_rss_mb"] > 0
    assert drain["product_null"]["receiver_peak_rss_mb"] is None  # no receiver runs
    # Where the CPU went: the references always say it (the product only when its drain spans
    # more than one poll, which 3,000 events may not).
    assert {"python", "postgres backend", "total"} <= set(drain["python_loop"]["cpu_us_per_event"])


def check_receivers(receivers: dict[str, Any], parameters: dict[str, Any]) -> None:
    """The table-mapping receiver drained the same backlog as the generic one, round for round;
    each receiver's figure is the median of its rounds, and each ratio, mapped over generic, is
    the quotient of the two medians it names."""
    assert receivers["receivers"] == list(RECEIVERS) == parameters["receivers"]
    assert (receivers["events"], receivers["rounds"]) == (
        parameters["events"],
        parameters["rounds"],
    )
    for name in RECEIVERS:
        runs = receivers["runs"][name]
        assert len(runs) == parameters["rounds"], name
        assert all(run["events"] == parameters["events"] for run in runs), name
        figures = receivers[name]
        assert math.isclose(
            figures["events_per_sec"],
            statistics.median(run["events_per_sec"] for run in runs),
            abs_tol=0.051,
        ), name
        cpu = figures["cpu_us_per_event"]
        if cpu:  # the receiving side is the sum of its parts in every round
            for run in runs:
                side = sum(run["cpu_us_per_event"].get(part, 0.0) for part in RECEIVER_PARTS)
                assert math.isclose(run["cpu_us_per_event"]["receiver side"], side, abs_tol=0.011)
    generic, mapped = receivers["generic"], receivers["mapped"]
    assert set(receivers["ratios"]) == set(RATIOS)
    assert_ratio(
        receivers["ratios"]["events_per_sec"],
        mapped["events_per_sec"],
        generic["events_per_sec"],
        "events_per_sec",
    )
    for name, parts in RATIOS.items():
        ratio = receivers["ratios"][name]
        if parts is None or ratio is None:  # CPU unmeasured: a drain within one poll
            continue
        top = sum(mapped["cpu_us_per_event"][part] for part in parts)
        bottom = sum(generic["cpu_us_per_event"][part] for part in parts)
        assert_ratio(ratio, top, bottom, name)
    assert len(receivers["round_ratios"]) == parameters["rounds"]


def check_latency(runs: list[dict[str, Any]], parameters: dict[str, Any]) -> None:
    """One run with NOTIFY and one polling only, each of every event committed, with ordered
    percentiles; the polling run polled at the interval asked for."""
    by_mode = {run["mode"]: run for run in runs}
    assert sorted(by_mode) == ["notify", "poll-only"]
    assert len(runs) == 2
    for mode, run in by_mode.items():
        assert run["target_rate"] == parameters["rate"], mode
        assert run["events"] == int(parameters["rate"] * parameters["seconds"]), mode
        assert run["achieved_rate"] > 0, mode
        assert 0 <= run["p50_ms"] <= run["p95_ms"] <= run["p99_ms"] <= run["max_ms"], run
    assert by_mode["poll-only"]["poll_interval_sec"] == parameters["poll_interval"]


def check_producer(producer: dict[str, Any], parameters: dict[str, Any]) -> None:
    """Every mode the run was set up for, with one run per round; the median of the runs; each
    ratio the quotient of its mode's tps and its block's untracked tps; the relay's cost per row
    the difference of the statements' times it reports; the steady modes at half the untracked
    tps, the relay against PgQ there the quotient of the two modes' CPU per transaction."""
    modes = [*MODES, *BULK_MODES, *STEADY_MODES]
    if parameters["server"] == "private cluster":  # durable settings need a cluster of its own
        modes += DURABLE_MODES
    if not producer["pgq"]["measured"]:  # a server without PgQ's extension
        modes = [mode for mode in modes if mode.pgq is None]
    names = {mode.name for mode in modes}
    assert producer["rounds"] == parameters["rounds"]
    assert set(producer["tps"]) == names
    assert set(producer["tps_runs"]) == names
    steady = {mode.name for mode in STEADY_MODES}
    assert set(producer["ratio_to_untracked"]) == names - steady
    assert set(producer["cpu_us_per_tx"]) == names
    tps = producer["tps"]
    for name in names:
        runs = producer["tps_runs"][name]
        assert len(runs) == parameters["rounds"], name
        assert all(run > 0 for run in runs), (name, runs)
        assert math.isclose(tps[name], statistics.median(runs), abs_tol=0.051), (name, runs)
        base = next(
            (f"{block}untracked" for block in ("durable_", "bulk_") if name.startswith(block)),
            "untracked",
        )
        if name not in steady:
            assert_ratio(producer["ratio_to_untracked"][name], tps[name], tps[base], name)
        cpu = producer["cpu_us_per_tx"][name]
        assert {"postgres", "pgbench", "total", "steal"} <= set(cpu), (name, cpu)
        assert cpu["total"] > 0, (name, cpu)
        # A consumer's CPU is reported only where a consumer runs.
        mode = next(mode for mode in modes if mode.name == name)
        if mode.consumer is None:
            assert "consumer" not in cpu, (name, cpu)
    rate = producer["steady"]["rate_tps"]
    assert rate == max(100, round(STEADY_SHARE * tps["untracked"] / 100) * 100)
    assert producer["steady"]["share_of_untracked"] == STEADY_SHARE
    ratios = producer["steady"]["relay_to_pgq_cpu"]
    assert set(ratios) == (set(RELAY_VS_PGQ_STEADY) if producer["pgq"]["measured"] else set())
    for setting, ratio in ratios.items():
        relay, queue = RELAY_VS_PGQ_STEADY[setting]
        cpu = producer["cpu_us_per_tx"]
        assert_ratio(ratio, cpu[relay]["total"], cpu[queue]["total"], setting)
    assert_ratio(
        producer["tracked_to_minimal_trigger"],
        tps["tracked_no_notify"],
        tps["minimal_trigger"],
        "tracked_to_minimal_trigger",
    )
    assert_ratio(
        producer["bulk_tracked_to_minimal_trigger"],
        tps["bulk_tracked_no_notify"],
        tps["bulk_minimal_trigger"],
        "bulk_tracked_to_minimal_trigger",
    )
    cost = producer["relay_cost"]
    kinds = {f"{kind}_{table}" for kind in KINDS for table in RELAY_COST_TABLES}
    for timings in ("one_transaction", "own_transactions"):
        figures = cost[timings]
        us = figures["us_per_statement"]
        assert set(us) == kinds, timings
        assert all(value > 0 for value in us.values()), (timings, us)
        for name, runs in figures["us_per_statement_runs"].items():
            assert len(runs) == cost["rounds"], (timings, name)
            assert math.isclose(us[name], statistics.median(runs), abs_tol=0.006), (timings, name)
        for kind in KINDS:
            for added, table in (
                ("relay_us_per_row", "tracked"),
                ("minimal_trigger_us_per_row", "minimal"),
            ):
                assert_difference(
                    figures[added][kind],
                    us[f"{kind}_{table}"],
                    us[f"{kind}_untracked"],
                    f"{timings} {added} {kind}",
                )


def check_targets(result: dict[str, Any]) -> None:
    """Each target reports the very figure it names, and says met when that figure meets it."""
    targets = result["targets"]
    drain, producer = result["drain"], result["producer"]
    ratios = producer["ratio_to_untracked"]
    by_mode = {run["mode"]: run for run in result["latency"]}
    measured = {
        "drain_http_events_per_sec": round(drain["product_http"]["events_per_sec"]),
        "drain_null_sink_events_per_sec": round(drain["product_null"]["events_per_sec"]),
        "drain_http_vs_python_loop": drain["ratios"]["http_to_python_loop"],
        "drain_http_share_of_ceiling": drain["ratios"]["http_to_in_database"],
        "drain_null_sink_share_of_ceiling": drain["ratios"]["null_to_in_database"],
        "drain_null_sink_vs_read_walk": drain["ratios"]["null_to_read_walk"],
        "consumer_peak_rss_mb": drain["product_http"]["consumer_peak_rss_mb"],
        "latency_p99_ms_notify": by_mode["notify"]["p99_ms"],
        "latency_max_ms_poll_only": by_mode["poll-only"]["max_ms"],
        "producer_tracked_wakeups_on_ratio": ratios["tracked_wakeups_on"],
    }
    side = drain["receivers"]["ratios"]["receiver_side_cpu"]
    if side is not None:  # judged on the CPU ratio the comparison reports
        measured["drain_mapped_receiver_cpu_vs_generic"] = side
    assert set(measured) <= set(targets), sorted(targets)
    for name, figure in measured.items():
        assert math.isclose(targets[name]["measured"], figure, abs_tol=0.0015), (name, targets)
    met = {
        "drain_http_vs_python_loop": measured["drain_http_vs_python_loop"] >= 1.0,
        "drain_http_share_of_ceiling": measured["drain_http_share_of_ceiling"] >= 0.75,
        "consumer_peak_rss_mb": measured["consumer_peak_rss_mb"] <= 100,
        "latency_p99_ms_notify": measured["latency_p99_ms_notify"] < 10,
        "latency_max_ms_poll_only": measured["latency_max_ms_poll_only"]
        <= poll_only_bound(by_mode["poll-only"]),
        "producer_tracked_wakeups_on_ratio": measured["producer_tracked_wakeups_on_ratio"] >= 0.75,
    }
    for name, expected in met.items():
        assert targets[name]["met"] is expected, (name, targets[name])
    for name, check in targets.items():
        assert isinstance(check["target"], str) and check["target"], name


def poll_only_bound(run: dict[str, Any]) -> float:
    """The polling run's latency bound: its poll interval and 100 ms."""
    return float(run["poll_interval_sec"]) * 1000 + 100


def test_bench_all_reports_each_figure_beside_its_references(tmp_path: Path) -> None:
    result = _bench(
        *("all", "--quick", "--events", "3000", "--seconds", "1", "--rounds", "1"),
        *("--rate", "100", "--poll-interval", "0.3", "--name", "smoke", "--out", str(tmp_path)),
        *("--receivers", "generic,mapped"),
    )
    logs = re.search(r"logs in (\S+)", result.stderr)
    assert logs is not None, result.stderr[-3000:]
    assert not Path(logs.group(1)).exists(), "a run that succeeded leaves no logs behind"
    figures = orjson.loads((tmp_path / "smoke.json").read_bytes())
    parameters = figures["parameters"]
    assert figures["name"] == "smoke"
    assert {key: parameters[key] for key in ("events", "rate", "seconds", "poll_interval")} == {
        "events": 3000,
        "rate": 100.0,
        "seconds": 1.0,
        "poll_interval": 0.3,
    }
    assert (parameters["quick"], parameters["rounds"]) == (True, 1)
    assert {"python", "postgres", "cpus", "git_ref"} <= set(figures["machine"])
    check_drain(figures["drain"], parameters)
    check_receivers(figures["drain"]["receivers"], parameters)
    check_latency(figures["latency"], parameters)
    check_producer(figures["producer"], parameters)
    check_targets(figures)

    # The summary a reader sees says the same.
    out = result.stdout
    assert "drain of 3,000 events" in out
    assert "CPU us/event" in out
    receivers = figures["drain"]["receivers"]
    assert f"receivers: 3,000 events of {receivers['rows']:,} bench_setting rows" in out
    assert (
        "  mapped / generic: "
        + ", ".join(f"{name} {ratio}" for name, ratio in receivers["ratios"].items())
        in out
    )
    for run in figures["latency"]:
        assert f"p99 {run['p99_ms']} ms" in out, run
    for name, ratio in figures["producer"]["ratio_to_untracked"].items():
        assert re.search(rf"^  {name} +[\d,.]+  {ratio:.3f}", out, re.MULTILINE), name
    assert "against a minimal outbox row trigger" in out
    assert "100-row statements, tracked (no NOTIFY)" in out
    assert "single-row statements each its own transaction" in out
    for name, check in figures["targets"].items():
        mark = "ok  " if check["met"] else "MISS"
        assert f"[{mark}] {name}: {check['measured']}" in out, name
    assert (tmp_path / "smoke.png").stat().st_size > 1000


def _has_pgq(server: Server) -> bool:
    """Whether the server the bench measures on (the one the tests found, by the same rules) has
    PgQ's extension."""
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT EXISTS (SELECT FROM pg_available_extensions WHERE name = 'pgq')"
        ).fetchone()
    return bool(row and row[0])


def test_bench_producer_measures_pgq_beside_the_relay(tmp_path: Path, pg_server: Server) -> None:
    if not _has_pgq(pg_server):
        pytest.skip(
            "the server has no pgq extension (Debian package postgresql-15-pgq3; .ci/run"
            " installs it): the bench leaves PgQ out"
        )
    result = _bench(
        # Three seconds: windows of two inside each run split its CPU by sessions.
        *("producer", "--quick", "--seconds", "3", "--rounds", "1"),
        *("--name", "pgq", "--out", str(tmp_path)),
    )
    figures = orjson.loads((tmp_path / "pgq.json").read_bytes())
    producer = figures["producer"]
    assert producer["pgq"] == {"measured": True, "note": None, "tick_every_sec": TICK_EVERY_SEC}
    # Every PgQ mode ran in the same rounds as the relay's, with its figures checked as theirs.
    pgq_modes = {mode.name: mode for mode in [*MODES, *BULK_MODES] if mode.pgq is not None}
    assert set(pgq_modes) == {queue for _, queue in RELAY_VS_PGQ.values()}
    assert pgq_modes.keys() <= producer["tps"].keys()
    check_producer(producer, figures["parameters"])
    # PgQ's ticker runs beside every PgQ mode, its consumer too where one is measured; their CPU
    # is reported apart from PostgreSQL's, as serversync's consumer's is.
    for name, mode in pgq_modes.items():
        part = "pgq_consumer" if mode.pgq == "consumer" else "pgq_ticker"
        assert producer["cpu_us_per_tx"][name][part] >= 0, (name, producer["cpu_us_per_tx"][name])
    # PostgreSQL's CPU split by sessions (on a server on this machine, whose processes the bench
    # reads): the producers' backends in every mode, a consumer's sessions where serversync's or
    # PgQ's consumer reads, none where only pgbench runs (PgQ's ticker alone may stay below the
    # clock's 10 ms resolution in so short a window).
    all_modes = {mode.name: mode for mode in [*MODES, *BULK_MODES, *STEADY_MODES, *DURABLE_MODES]}
    split = server_is_local(pg_server.dsn)
    for name, cpu in producer["cpu_us_per_tx"].items():
        if not split:
            assert not set(SESSION_PARTS) & set(cpu), (name, cpu)
            continue
        assert set(SESSION_PARTS) <= set(cpu), (name, cpu)
        assert cpu["postgres_producers"] > 0, (name, cpu)
        mode = all_modes[name]
        if mode.pgq == "consumer" or (mode.pgq is None and mode.consumer is not None):
            assert cpu["postgres_consumer"] > 0, (name, cpu)
        elif mode.pgq is None:
            assert cpu["postgres_consumer"] == 0, (name, cpu)
    # The relay over PgQ in each setting is the quotient of the two modes' tps.
    tps = producer["tps"]
    assert set(producer["relay_to_pgq"]) == set(RELAY_VS_PGQ)
    for setting, (relay, queue) in RELAY_VS_PGQ.items():
        assert_ratio(producer["relay_to_pgq"][setting], tps[relay], tps[queue], setting)

    # A target for each setting, reporting that ratio, met when the relay is at least as fast.
    targets = figures["targets"]
    for setting, ratio in producer["relay_to_pgq"].items():
        check = targets[f"producer_relay_vs_pgq_{setting}"]
        assert check["measured"] == ratio, setting
        assert check["met"] is (ratio >= 1.0), setting

    # The summary a reader sees says the same.
    out = result.stdout
    for name in pgq_modes:
        ratio = producer["ratio_to_untracked"][name]
        assert re.search(rf"^  {name} +[\d,.]+  {ratio:.3f}", out, re.MULTILINE), name
    assert "relay / PgQ's C trigger" in out
    for setting, ratio in producer["relay_to_pgq"].items():
        assert f"{setting} {ratio:.3f}" in out, setting
    steady_line = next(line for line in out.splitlines() if "at a steady" in line)
    assert f"at a steady {producer['steady']['rate_tps']:,} tps" in steady_line
    for setting, ratio in producer["steady"]["relay_to_pgq_cpu"].items():
        assert f"{setting} {ratio:.3f}" in steady_line, setting
    for name, check in targets.items():
        mark = "ok  " if check["met"] else "MISS"
        assert f"[{mark}] {name}: {check['measured']}" in out, name
    assert "PgQ not measured" not in out
    assert (tmp_path / "pgq.png").stat().st_size > 1000


@pytest.mark.skipif(
    shutil.which("valgrind") is None,
    reason="valgrind is not installed (Debian package valgrind; .ci/run installs it)",
)
def test_bench_instructions_counts_what_the_relay_adds(tmp_path: Path) -> None:
    result = _bench("instructions", "--quick", "--name", "count", "--out", str(tmp_path))
    counts = orjson.loads((tmp_path / "count.json").read_bytes())["instructions"]
    per_statement = counts["thousand_instructions_per_statement"]
    assert set(per_statement) == {
        f"{kind}_{table}" for kind in KINDS for table in ("untracked", "tracked", "minimal")
    }
    assert all(count > 0 for count in per_statement.values()), per_statement
    assert counts["statements"] > 0
    # Both triggers write a row more than the untracked statement: each adds instructions, and
    # what each adds is the difference of the counts reported beside it.
    for kind in KINDS:
        relay, minimal = counts["relay_added"][kind], counts["minimal_trigger_added"][kind]
        assert relay > 0
        assert minimal > 0
        untracked = per_statement[f"{kind}_untracked"]
        assert_difference(relay, per_statement[f"{kind}_tracked"], untracked, kind)
        assert_difference(minimal, per_statement[f"{kind}_minimal"], untracked, kind)
        assert math.isclose(
            counts["relay_to_minimal_trigger"][kind], relay / minimal, abs_tol=0.006
        ), kind
        assert f"relay +{relay}" in result.stdout, kind
    assert "relay / minimal trigger" in result.stdout
    assert (tmp_path / "count.png").stat().st_size > 1000


def check_snapshot(snapshot: dict[str, Any], rows: int, repeats: int) -> None:
    """Every way of reading the table read all of its rows, at the rate its rows and seconds
    give; each snapshot wrote exactly one outbox row per table row; each ratio is the quotient
    of the two rates it names; the producers ran alone and beside a snapshot that wrote rows."""
    assert (snapshot["rows"], snapshot["repeats"]) == (rows, repeats)
    assert snapshot["row_bytes"] > 0
    reads = snapshot["reads"]
    for key in SNAPSHOT_READS_MEASURED:
        figures = reads[key]
        assert figures["rows"] == rows, key
        assert figures["seconds"] > 0, key
        assert figures["rows_per_sec"] > 0, key
        assert math.isclose(figures["rows_per_sec"], rows / figures["seconds"], rel_tol=0.001), key
        assert len(figures["rows_per_sec_runs"]) == repeats, key
        assert figures["cpu_us_per_row"]["total"] >= 0, key
    for key in SNAPSHOT_READS:
        figures = reads[key]
        assert figures["outbox_rows"] == rows, key
        assert figures["outbox_rows_runs"] == [rows] * repeats, key
        assert figures["outbox_bytes_per_row"] > 0, key
        assert figures["wal_bytes_per_row"] > 0, key
    assert set(reads["ratios"]) == set(SNAPSHOT_RATIOS)
    for name, (top, bottom) in SNAPSHOT_RATIOS.items():
        assert_ratio(
            reads["ratios"][name], reads[top]["rows_per_sec"], reads[bottom]["rows_per_sec"], name
        )
    producers = snapshot["producers"]
    alone, during = producers["alone"], producers["during_snapshot"]
    paced = producers["during_paced_snapshot"]
    for figures in (alone, during, paced):
        assert figures["tps"] > 0
        assert figures["transactions"] > 0
        assert 0 < figures["latency_p50_ms"] <= figures["latency_p99_ms"], figures
        assert figures["latency_avg_ms"] > 0
        assert figures["waits"], figures  # the producers' statements were sampled
    for figures in (during, paced):
        assert figures["snapshot_rows"] > 0
        assert figures["snapshot_rows_per_sec"] > 0
    # Paced, the snapshot keeps to its rate (a chunk may run ahead of it by its own rows).
    assert paced["snapshot_rows_per_sec"] <= producers["paced_rate"] * 1.2, paced
    assert {name: len(runs) for name, runs in producers["tps_runs"].items()} == {
        "alone": repeats,
        "during_snapshot": repeats,
        "during_paced_snapshot": repeats,
    }
    assert_ratio(producers["tps_during_to_alone"], during["tps"], alone["tps"], "during / alone")
    assert_ratio(
        producers["tps_during_paced_to_alone"], paced["tps"], alone["tps"], "paced / alone"
    )


def test_bench_snapshot_reports_the_snapshot_beside_copy_and_producers(tmp_path: Path) -> None:
    result = _bench(
        *("snapshot", "--quick", "--rows", "5000", "--seconds", "1", "--rounds", "1"),
        *("--name", "snap", "--out", str(tmp_path)),
    )
    figures = orjson.loads((tmp_path / "snap.json").read_bytes())
    assert figures["parameters"]["snapshot_rows"] == 5000
    assert "drain" not in figures and "producer" not in figures  # the snapshot part alone
    snapshot = figures["snapshot"]
    check_snapshot(snapshot, 5000, 1)

    # Its targets report the ratios they name, and say met when the ratio meets them.
    targets = figures["targets"]
    ratio = snapshot["reads"]["ratios"]["snapshot_to_copy"]
    assert targets["snapshot_vs_copy_rows_per_sec"]["measured"] == ratio
    assert targets["snapshot_vs_copy_rows_per_sec"]["met"] is (ratio >= 0.2)
    # The producers' figures are reported, with no target.
    assert not [name for name in targets if "producer" in name and name.startswith("snapshot")]

    # The summary a reader sees says the same.
    out = result.stdout
    assert "snapshot of a table of 5,000 rows" in out
    for key, label in SNAPSHOT_LABELS.items():
        rate = snapshot["reads"][key]["rows_per_sec"]
        assert re.search(rf"^  {re.escape(label)} +{rate:,.0f} rows/s", out, re.MULTILINE), key
    producers = snapshot["producers"]
    assert f"tps during / alone: {producers['tps_during_to_alone']}" in out
    assert f"/ alone: {producers['tps_during_paced_to_alone']}" in out
    for name, check in targets.items():
        mark = "ok  " if check["met"] else "MISS"
        assert f"[{mark}] {name}: {check['measured']}" in out, name
    assert (tmp_path / "snap.png").stat().st_size > 1000


def check_comparison(comparison: dict[str, Any], rates: list[float], seconds: float) -> None:
    """At every rate both paths committed what the rate and seconds give, with ordered
    percentiles; serversync delivered every event it committed, the naive relay delivered or
    lost each of its own; the producers' costs are there (CPU where the server is local)."""
    assert comparison["rates"] == rates
    assert sorted(comparison["runs"]) == sorted(f"{rate:g}" for rate in rates)
    for rate in rates:
        run = comparison["runs"][f"{rate:g}"]
        assert run["target_rate"] == rate
        for path in ("serversync", "naive"):
            figures = run[path]
            assert figures["events"] == int(rate * seconds), (rate, path)
            assert figures["achieved_rate"] > 0, (rate, path)
            ordered = [figures[key] for key in ("p50_ms", "p95_ms", "p99_ms", "max_ms")]
            assert ordered[0] >= 0 and ordered == sorted(ordered), (rate, path, figures)
            assert 0 < figures["commit_p50_ms"] <= figures["commit_p99_ms"], (rate, path, figures)
            assert figures["delivered"] + figures["lost"] == figures["events"], (rate, path)
            assert figures["delivered"] > 0, (rate, path)
            for cost in ("producer_backend_cpu_us_per_event", "delivery_cpu_us_per_event"):
                if comparison["cpu_measured"]:  # a small run may fall within a clock tick
                    assert figures[cost] >= 0, (rate, path, cost)
                else:
                    assert figures[cost] is None, (rate, path, cost)
        assert (run["serversync"]["delivered"], run["serversync"]["lost"]) == (
            run["serversync"]["events"],
            0,
        ), run


def test_bench_latency_compares_serversync_with_the_naive_relay(tmp_path: Path) -> None:
    result = _bench(
        *("latency", "--quick", "--seconds", "1", "--rate", "50", "--rates", "20,50"),
        *("--connections", "2", "--poll-interval", "0.3", "--name", "naive"),
        *("--out", str(tmp_path)),
    )
    figures = orjson.loads((tmp_path / "naive.json").read_bytes())
    parameters = figures["parameters"]
    assert (parameters["rates"], parameters["connections"]) == ([20.0, 50.0], 2)
    comparison = figures["latency_vs_naive"]
    assert (comparison["connections_per_path"], comparison["seconds"]) == (2, 1.0)
    assert comparison["poll_interval_sec"] == 0.3
    check_comparison(comparison, [20.0, 50.0], 1.0)
    check_latency(figures["latency"], parameters)  # the NOTIFY and polling runs stay beside it

    # Each rate's targets report serversync's figure and are met when it is no slower than the
    # naive relay's; one more reports the events serversync lost beside the naive relay's.
    targets = figures["targets"]
    for rate in ("20", "50"):
        run = comparison["runs"][rate]
        for pct in ("p50", "p99"):
            check = targets[f"latency_vs_naive_{pct}_ms_at_{rate}"]
            ours, naive = run["serversync"][f"{pct}_ms"], run["naive"][f"{pct}_ms"]
            assert check["measured"] == ours, (rate, pct)
            assert check["met"] is (ours <= naive), (rate, pct)
            assert f"({naive} ms)" in check["target"], (rate, pct)
    naive_lost = sum(run["naive"]["lost"] for run in comparison["runs"].values())
    lost = targets["latency_vs_naive_lost_events"]
    assert (lost["measured"], lost["met"]) == (0, True)
    assert f"the naive relay lost {naive_lost} of " in lost["target"]

    # The summary a reader sees says the same.
    out = result.stdout
    assert "latency against the naive relay" in out
    for rate, run in comparison["runs"].items():
        for path in ("serversync", "naive"):
            f = run[path]
            assert re.search(
                rf"^ +{rate}/s {path} +p50 {f['p50_ms']}, p95 {f['p95_ms']}, p99 {f['p99_ms']},"
                rf" max {f['max_ms']}; .* lost {f['lost']} of {f['events']}$",
                out,
                re.MULTILINE,
            ), (rate, path)
    for name, check in targets.items():
        mark = "ok  " if check["met"] else "MISS"
        assert f"[{mark}] {name}: {check['measured']}" in out, name
    assert (tmp_path / "naive.png").stat().st_size > 1000


def test_bench_mechanisms_judges_each_setting_on_against_off(tmp_path: Path) -> None:
    result = _bench(
        *("mechanisms", "--quick", "--events", "2000", "--seconds", "1", "--rounds", "2"),
        *("--mechanisms", "linger", "--name", "mechanisms", "--out", str(tmp_path)),
    )
    figures = orjson.loads((tmp_path / "mechanisms.json").read_bytes())
    m = figures["mechanisms"]
    assert (m["rounds"], m["events"], m["keep_gain"]) == (2, 2000, 1.05)
    assert list(m["mechanisms"]) == ["linger"]
    linger = m["mechanisms"]["linger"]
    assert (linger["setting"], linger["off"], linger["on"]) == ("SYNC_LINGER_MS", "0", "5")
    for state in ("off", "on"):
        runs = linger["runs"][state]
        assert len(runs) == 2, state
        for key, median in linger["medians"][state].items():
            # Rounded to 3 places.
            expected = statistics.median(run[key] for run in runs)
            assert median == pytest.approx(expected, abs=0.001), key
        medians = linger["medians"][state]
        assert medians["drain_events_per_sec"] > 0
        assert 0 < medians["latency_p50_ms_at_200"] <= medians["latency_p99_ms_at_200"]
        assert medians["producer_tps"] > 0 and medians["producer_paced_tps"] > 0
        assert medians["producer_paced_notifies_per_1000_tx"] >= 0
    # Each judged figure's gain is on/off for rates, off/on for latencies and costs; the
    # verdict rests on the best of them.
    off, on, gains = linger["medians"]["off"], linger["medians"]["on"], linger["gains"]
    assert gains["drain_events_per_sec"] == pytest.approx(
        on["drain_events_per_sec"] / off["drain_events_per_sec"], rel=0.01
    )
    assert gains["latency_p50_ms_at_1000"] == pytest.approx(
        off["latency_p50_ms_at_1000"] / on["latency_p50_ms_at_1000"], rel=0.01
    )
    assert "latency_p99_ms_at_1000" not in gains  # reported, not judged
    best = max(gains.values())
    assert linger["best_gain"]["gain"] == best
    assert linger["pays_for_itself"] is (best >= 1.05)
    check = figures["targets"]["mechanism_pays_for_itself_linger"]
    assert check["met"] is linger["pays_for_itself"]
    mark = "ok  " if check["met"] else "MISS"
    assert f"[{mark}] mechanism_pays_for_itself_linger: {check['measured']}" in result.stdout
    assert (tmp_path / "mechanisms.png").stat().st_size > 1000


def check_jetstream_side(runs: list[dict[str, Any]], median: dict[str, Any], events: int) -> None:
    """Every run of one side moved the whole backlog into its stream, at the rate its events and
    seconds give, its CPU parts adding up to its total; the side's figure is their median."""
    for run in runs:
        assert run["events"] == events
        assert run["stream"]["messages"] == events
        assert math.isclose(run["events_per_sec"], run["events"] / run["seconds"], rel_tol=1e-6)
        cpu = run["cpu_us_per_event"]
        if cpu:  # the product's drain may fall within one poll at this size
            parts = [value for part, value in cpu.items() if part != "total"]
            assert len(parts) == 3, cpu  # the publisher, PostgreSQL, the nats-servers
            assert math.isclose(cpu["total"], sum(parts), abs_tol=0.03), cpu
    assert math.isclose(
        median["events_per_sec"],
        statistics.median(run["events_per_sec"] for run in runs),
        abs_tol=0.051,
    )


def test_bench_jetstream_sets_the_consumer_beside_a_publish_loop(tmp_path: Path) -> None:
    pytest.importorskip("nats", reason="nats-py (the jetstream extra) is not installed")
    from consumer.devtools.nats_cluster import nats_server_binary  # noqa: PLC0415 - needs nats

    if nats_server_binary() is None:
        pytest.skip("no nats-server binary (Debian: apt-get install nats-server)")
    result = _bench(
        *("jetstream", "--events", "3000", "--rounds", "2", "--batch-size", "500"),
        *("--name", "jetstream", "--out", str(tmp_path)),
    )
    logs = re.search(r"logs in (\S+)", result.stderr)
    assert logs is not None, result.stderr[-3000:]
    assert not Path(logs.group(1)).exists(), "a run that succeeded leaves no logs behind"
    figures = orjson.loads((tmp_path / "jetstream.json").read_bytes())
    assert {k: figures["parameters"][k] for k in ("events", "rounds", "batch_size")} == {
        "events": 3000,
        "rounds": 2,
        "batch_size": 500,
    }
    assert figures["machine"]["nats_server"].startswith("nats-server")
    j = figures["jetstream"]
    assert (j["events"], j["rounds"], j["replicas"]) == (3000, 2, 3)
    # Each side goes first in turn; both published the same messages into streams of the same
    # settings (3 replicas, the declaration's defaults).
    assert j["order"] == [["product", "loop"], ["loop", "product"]]
    assert (j["same_messages"], j["same_stream_settings"]) == (True, True)
    settings = j["runs"]["loop"][0]["stream"]["settings"]
    assert (settings["num_replicas"], settings["retention"], settings["storage"]) == (
        3,
        "limits",
        "file",
    )
    assert settings["duplicate_window"] == jetstream_kind.DEFAULT_DUPLICATE_WINDOW_SEC * 10**9
    for side in ("product", "loop"):
        assert len(j["runs"][side]) == 2, side
        check_jetstream_side(j["runs"][side], j[side], 3000)
    assert {"loop", "postgres", "nats-server", "total"} == set(j["loop"]["cpu_us_per_event"])
    # The ratios are the quotients of the figures they name, the target reports the first.
    product, loop = j["product"], j["loop"]
    ratio = j["ratios"]["events_per_sec"]
    assert_ratio(ratio, product["events_per_sec"], loop["events_per_sec"], "events_per_sec")
    if j["ratios"]["cpu_per_event"] is not None:
        assert_ratio(
            j["ratios"]["cpu_per_event"],
            product["cpu_us_per_event"]["total"],
            loop["cpu_us_per_event"]["total"],
            "cpu_per_event",
        )
    for number, pair in enumerate(j["round_ratios"]):
        top, bottom = j["runs"]["product"][number], j["runs"]["loop"][number]
        assert_ratio(pair, top["events_per_sec"], bottom["events_per_sec"], f"round {number}")
    check = figures["targets"]["jetstream_drain_vs_publish_loop"]
    assert (check["measured"], check["met"]) == (ratio, ratio >= 1.0)

    # The summary a reader sees says the same.
    out = result.stdout
    assert "jetstream: a backlog of 3,000 events into a stream of 3 replicas" in out
    assert f"product / loop: events/s {ratio}," in out
    verdict = "met" if check["met"] else "missed"
    assert f"goal: the product >= 1.0x the loop's events/s: {verdict} ({ratio}x)" in out
    mark = "ok  " if check["met"] else "MISS"
    assert f"[{mark}] jetstream_drain_vs_publish_loop: {ratio}" in out
    assert (tmp_path / "jetstream.png").stat().st_size > 1000
