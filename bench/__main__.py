"""`python -m bench [drain|latency|producer|snapshot|mechanisms|all] [--quick]`,
`python -m bench scale [--quick]`, `python -m bench jetstream [--quick]`,
`python -m bench instructions`,
`python -m bench compare A B` and `python -m bench render RESULT.json`."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from bench import (
    drain,
    instructions,
    jetstream,
    latency,
    mechanisms,
    producer,
    receivers,
    report,
    scale,
    snapshot,
)
from bench.harness import bench_run, execute, machine, produce_calls, progress


def _receivers(value: str) -> tuple[str, ...]:
    try:
        return receivers.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{exc} (known: {', '.join(receivers.RECEIVERS)})"
        ) from None


def _rates(value: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of rates: {value!r}") from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"rates must be positive: {value!r}")
    return rates


def _mechanism_names(value: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in value.split(",") if part.strip())
    unknown = [name for name in names if name not in mechanisms.MECHANISMS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown mechanism(s) {', '.join(unknown) or value!r}"
            f" (known: {', '.join(mechanisms.MECHANISMS)})"
        )
    return names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("drain", "latency", "producer", "snapshot", "mechanisms", "all"):
        p = sub.add_parser(name, help=f"run the {name} benchmark" if name != "all" else "run all")
        p.add_argument("--quick", action="store_true", help="small sizes: a smoke run (< 2 min)")
        p.add_argument("--events", type=int, help="drain backlog size (default 1,000,000)")
        p.add_argument(
            "--rows",
            type=int,
            help="snapshot: rows of the table (default --events, else 1,000,000; quick 100,000)",
        )
        p.add_argument("--batch-size", type=int, default=1000)
        p.add_argument("--rate", type=float, default=1000.0, help="latency: events/s")
        p.add_argument(
            "--rates",
            type=_rates,
            default=latency.COMPARISON_RATES,
            help="latency: the rates serversync and the naive relay are compared at, events/s of"
            " each path (default 100,200,500,1000)",
        )
        p.add_argument(
            "--connections",
            type=int,
            default=latency.COMPARISON_CONNECTIONS,
            help="latency: producer connections of each path in the comparison (default 8)",
        )
        p.add_argument(
            "--seconds",
            type=float,
            help="latency, producer and snapshot (its producers) duration per mode",
        )
        p.add_argument(
            "--poll-interval",
            type=float,
            default=1.0,
            help="latency: poll interval of the poll-only run",
        )
        p.add_argument(
            "--rounds",
            type=int,
            help="drain (its ceiling and HTTP drain), producer, snapshot and --receivers:"
            " interleaved repeats, each figure their median (default 3, quick 2)",
        )
        p.add_argument(
            "--receivers",
            type=_receivers,
            default=(),
            help="drain: also drain a settings-like table's backlog of --events into these"
            " receivers, e.g. generic,mapped (the table-mapping receiver beside the generic one)",
        )
        p.add_argument(
            "--mechanisms",
            type=_mechanism_names,
            default=tuple(mechanisms.MECHANISMS),
            help="mechanisms: which to measure on and off (default all:"
            f" {','.join(mechanisms.MECHANISMS)}); `all --quick` leaves them out",
        )
        report.add_run_arguments(p)
    scale.add_arguments(
        sub.add_parser(
            "scale", help="how a drain's cost grows with the backlog, consumers, payload, tables"
        )
    )
    jetstream.add_arguments(
        sub.add_parser(
            "jetstream",
            help="a JetStream consumer's drain against a nats-py publish loop (3-node cluster)",
        )
    )
    p = sub.add_parser(
        "instructions",
        help="count with callgrind the instructions the relay adds to a single-row statement",
    )
    p.add_argument("--quick", action="store_true", help="short runs: a smoke check")
    p.add_argument("--name", help="result file name (default: timestamp)")
    p.add_argument("--out", type=Path, default=report.RESULTS, help="folder for the JSON and PNG")
    p = sub.add_parser("compare", help="print the differences between two result files")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p = sub.add_parser("render", help="draw a result file's PNG chart again from its JSON")
    p.add_argument("result", type=Path)
    p.add_argument("--png", type=Path, help="where to write it (default: beside the JSON)")
    return parser


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    quick: bool = args.quick
    events = args.events or (100_000 if quick else 1_000_000)
    seconds = args.seconds or (3.0 if quick else 10.0)
    rounds = args.rounds or (2 if quick else 3)
    name = args.name or time.strftime("%Y%m%d-%H%M%S") + ("-quick" if quick else "")
    result: dict[str, Any] = {
        "name": name,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "parameters": {
            "events": events,
            "batch_size": args.batch_size,
            "rate": args.rate,
            "rates": list(args.rates),
            "connections": args.connections,
            "seconds": seconds,
            "poll_interval": args.poll_interval,
            "quick": quick,
            "rounds": rounds,
            "receivers": list(args.receivers),
            "snapshot_rows": args.rows or events,
        },
    }
    async with bench_run(result, private=args.private, keep_logs=args.keep_logs) as env:
        if args.command in ("drain", "all"):
            progress(f"drain: producing {events:,} events through the relay trigger")
            await produce_calls(env.backend, events)
            await execute(env.backend, "VACUUM ANALYZE sync.events_outbox")
            figures: dict[str, Any] = {"events": events, "batch_size": args.batch_size}
            timeout = max(120.0, events / 5_000)
            figures.update(
                await drain.ceiling_and_http_rounds(env, args.batch_size, rounds, timeout)
            )
            progress("drain: (b) plain Python loop")
            figures["python_loop"] = await drain.python_loop(env, args.batch_size)
            progress("drain: (c) Python read-only walk")
            figures["read_walk"] = await drain.read_walk(env, args.batch_size)
            progress("drain: the runtime alone (null sink)")
            figures["product_null"] = await drain.product(env, args.batch_size, "null", timeout)
            http = figures["product_http"]["events_per_sec"]
            figures["ratios"] = {
                "http_to_in_database": figures["share_of_ceiling"],
                "http_to_python_loop": round(http / figures["python_loop"]["events_per_sec"], 3),
                "null_to_in_database": round(
                    figures["product_null"]["events_per_sec"]
                    / figures["in_database"]["events_per_sec"],
                    3,
                ),
                "null_to_read_walk": round(
                    figures["product_null"]["events_per_sec"]
                    / figures["read_walk"]["events_per_sec"],
                    3,
                ),
            }
            result["drain"] = figures
        if args.command in ("latency", "all"):
            runs = []
            for listen in (True, False):
                progress(
                    f"latency: {args.rate:.0f} events/s for {seconds}s, "
                    f"{'NOTIFY' if listen else 'polling only'}"
                )
                runs.append(
                    await latency.run_latency(
                        env,
                        rate=args.rate,
                        seconds=seconds,
                        listen=listen,
                        poll_interval=300.0 if listen else args.poll_interval,
                    )
                )
            result["latency"] = runs
            result["latency_vs_naive"] = await latency.run_comparison(
                env,
                rates=args.rates,
                seconds=seconds,
                connections=args.connections,
                poll_interval=args.poll_interval,
            )
        if args.command in ("producer", "all"):
            result["producer"] = await producer.run_producer(
                env,
                seconds=max(2, round(seconds)),
                rounds=rounds,
                statements=2_000 if args.quick else 20_000,
            )
        if args.command in ("drain", "all") and args.receivers:
            # Last: it empties the outbox and names the backend's node, which the other parts'
            # figures were measured without.
            result["drain"]["receivers"] = await receivers.compare(
                env, events, args.batch_size, rounds, args.receivers
            )
        # Not in a quick `all`: six runs of drain, latency and producers per round would take
        # longer than the smoke run's two minutes.
        if args.command == "mechanisms" or (args.command == "all" and not quick):
            # After the drain and the producers: it adds a backlog of its own to the outbox.
            result["mechanisms"] = await mechanisms.run_mechanisms(
                env,
                events=args.events or (30_000 if quick else 200_000),
                batch_size=args.batch_size,
                seconds=args.seconds or (3.0 if quick else 5.0),
                rounds=rounds,
                mechanisms=args.mechanisms,
            )
        if args.command in ("snapshot", "all"):
            # Last: it empties the outbox before each of its measurements.
            progress(f"snapshot: a table of {args.rows or events:,} rows")
            result["snapshot"] = await snapshot.run_snapshot_bench(
                env, rows=args.rows or events, seconds=max(1, round(seconds)), repeats=rounds
            )
    result["targets"] = report.targets(result)
    path = report.write(result, name, args.out)
    progress(f"wrote {path}")
    return result


def _count_instructions(args: argparse.Namespace) -> dict[str, Any]:
    name = args.name or time.strftime("%Y%m%d-%H%M%S") + "-instructions"
    result: dict[str, Any] = {
        "name": name,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "parameters": {
            "quick": args.quick,
            "server": "private cluster, single-user backends under callgrind",
        },
    }
    result["instructions"] = instructions.run_instructions(quick=args.quick)
    progress(f"wrote {report.write(result, name, args.out)}")
    return result


def _summary(result: dict[str, Any]) -> str:
    lines = []
    if "instructions" in result:
        i = result["instructions"]
        per = i["thousand_instructions_per_statement"]
        lines.append(
            "thousands of instructions per single-row statement, each its own transaction:"
        )
        for kind in producer.KINDS:
            lines.append(
                f"  {kind}: untracked {per[f'{kind}_untracked']}, tracked {per[f'{kind}_tracked']}"
                f" (relay +{i['relay_added'][kind]}), minimal trigger {per[f'{kind}_minimal']}"
                f" (+{i['minimal_trigger_added'][kind]}); relay / minimal trigger"
                f" {i['relay_to_minimal_trigger'][kind]}"
            )
        queue = i.get("pgq") or {}
        if queue.get("measured"):
            lines.append(
                "  PgQ's C trigger: "
                + ", ".join(
                    f"{kind} {queue['thousand_instructions_per_statement'][kind]}"
                    f" (+{queue['added'][kind]}; relay / PgQ {queue['relay_to_pgq_trigger'][kind]})"
                    for kind in producer.KINDS
                )
            )
        elif queue:
            lines.append(f"  PgQ not counted: {queue['note']}")
    if "drain" in result:
        d = result["drain"]
        lines.append(f"drain of {d['events']:,} events, batch {d['batch_size']}:")
        for key, label in (
            ("in_database", "in-database ceiling"),
            ("python_loop", "Python loop"),
            ("read_walk", "Python read-only walk"),
            ("product_http", "frontend-sync (HTTP)"),
            ("product_null", "runtime, null sink"),
        ):
            f = d.get(key)
            if f is None:  # a result file from before this reference existed
                continue
            extra = ""
            if "consumer_peak_rss_mb" in f:
                extra = f"  consumer peak RSS {f['consumer_peak_rss_mb']} MB"
                if f.get("receiver_peak_rss_mb"):
                    extra += f", receiver {f['receiver_peak_rss_mb']} MB"
            if "batches_per_sec" in f:
                extra = f"  {f['batches_per_sec']:,.0f} batches/s" + extra
            lines.append(f"  {label:24} {f['events_per_sec']:>12,.0f} events/s{extra}")
            if f.get("cpu_us_per_event"):
                lines.append(
                    f"  {'':24} CPU us/event: "
                    + ", ".join(f"{k} {v}" for k, v in f["cpu_us_per_event"].items())
                )
        lines.append("  ratios: " + ", ".join(f"{k} {v}" for k, v in d["ratios"].items()))
        if "rounds" in d:
            lines.append(
                f"  ceiling and HTTP in {len(d['rounds'])} interleaved rounds (medians above),"
                " HTTP / ceiling each round: "
                + ", ".join(str(r["share_of_ceiling"]) for r in d["rounds"])
            )
        if "receivers" in d:
            lines.extend(_receivers_summary(d["receivers"]))
    for run in result.get("latency", []):
        lines.append(
            f"latency {run['mode']:9} at {run['achieved_rate']:,.0f}/s: p50 {run['p50_ms']} ms, "
            f"p95 {run['p95_ms']} ms, p99 {run['p99_ms']} ms, max {run['max_ms']} ms"
        )
    if "latency_vs_naive" in result:
        lines.extend(_comparison_summary(result["latency_vs_naive"]))
    if "producer" in result:
        p = result["producer"]
        lines.append(f"producer cost at {p['clients']} connections (tps, ratio to untracked):")
        cpu = p.get("cpu_us_per_tx", {})
        for key, tps in p["tps"].items():
            # A steady mode's tps is its rate's, not a share of the untracked table's.
            ratio = p["ratio_to_untracked"].get(key)
            line = f"  {key:26} {tps:>10,.0f}  " + (
                f"{ratio:.3f}" if ratio is not None else "steady"
            )
            if key in cpu:
                line += "  CPU us/tx: " + ", ".join(f"{k} {v}" for k, v in cpu[key].items())
            lines.append(line)
        if "tracked_to_minimal_trigger" in p:
            lines.append(
                "  tracked (no NOTIFY) against a minimal outbox row trigger: "
                f"{p['tracked_to_minimal_trigger']:.3f}"
            )
        if "bulk_tracked_to_minimal_trigger" in p:
            lines.append(
                f"  {p['bulk_rows_per_statement']}-row statements, tracked (no NOTIFY) against the"
                f" minimal row trigger: {p['bulk_tracked_to_minimal_trigger']:.3f}"
            )
        pgq_info = p.get("pgq")
        if pgq_info is not None and not pgq_info["measured"]:
            lines.append(f"  PgQ not measured: {pgq_info['note']}")
        if p.get("relay_to_pgq"):
            lines.append(
                "  relay / PgQ's C trigger (tps, relay with no consumer against PgQ with none,"
                " with serversync's consumer against PgQ's): "
                + ", ".join(f"{name} {ratio:.3f}" for name, ratio in p["relay_to_pgq"].items())
            )
        steady = p.get("steady") or {}
        if steady.get("relay_to_pgq_cpu"):
            lines.append(
                f"  at a steady {steady['rate_tps']:,} tps ({steady['share_of_untracked']:g} of the"
                " untracked tps), the machine's CPU per transaction, relay / PgQ's C trigger"
                " (below 1.0 the relay costs less): "
                + ", ".join(
                    f"{name} {ratio:.3f}" for name, ratio in steady["relay_to_pgq_cpu"].items()
                )
            )
        cost = p["relay_cost"]
        for timings, said in (
            ("one_transaction", "all in one transaction"),
            ("own_transactions", "each its own transaction"),
        ):
            if timings not in cost:  # results written before the split
                continue
            us, relay = cost[timings]["us_per_statement"], cost[timings]["relay_us_per_row"]
            minimal = cost[timings]["minimal_trigger_us_per_row"]
            lines.append(
                f"relay cost per row, one connection, single-row statements {said} (us): "
                + ", ".join(
                    f"{kind} {us[f'{kind}_untracked']} -> {us[f'{kind}_tracked']} "
                    f"(+{relay[kind]}; minimal trigger +{minimal[kind]})"
                    for kind in producer.KINDS
                )
            )
    if "mechanisms" in result:
        lines.extend(mechanisms.summary(result["mechanisms"]))
    if "snapshot" in result:
        lines.extend(_snapshot_summary(result["snapshot"]))
    if "scale" in result:
        lines.extend(_scale_summary(result["scale"]))
    if "jetstream" in result:
        lines.extend(jetstream.summary(result["jetstream"]))
    for key, check in result.get("targets", {}).items():
        mark = "ok  " if check["met"] else "MISS"
        lines.append(f"[{mark}] {key}: {check['measured']} (target {check['target']})")
    return "\n".join(lines)


def _comparison_summary(v: dict[str, Any]) -> list[str]:
    """serversync and the naive relay at each rate: commit -> applied, what each lost, and
    what producing and delivering cost."""
    lines = [
        f"latency against the naive relay (both at once, {v['connections_per_path']} producer"
        f" connections each, {v['seconds']}s per rate; commit -> applied in ms):"
    ]
    if v["consumer_env"]:
        lines.append(
            "  consumer settings: " + ", ".join(f"{k}={x}" for k, x in v["consumer_env"].items())
        )
    for rate in v["rates"]:
        run = v["runs"][latency.rate_key(rate)]
        for path in latency.PATHS:
            f = run[path]
            lines.append(
                f"  {rate:>6,.0f}/s {path:10} p50 {f['p50_ms']}, p95 {f['p95_ms']}, p99"
                f" {f['p99_ms']}, max {f['max_ms']}; achieved {f['achieved_rate']:,.1f}/s,"
                f" lost {f['lost']} of {f['events']:,}"
            )
            cost = f"commit p50 {f['commit_p50_ms']} ms, p99 {f['commit_p99_ms']} ms"
            if f["producer_backend_cpu_us_per_event"] is not None:
                cost += (
                    f"; CPU us/event: producers' backends {f['producer_backend_cpu_us_per_event']},"
                    f" delivery {f['delivery_cpu_us_per_event']}"
                )
            lines.append(f"  {'':19} {cost}")
    return lines


def _receivers_summary(r: dict[str, Any]) -> list[str]:
    """The receivers' drains of one backlog, and each ratio mapped / generic."""
    lines = [
        f"receivers: {r['events']:,} events of {r['rows']:,} {r['entity_type']} rows, median of"
        f" {r['rounds']} interleaved rounds:"
    ]
    for name in r["receivers"]:
        f = r[name]
        lines.append(f"  {name:24} {f['events_per_sec']:>12,.0f} events/s")
        if f["cpu_us_per_event"]:
            lines.append(
                f"  {'':24} CPU us/event: "
                + ", ".join(f"{k} {v}" for k, v in f["cpu_us_per_event"].items())
            )
    if "ratios" in r:
        lines.append("  mapped / generic: " + ", ".join(f"{k} {v}" for k, v in r["ratios"].items()))
    return lines


