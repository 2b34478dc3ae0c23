"""deploy/ as a sysadmin gets it: the systemd units pass `systemd-analyze verify` and carry the
hardening, the env examples name every setting with its real default, the alert rules pass
`promtool check rules` and their own `promtool test rules` cases, and the dashboard and the alerts
name only metrics the consumers export."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import AliasChoices
from pydantic_settings import BaseSettings

from consumer.app.settings import ConfigError, ReceiverSettings, SyncSettings, load
from tests.conftest import ROOT
from tests.support.metrics import EXPORTED_METRICS

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

DEPLOY = ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
PROMETHEUS = DEPLOY / "prometheus"
ALERTS = PROMETHEUS / "serversync-alerts.yml"
ALERT_TESTS = PROMETHEUS / "serversync-alerts.test.yml"
DASHBOARD = DEPLOY / "grafana" / "serversync-dashboard.json"

INSTALLED_BINARY = "/usr/local/bin/serversync"
TEMPLATE = "serversync@.service"
INSTANCES = ("frontend-sync", "recording-upload")
RECORDINGS_DIR = "/var/lib/serversync/recordings"
RECORDINGS_STORE_DIR = "/var/lib/serversync/store"
EXPECTED_ALERTS = (
    "ServersyncBacklogHigh",
    "ServersyncLagHigh",
    "ServersyncDlqGrowing",
    "ServersyncDeliveryFailing",
    "ServersyncNoLeader",
)
# Settings the env examples document that are not fields of consumer/app/settings.py.
EXTRA_CONSUMER_SETTINGS = frozenset({"OTEL_EXPORTER_OTLP_ENDPOINT"})

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
PROMTOOL = shutil.which("promtool")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (Debian package systemd)"
)
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian package prometheus; .ci/run installs it)",
)


def _run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


# -- systemd -------------------------------------------------------------------------------------

Unit = dict[str, dict[str, list[str]]]
_TRUE = {"yes", "true", "on", "1"}
HARDENING_ON = (
    "NoNewPrivileges",
    "ProtectHome",
    "PrivateTmp",
    "PrivateDevices",
    "ProtectKernelTunables",
    "ProtectKernelModules",
    "ProtectKernelLogs",
    "ProtectControlGroups",
)


def parse_unit(text: str) -> Unit:
    """A unit file as section -> key -> every value given (in order; no continuation lines)."""
    unit: Unit = {}
    section: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"continuation lines are not used here: {line!r}"
        if line.startswith("[") and line.endswith("]"):
            section = unit.setdefault(line[1:-1], {})
            continue
        assert section is not None, f"{line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {line!r}"
        section.setdefault(key.strip(), []).append(value.strip())
    return unit


def unit_file(name: str) -> Unit:
    return parse_unit((SYSTEMD / name).read_text())


def one(unit: Unit, section: str, key: str) -> str:
    values = unit.get(section, {}).get(key, [])
    assert len(values) == 1, f"[{section}] {key}= given {len(values)} times: {values}"
    return values[0]


def seconds(value: str) -> float:
    """A systemd time span as seconds ("30", "30s", "2min", "1h", "1min 30s")."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit]
    assert total > 0, f"not a time span: {value!r}"
    return total


def stage_units(directory: Path) -> Path:
    """Copy deploy/systemd/* into `directory` with ExecStart= pointing at an executable that
    exists here (systemd-analyze checks it), and return the directory."""
    binary = directory / "bin" / "serversync"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    units = directory / "units"
    units.mkdir()
    for source in sorted(SYSTEMD.iterdir()):
        text = source.read_text()
        assert INSTALLED_BINARY in text or source.suffix == ".timer", source.name
        (units / source.name).write_text(text.replace(INSTALLED_BINARY, str(binary)))
    return units


def units_to_verify(units: Path) -> list[Path]:
    paths = [units / TEMPLATE.replace("@", f"@{i}") for i in INSTANCES]
    paths += [p for p in sorted(units.iterdir()) if "@" not in p.name]
    return paths