def _scale_point(label: str, point: dict[str, Any], unit: str = "") -> list[str]:
    """One point of a scale curve: the in-database reference, the null sink and HTTP, with the
    consumer's and PostgreSQL's CPU per event (and MB/s with a payload size)."""
    line = f"  {label:>14}  in-database {point['in_database']['events_per_sec']:>9,.0f}/s"
    for sink in ("null", "http"):
        f = point[sink]
        line += f"  {sink} {f['events_per_sec']:>9,.0f}/s"
        if unit:
            line += f" {f[unit]:,.1f} MB/s"
        if f["consumer_cpu_us_per_event"] is not None:
            line += f" (CPU us/event: consumer {f['consumer_cpu_us_per_event']},"
            line += f" pg {f['postgres_cpu_us_per_event']})"
    return [line]


def _scale_summary(s: dict[str, Any]) -> list[str]:
    """Each scale curve: its points, and the ratio of its last point to its first."""
    lines = []
    if "backlog" in s:
        b = s["backlog"]
        lines.append(f"scale, backlog: drains of the outbox's first {b['window']:,} events:")
        for p in b["points"]:
            lines.extend(_scale_point(f"{p['backlog']:,} events", p))
            timed = p.get("status_and_cleanup") or {}
            if "status" in timed:
                lines.append(
                    f"  {'':>14}  serversync status {timed['status']['report_ms']} ms, cleanup"
                    f" --older-than 30d {timed['cleanup']['seconds']} s (bench/outbox_scale.py)"
                )
            elif "error" in timed:
                lines.append(f"  {'':>14}  status and cleanup failed: {timed['error']}")
        lines.append(
            "  largest / smallest: " + ", ".join(f"{k} {v}" for k, v in b["ratios"].items())
        )
        if "status_and_cleanup" in b:
            lines.append(f"  status and cleanup {b['status_and_cleanup']}")
    if "consumers" in s:
        c = s["consumers"]
        lines.append(
            f"scale, consumers reading the same {c['events_per_consumer']:,} events at once"
            f" ({c['sink']} sink, {c['cpus']} CPUs):"
        )
        for p in c["points"]:
            cpu = p["cpu_us_per_event"]
            slowest, fastest = (
                p["slowest_consumer_events_per_sec"],
                p["fastest_consumer_events_per_sec"],
            )
            lines.append(
                f"  {p['consumers']:>3} together {p['events_per_sec']:>10,.0f} events/s (each"
                f" {slowest:,.0f}..{fastest:,.0f}),"
                f" CPU us/event: consumers {cpu.get('consumers')}, pg"
                f" {cpu.get('postgres backend')}; machine {p['machine_busy_share']:.0%} busy"
                + (" (CPU-bound)" if p["cpu_bound"] else "")
            )
        lines.append(
            "  together / one: "
            + ", ".join(f"{k} {v}" for k, v in c["ratios"].items())
            + "; events per CPU second / one's: "
            + ", ".join(f"{k} {v}" for k, v in c["cpu_efficiency"].items())
        )
    if "payload" in s:
        lines.append("scale, payload size:")
        for p in s["payload"]["points"]:
            lines.extend(_scale_point(f"{p['bytes_per_event']:,.0f} B/event", p, "mb_per_sec"))
    if "tables" in s:
        t = s["tables"]
        lines.append(f"scale, {t['events']:,} events across tracked tables:")
        for p in t["points"]:
            lines.extend(_scale_point(f"{p['tables']} tables", p))
        lines.append(
            "  most / fewest tables: " + ", ".join(f"{k} {v}" for k, v in t["ratios"].items())
        )
    return lines