def verify(paths: list[Path]) -> tuple[int, list[str]]:
    """`systemd-analyze verify`: its exit code and every line it printed about these units.

    A bad value or an unknown key is only a warning (exit code 0), so both count."""
    assert SYSTEMD_ANALYZE is not None
    result = _run(SYSTEMD_ANALYZE, "verify", "--man=no", *map(str, paths))
    ours = {p.name for p in paths} | {TEMPLATE} | {str(paths[0].parent)}
    lines = (result.stdout + result.stderr).splitlines()
    return result.returncode, [line for line in lines if any(name in line for name in ours)]


@needs_systemd_analyze
def test_systemd_analyze_verify_passes_on_every_unit(tmp_path: Path) -> None:
    paths = units_to_verify(stage_units(tmp_path))
    assert {p.name for p in paths} >= {
        "serversync@frontend-sync.service",
        "serversync@recording-upload.service",
        "serversync-ingest.service",
        "serversync-cleanup.service",
        "serversync-cleanup.timer",
    }
    code, problems = verify(paths)
    assert (code, problems) == (0, [])


BROKEN = {  # pattern in the staged template -> replacement
    "ExecStart binary missing": (r"(?m)^ExecStart=\S+", "ExecStart=/nonexistent/serversync"),
    "bad Restart= value": (r"(?m)^Restart=always$", "Restart=sometimes"),
    "key in the wrong section": (r"(?m)^Restart=always$", "Restart=always\nOnCalendar=daily"),
}


@needs_systemd_analyze
@pytest.mark.parametrize("breakage", sorted(BROKEN))
def test_systemd_analyze_verify_catches_a_broken_unit(tmp_path: Path, breakage: str) -> None:
    """The check above can fail: each breakage of the template is caught."""
    units = stage_units(tmp_path)
    pattern, replacement = BROKEN[breakage]
    broken, count = re.subn(pattern, replacement, (units / TEMPLATE).read_text())
    assert count == 1
    (units / TEMPLATE).write_text(broken)
    code, problems = verify([units / "serversync@frontend-sync.service"])
    assert code != 0 or problems, f"systemd-analyze accepted a unit with {breakage}"


def test_the_template_runs_one_consumer_per_instance_hardened() -> None:
    unit = unit_file(TEMPLATE)
    service = unit["Service"]
    assert one(unit, "Service", "ExecStart") == f"{INSTALLED_BINARY} run %i"
    assert one(unit, "Service", "Restart") == "always"
    assert seconds(one(unit, "Service", "RestartSec")) > 0
    assert one(unit, "Service", "User") == "serversync"
    assert service["EnvironmentFile"] == [
        "/etc/serversync/serversync.env",
        "-/etc/serversync/%i.env",  # optional, read last: per-instance values win
    ]
    assert one(unit, "Service", "KillSignal") == "SIGTERM"
    shutdown_default = SyncSettings.model_fields["shutdown_timeout_sec"].default
    assert seconds(one(unit, "Service", "TimeoutStopSec")) > 2 * shutdown_default
    assert RECORDINGS_DIR in [p.lstrip("-") for p in service["ReadWritePaths"]]
    assert "multi-user.target" in unit["Install"]["WantedBy"]


@pytest.mark.parametrize(
    "name", [TEMPLATE, "serversync-ingest.service", "serversync-cleanup.service"]
)
def test_every_service_is_hardened(name: str) -> None:
    unit = unit_file(name)
    for key in HARDENING_ON:
        assert one(unit, "Service", key).lower() in _TRUE, f"{name}: {key}"
    assert one(unit, "Service", "ProtectSystem") == "strict"
    assert set(one(unit, "Service", "RestrictAddressFamilies").split()) == {
        "AF_UNIX",
        "AF_INET",
        "AF_INET6",
    }
    assert one(unit, "Service", "User") == "serversync"
    assert one(unit, "Service", "ExecStart").startswith(f"{INSTALLED_BINARY} ")


def test_the_ingest_server_and_cleanup_units() -> None:
    ingest = unit_file("serversync-ingest.service")
    assert one(ingest, "Service", "ExecStart") == f"{INSTALLED_BINARY} ingest-server"
    assert one(ingest, "Service", "Restart") == "always"
    assert one(ingest, "Service", "EnvironmentFile") == "/etc/serversync/ingest.env"
    assert RECORDINGS_STORE_DIR in ingest["Service"]["ReadWritePaths"]

    cleanup = unit_file("serversync-cleanup.service")
    assert one(cleanup, "Service", "Type") == "oneshot"
    assert one(cleanup, "Service", "ExecStart") == f"{INSTALLED_BINARY} cleanup --older-than 30d"
    assert one(cleanup, "Service", "EnvironmentFile") == "/etc/serversync/serversync.env"
    assert "Install" not in cleanup  # started by the timer only

    timer = unit_file("serversync-cleanup.timer")
    assert one(timer, "Timer", "OnCalendar") == "daily"
    assert one(timer, "Timer", "Persistent").lower() in _TRUE
    assert seconds(one(timer, "Timer", "RandomizedDelaySec")) > 0
    assert one(timer, "Timer", "Unit") == "serversync-cleanup.service"
    assert one(timer, "Install", "WantedBy") == "timers.target"


def exec_start_commands() -> Iterator[tuple[str, list[str]]]:
    for path in sorted(SYSTEMD.glob("*.service")):
        argv = one(parse_unit(path.read_text()), "Service", "ExecStart").split()
        assert argv[0] == INSTALLED_BINARY
        if "%i" in argv:
            for instance in INSTANCES:
                yield path.name, [instance if a == "%i" else a for a in argv[1:]]
        else:
            yield path.name, argv[1:]


@pytest.mark.parametrize(
    ("unit", "args"),
    list(exec_start_commands()),
    ids=lambda v: " ".join(v) if isinstance(v, list) else v,
)
def test_every_exec_start_is_a_command_serversync_accepts(unit: str, args: list[str]) -> None:
    """Each unit's command line parses with the real CLI (`--help` stops before any work)."""
    result = _run(sys.executable, "-m", "consumer", *args, "--help", cwd=ROOT)
    assert result.returncode == 0, f"{unit}: serversync {' '.join(args)}: {result.stderr}"


# -- env examples --------------------------------------------------------------------------------

_ASSIGNMENT = re.compile(r"^(#?)([A-Z][A-Z0-9_]*)=(.*)$")