def _largest(shares: dict[str, float], count: int) -> list[tuple[str, float]]:
    """The `count` largest shares, largest first (a result file keeps its keys sorted by name)."""
    return sorted(shares.items(), key=lambda item: -item[1])[:count]


def _snapshot_summary(s: dict[str, Any]) -> list[str]:
    """The snapshot against COPY of the same rows, and the producers alone and during one."""
    reads = s["reads"]
    lines = [
        f"snapshot of a table of {s['rows']:,} rows ({s['row_bytes']} bytes each, {s['json_bytes']}"
        f" as JSON), median of {s['repeats']} interleaved repeats:"
    ]
    for key in snapshot.READS:
        f = reads[key]
        line = f"  {snapshot.LABELS[key]:24} {f['rows_per_sec']:>12,.0f} rows/s"
        if "outbox_bytes_per_row" in f:
            line += f"  outbox {f['outbox_bytes_per_row']:,.0f} B/row"
        line += f"  WAL {f['wal_bytes_per_row']:,.0f} B/row"
        lines.append(line)
        if f.get("cpu_us_per_row"):
            lines.append(
                f"  {'':24} CPU us/row: "
                + ", ".join(f"{k} {v}" for k, v in f["cpu_us_per_row"].items())
            )
    lines.append("  ratios: " + ", ".join(f"{k} {v}" for k, v in reads["ratios"].items()))
    p = s["producers"]
    lines.append(
        f"producers (single-row UPDATEs of the table, {p['clients']} connections, {p['seconds']}s)"
        " alone and while snapshots run:"
    )
    for key in ("alone", "during_snapshot", "during_paced_snapshot"):
        f = p[key]
        lines.append(
            f"  {key.replace('_', ' '):24} {f['tps']:>12,.0f} tps  latency avg"
            f" {f['latency_avg_ms']} ms, p50 {f['latency_p50_ms']} ms, p99 {f['latency_p99_ms']} ms"
        )
        lines.append(
            f"  {'':24} statements' time: "
            + ", ".join(f"{event} {share}" for event, share in _largest(f["waits"], 5))
        )
    lines.append(
        f"  tps during / alone: {p['tps_during_to_alone']}; the snapshot under that load:"
        f" {p['during_snapshot']['snapshot_rows_per_sec']:,.0f} rows/s"
    )
    lines.append(
        f"  tps during a snapshot paced at {p['paced_rate']:,.0f} rows/s / alone:"
        f" {p['tps_during_paced_to_alone']}; the snapshot:"
        f" {p['during_paced_snapshot']['snapshot_rows_per_sec']:,.0f} rows/s"
    )
    return lines


def main() -> int:
    """Entry point."""
    args = _parser().parse_args()
    if args.command == "compare":
        print(report.compare(args.a, args.b))
        return 0
    if args.command == "render":
        try:
            print(report.render(args.result, args.png))
        except RuntimeError as exc:
            print(f"python -m bench render: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.command == "scale":
        result = asyncio.run(scale.run(args))
        print(_summary(result))
        return 0
    if args.command == "jetstream":
        try:
            result = asyncio.run(jetstream.run(args))
        except jetstream.NoNatsServerError as exc:
            print(f"python -m bench jetstream: {exc}", file=sys.stderr)
            return 2
        print(_summary(result))
        return 0
    if args.command == "instructions":
        try:
            result = _count_instructions(args)
        except instructions.NoValgrindError as exc:
            print(f"python -m bench instructions: {exc}", file=sys.stderr)
            return 2
        print(_summary(result))
        return 0
    result = asyncio.run(_run(args))
    print(_summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