def env_example(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(set, documented defaults): `NAME=value` lines and commented-out `#NAME=value` lines."""
    active: dict[str, str] = {}
    defaults: dict[str, str] = {}
    for line in path.read_text().splitlines():
        match = _ASSIGNMENT.match(line)
        if match:
            target = defaults if match[1] else active
            assert match[2] not in active and match[2] not in defaults, f"{path}: {match[2]} twice"
            target[match[2]] = match[3]
        else:
            assert not line.strip() or line.startswith("#"), f"{path}: {line!r}"
    return active, defaults


def aliases(model: type[BaseSettings]) -> dict[str, str]:
    """Environment variable -> field name."""
    names: dict[str, str] = {}
    for field, info in model.model_fields.items():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            alias = str(alias.choices[0])
        assert isinstance(alias, str), field
        names[alias] = field
    return names


# What an operator puts in place of the examples' placeholder secret.
REPLACED = {"SYNC_SHARED_SECRET": "0123456789abcdef" * 4}
ENV_EXAMPLES: list[tuple[str, type[BaseSettings], frozenset[str], dict[str, str]]] = [
    (
        "serversync.env.example",
        SyncSettings,
        EXTRA_CONSUMER_SETTINGS,
        {"DATABASE_URL": "postgresql://serversync@db/backend"},
    ),
    (
        "ingest.env.example",
        ReceiverSettings,
        frozenset(),
        {"FRONTEND_DATABASE_URL": "postgresql://frontend@db/frontend"},
    ),
]


@pytest.mark.parametrize(
    ("name", "model", "extra", "required"), ENV_EXAMPLES, ids=[e[0] for e in ENV_EXAMPLES]
)
def test_env_example_lists_every_setting_with_its_default(
    name: str, model: type[BaseSettings], extra: frozenset[str], required: dict[str, str]
) -> None:
    active, defaults = env_example(DEPLOY / name)
    known = aliases(model)
    listed = set(active) | set(defaults)
    assert sorted(set(known) - listed) == [], f"settings {name} does not list"
    assert sorted(extra - listed) == [], f"settings {name} does not list"
    assert sorted(listed - set(known) - extra) == [], f"names in {name} nothing reads"
    for variable, shown in defaults.items():
        if variable not in known:
            continue
        field = known[variable]
        default = model.model_fields[field].default
        if shown == "":
            assert default is None, f"{variable}: shown unset, default {default!r}"
        else:
            value = getattr(load(model, **required, **{variable: shown}), field)
            assert value == default, f"#{variable}={shown} but the default is {default!r}"
    # What the example sets is a valid configuration once its placeholder secret is replaced;
    # left in, the placeholder is refused at start.
    with pytest.raises(ConfigError, match=r"^SYNC_SHARED_SECRET: the secret is the example's"):
        load(model, **{**required, **active})
    load(model, **{**required, **active, **REPLACED})


def test_consumer_examples_and_units_agree() -> None:
    active, _ = env_example(DEPLOY / "serversync.env.example")
    assert {"DATABASE_URL", "FRONTEND_BASE_URL", "SYNC_SHARED_SECRET"} <= set(active)
    assert active["RECORDINGS_DIR"] == RECORDINGS_DIR  # what the template may write to
    ingest, _ = env_example(DEPLOY / "ingest.env.example")
    assert ingest["RECORDINGS_STORE_DIR"] == RECORDINGS_STORE_DIR
    assert ingest["SYNC_SHARED_SECRET"] == active["SYNC_SHARED_SECRET"]  # the same placeholder

    ports = {}
    for instance in INSTANCES:
        own, _ = env_example(DEPLOY / "instances" / f"{instance}.env.example")
        ports[instance] = int(own["SYNC_HTTP_PORT"])
        load(SyncSettings, **{**active, **REPLACED, **own})
    assert len(set(ports.values())) == len(INSTANCES), f"two consumers, one port: {ports}"
    assert ports["frontend-sync"] == SyncSettings.model_fields["http_port"].default


# -- metric names --------------------------------------------------------------------------------

_PROMQL_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_PROMQL_WORDS = frozenset({"offset", "bool", "and", "or", "unless", "inf", "nan"})


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, labels and keywords left out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # ranges
    keywords = "|".join(sorted(_PROMQL_KEYWORDS))
    expr = re.sub(rf"\b({keywords})\s*\([^)]*\)", " ", expr)  # grouping label lists
    names = set()
    for match in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word = match[0]
        if word.lower() in _PROMQL_WORDS or expr[match.end() :].lstrip().startswith("("):
            continue  # an operator, or a function / aggregation
        names.add(word)
    return names


def exported_base(name: str) -> str | None:
    """The exported metric `name` is, or is a histogram series of; None if neither."""
    if name in EXPORTED_METRICS:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in EXPORTED_METRICS:
            return name.removesuffix(suffix)
    return None


def exported(name: str) -> bool:
    return exported_base(name) is not None


def test_metric_names_finds_the_metrics_of_an_expression() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (consumer, le) (rate(a_bucket{le!="1", x=~"$v"}[5m])))'
        " / on (consumer) group_left () max without (instance) (b offset 15m) > bool 3"
        ' or vector(1) unless absent(c{consumer="by"})'
    )
    assert metric_names(expr) == {"a_bucket", "b", "c"}
    assert exported("serversync_batch_duration_seconds_bucket")
    assert not exported("serversync_backlog_events_bucket_sum")
    assert not exported("serversync_backlog")


def test_every_exported_metric_is_documented_for_the_sysadmin() -> None:
    readme = (DEPLOY / "README.md").read_text()
    assert [m for m in EXPORTED_METRICS if f"`{m}" not in readme] == []


# -- alert rules ---------------------------------------------------------------------------------


def test_alerts_are_the_expected_ones_and_name_only_exported_metrics() -> None:
    rules = ALERTS.read_text()
    assert tuple(re.findall(r"^\s*- alert: (\w+)\s*$", rules, re.M)) == EXPECTED_ALERTS
    for path in (ALERTS, ALERT_TESTS):
        names = set(re.findall(r"\bserversync_\w+", path.read_text()))
        assert names, path
        assert sorted(n for n in names if not exported(n)) == [], path
    tests = ALERT_TESTS.read_text()
    for alert in EXPECTED_ALERTS:
        # Each alert has a case where it must stay silent and one where it must fire.
        assert re.search(rf"alertname: {alert}\n\s+exp_alerts: \[\]\n", tests), alert
        assert re.search(rf"alertname: {alert}\n\s+exp_alerts:\n\s+- exp_labels:", tests), alert


@needs_promtool
def test_promtool_check_rules() -> None:
    assert PROMTOOL is not None
    result = _run(PROMTOOL, "check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(EXPECTED_ALERTS)} rules found" in result.stdout


@needs_promtool
def test_promtool_test_rules() -> None:
    """Each alert fires when it should (once per consumer, not once per process) and not when it
    should not: deploy/prometheus/serversync-alerts.test.yml."""
    assert PROMTOOL is not None
    result = _run(PROMTOOL, "test", "rules", ALERT_TESTS.name, cwd=PROMETHEUS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_promtool_test_rules_fails_when_a_rule_is_wrong(tmp_path: Path) -> None:
    """The rule tests can fail: a wrong threshold breaks them."""
    assert PROMTOOL is not None
    rules = ALERTS.read_text()
    assert "> 1000" in rules
    (tmp_path / ALERTS.name).write_text(rules.replace("> 1000", "> 2000"))
    shutil.copy(ALERT_TESTS, tmp_path / ALERT_TESTS.name)
    result = _run(PROMTOOL, "test", "rules", ALERT_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0
    assert "ServersyncBacklogHigh" in result.stdout + result.stderr


_RULE_KEYS = {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


def test_alert_rules_match_the_rule_schema() -> None:
    yaml: Any = pytest.importorskip("yaml", reason="pyyaml is not installed in this environment")
    document = yaml.safe_load(ALERTS.read_text())
    assert set(document) == {"groups"}
    seen = []
    for group in document["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit"}
        assert isinstance(group["name"], str)
        assert isinstance(group["rules"], list)
        for rule in group["rules"]:
            assert set(rule) <= _RULE_KEYS, rule
            assert {"alert", "expr", "labels", "annotations"} <= set(rule), rule
            seen.append(rule["alert"])
            assert isinstance(rule["expr"], str)
            assert sorted(n for n in metric_names(rule["expr"]) if not exported(n)) == []
            if "for" in rule:
                assert _DURATION.match(rule["for"]), rule["for"]
            assert rule["labels"]["severity"] in {"warning", "critical"}
            assert {"summary", "description"} <= set(rule["annotations"])
            assert all(isinstance(v, str) for v in rule["annotations"].values())
    assert tuple(seen) == EXPECTED_ALERTS


# -- Grafana dashboard ---------------------------------------------------------------------------


def dashboard_panels() -> list[dict[str, Any]]:
    """Every panel, the ones inside collapsed rows included."""
    panels: list[dict[str, Any]] = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard_panels() for t in p.get("targets", [])]


def test_dashboard_is_valid_and_names_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    consumer = variables["consumer"]
    assert consumer["type"] == "query"
    assert consumer["query"]["query"] == "label_values(serversync_leader, consumer)"

    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    used: set[str] = set()
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel["targets"], panel.get("title")
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names, (panel["title"], target["expr"])
            assert sorted(n for n in names if not exported(n)) == [], panel["title"]
            used |= {exported_base(n) or n for n in names}
    # Every metric has a panel, and the panels' descriptions name only real metrics too.
    assert sorted(set(EXPORTED_METRICS) - used) == []
    mentioned = set(re.findall(r"\bserversync_\w+", DASHBOARD.read_text()))
    assert sorted(n for n in mentioned if not exported(n)) == []
    quantiles = [e for e in dashboard_exprs() if "serversync_batch_duration_seconds_bucket" in e]
    assert {re.findall(r"histogram_quantile\(([\d.]+)", e)[0] for e in quantiles} == {
        "0.5",
        "0.95",
        "0.99",
    }


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses every dashboard query (as recording rules, Grafana variables filled in)."""
    assert PROMTOOL is not None
    rules = [
        {
            "record": f"dashboard:query_{n}",
            "expr": expr.replace("$__rate_interval", "5m").replace("$consumer", ".*"),
        }
        for n, expr in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    result = _run(PROMTOOL, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
