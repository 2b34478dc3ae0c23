"""The reference receiver fuzzed from its own OpenAPI document (docs/openapi.yaml) with
schemathesis: a real `serversync ingest-server --insecure` on loopback, and the schemathesis CLI
with every check, a fixed random start and a bound on the cases per operation.

What must hold: no answer is a 5xx other than a documented 503, no request leaves a traceback or
an ERROR in the receiver's log, and the document and the receiver agree (statuses, content
types, headers and bodies of the answers; valid requests accepted, invalid ones refused).

schemathesis also loads this file as its hooks module (the `hooks` entry of the configuration
written below): the hooks at the end register only there, never in pytest's process.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import orjson
import schemathesis
import yaml

from consumer.wire.signing import MANIFEST_HEADER, RecordingManifest
from tests.conftest import ROOT
from tests.support.processes import ServersyncProcess, process_env

OPENAPI = ROOT / "docs" / "openapi.yaml"
HOOKS = Path(__file__).resolve()
UPLOAD_PATH = "/api/ingest/recording-file"
LISTENING = re.compile(r"ingest-server listening on (http://127\.0\.0\.1:\d+)")
# Cases per operation and phase: the whole run takes 10-20 s on two cores.
MAX_EXAMPLES = 50
# A guard only: a run that hangs fails here instead of at pytest's own timeout.
RUN_TIMEOUT_SEC = 150.0
FAILING_LEVELS = frozenset({"error", "critical"})

# schemathesis.toml for the run. The expected statuses widened below are answers that refuse or
# answer a request as the document says, not faults; every check stays on for everything else.
CONFIG = """\
hooks = {hooks}

# Nothing kept between runs (the run's own directory is the working directory anyway).
[cache]
enabled = false

# 503 is the documented "retry later" answer (database down, too many uploads at once); any
# other 5xx, 500 first, fails the run.
[checks.not_a_server_error]
expected-statuses = ["2xx", "3xx", "4xx", "503"]

# The receiver counts a part's bytes while it streams the upload and refuses an id part over
# 64 bytes with 413 (documented) before it looks at the value: a refusal as much as a 422.
[[operations]]
include-path = "{upload}"
checks.negative_data_rejection.expected-statuses = [
  "400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx",
]

# A well-formed Range, If-Match or If-Unmodified-Since that the file at hand does not satisfy
# is answered 416 or 412, as a recording that does not exist is 404: documented answers that
# depend on the file, not on the form of the request.
[[operations]]
include-path-regex = "^/storage/recordings/"
checks.positive_data_acceptance.expected-statuses = [
  "2xx", "3xx", "401", "403", "404", "409", "412", "416", "429", "5xx",
]
"""


def documented_operations() -> int:
    """How many operations docs/openapi.yaml describes."""
    spec = yaml.safe_load(OPENAPI.read_text())
    return sum(1 for item in spec["paths"].values() for method in item if method != "parameters")


def log_faults(log: str) -> list[str]:
    """The receiver's log lines at ERROR or above, and every line of a traceback."""
    faults = []
    for line in log.splitlines():
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            record = None
        level = str(record.get("level", "")).lower() if isinstance(record, dict) else ""
        if level in FAILING_LEVELS or "Traceback" in line:
            faults.append(line)
    return faults


def findings(output: str) -> str:
    """What schemathesis reported (failures, errors, summary) without the progress lines."""
    start = min(
        (i for i in (output.find("= ERRORS ="), output.find("= FAILURES =")) if i >= 0),
        default=max(output.find("= SUMMARY ="), 0),
    )
    return output[output.rfind("\n", 0, start) + 1 :]


def write_config(workdir: Path) -> Path:
    """schemathesis.toml (CONFIG) in `workdir`."""
    config = workdir / "schemathesis.toml"
    config.write_text(CONFIG.format(hooks=json.dumps(str(HOOKS)), upload=UPLOAD_PATH))
    return config


async def run_schemathesis(base_url: str, workdir: Path) -> tuple[str, int]:
    """The schemathesis CLI against the receiver at `base_url`, in `workdir` (where it keeps its
    own files); its output and exit code."""
    config = write_config(workdir)
    # The hooks import this module, hence the repository on the path.
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    run = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(config),
        "--no-color",
        "run",
        str(OPENAPI),
        "--url",
        base_url,
        "--checks",
        "all",
        "--mode",
        "all",
        # A fixed random start and one worker: the same cases in the same order every run.
        "--seed",
        "1",
        "--workers",
        "1",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--generation-database",
        "none",
        "--request-timeout",
        "15",
        # Failures show the exact headers sent, for a reproduction by hand.
        "--output-sanitize",
        "false",
        env=process_env(PYTHONPATH=python_path),
        cwd=workdir,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(run.communicate(), timeout=RUN_TIMEOUT_SEC)
    except TimeoutError:
        run.kill()
        await run.wait()
        raise AssertionError(f"schemathesis still running after {RUN_TIMEOUT_SEC}s") from None
    assert run.returncode is not None
    output = out.decode(errors="replace")
    (workdir / "schemathesis.out").write_text(output)
    return output, run.returncode


async def test_the_receiver_and_its_openapi_document_agree_under_fuzzing(
    receiver_dsn: str, tmp_path: Path
) -> None:
    receiver = ServersyncProcess(
        "ingest-server",
        ["ingest-server", "--insecure"],
        process_env(
            FRONTEND_DATABASE_URL=receiver_dsn,
            RECORDINGS_STORE_DIR=str(tmp_path / "recordings"),
            INGEST_HOST="127.0.0.1",
            INGEST_PORT="0",
            # Uploads are refused with 507 while the disk holds less than this free: none here,
            # whatever the machine's disk (the fuzzed uploads are a few kilobytes in all).
            INGEST_MIN_FREE_BYTES="0",
            SYNC_LOG_LEVEL="INFO",
        ),
        tmp_path / "ingest-server.log",
    )
    try:
        match = LISTENING.search(await receiver.wait_log(LISTENING, timeout=30))
        assert match is not None
        output, code = await run_schemathesis(match.group(1), tmp_path)
        receiver.assert_alive()
    finally:
        # Not printed: the log holds a line per request; failures quote what matters of it.
        receiver.close()
    faults = log_faults(receiver.log())

    assert code == 0, f"schemathesis found disagreements (exit {code}):\n{findings(output)}"
    tested = re.search(r"Tested: (\d+)", output)
    assert tested is not None and int(tested.group(1)) == documented_operations(), output
    assert not faults, (
        f"requests left errors in the receiver's log ({receiver.log_path}):\n" + "\n".join(faults)
    )


def test_the_log_check_finds_errors_and_tracebacks() -> None:
    info = '{"level":"info","msg":"kept recording"}'
    warning = '{"level":"warning","msg":"Error handling request: HTTP 400"}'
    error = '{"level":"error","msg":"unhandled error in POST /api/ingest/sync"}'
    log = "\n".join([info, warning, error, "Traceback (most recent call last):", "  File x"])
    assert log_faults(log) == [error, "Traceback (most recent call last):"]


# -- schemathesis hooks (registered only when schemathesis loads this file) ---------------------


def part_bytes(value: Any) -> bytes | None:
    """The bytes a file part goes out as (schemathesis' Binary carries them in `data`, a string
    goes out in UTF-8); None for a value that is not a file's content (a negative case's)."""
    data = getattr(value, "data", None)
    if isinstance(data, bytes):
        return data
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        try:
            return value.encode()
        except UnicodeEncodeError:
            return None
    return None


def encode_audio(ctx: schemathesis.SerializationContext, value: Any) -> bytes:
    """The audio part as bytes, whatever value a negative case put there: schemathesis has no
    encoder of its own for the audio types the document lists besides octet-stream, and would
    give up on such a case instead of sending it."""
    data = part_bytes(value)
    return data if data is not None else json.dumps(value, default=str).encode()


@functools.cache
def optional_header_patterns(path: str, method: str) -> dict[str, re.Pattern[str]]:
    """The pattern the document gives each optional header of an operation that has one."""
    item = yaml.safe_load(OPENAPI.read_text())["paths"][path]
    parameters = [*item.get("parameters", []), *item[method.lower()].get("parameters", [])]
    return {
        parameter["name"]: re.compile(parameter["schema"]["pattern"])
        for parameter in parameters
        if parameter["in"] == "header"
        and not parameter.get("required", False)
        and "pattern" in parameter["schema"]
    }


def drop_invalid_optional_headers(case: schemathesis.Case[Any]) -> None:
    """Remove from a case schemathesis calls valid the optional headers that are not.

    Its coverage phase makes no valid value for a header whose pattern holds a character other
    than a letter or a digit (`v1=...`, the manifest's spaces), not even from the document's
    example, and then puts the first invalid one it has (`0`) into the cases it sends as valid.
    Without the header (every one of these is optional) the case is valid, as labelled."""
    meta, headers = case.meta, case.headers
    if meta is None or not meta.generation.mode.is_positive or not headers:
        return
    for name, pattern in optional_header_patterns(
        case.operation.path, case.operation.method
    ).items():
        value = headers.get(name)
        if value is not None and not (isinstance(value, str) and pattern.search(value)):
            del headers[name]


# The JSON text each body's meta was turned into (a body is one dict for its case's life; the
# text itself is compared, so a new body that happens to get a freed id is converted too).
_META_AS_TEXT: dict[int, str] = {}


def as_its_sender_makes_it(case: schemathesis.Case[Any], body: dict[str, Any]) -> None:
    """An upload as serversync sends it, where the document says what schemathesis cannot do:

    - the meta part is one JSON document, as its `encoding` (application/json) says:
      schemathesis would send a string as raw text and spread a list over several parts (none
      for []), which the receiver rightly refuses (not JSON, a part given twice, a part
      missing). It becomes its JSON text, still a valid `meta`;
    - X-Serversync-Manifest declares the sizes and SHA-256 of the parts sent, derived from the
      body as a signature is: a well-formed one schemathesis made up declares other parts and
      is refused (422), valid or not. It is replaced by the manifest of the parts sent. A
      malformed one (a negative case's) goes out as it is."""
    # A case may be sent more than once (schemathesis replays and shrinks): its meta is turned
    # into JSON text once, not once per sending (each would escape the last into a longer one).
    if "meta" in body and _META_AS_TEXT.get(id(body)) is not body["meta"]:
        body["meta"] = _META_AS_TEXT[id(body)] = json.dumps(body["meta"], default=str)
    headers = case.headers
    pattern = optional_header_patterns(UPLOAD_PATH, "POST")[MANIFEST_HEADER]
    given = headers.get(MANIFEST_HEADER) if headers else None
    if headers is None or not isinstance(given, str) or not pattern.search(given):
        return
    call_log_id, recording_id = body.get("callLogId"), body.get("recordingId")
    audio, meta = part_bytes(body.get("audio")), part_bytes(body.get("meta"))
    positive = case.meta is not None and case.meta.generation.mode.is_positive
    if (
        not isinstance(call_log_id, str)
        or not isinstance(recording_id, str)
        or audio is None
        or meta is None
    ):
        if positive:
            # No manifest of these parts can be made: a made-up one would declare others (any
            # size, over the limits too) and be refused. It is optional without a secret.
            del headers[MANIFEST_HEADER]
        return
    manifest = RecordingManifest(
        call_log_id=call_log_id,
        recording_id=recording_id,
        audio_size=len(audio),
        audio_sha256=hashlib.sha256(audio).hexdigest(),
        meta_size=len(meta),
        meta_sha256=hashlib.sha256(meta).hexdigest(),
    ).text()
    # A negative case's parts (an id that is no UUID, an empty audio) make no well-formed
    # manifest: the one schemathesis made up goes out instead, refused all the same.
    if pattern.search(manifest):
        headers[MANIFEST_HEADER] = manifest


def before_call(ctx: schemathesis.HookContext, case: schemathesis.Case[Any], **kwargs: Any) -> None:
    """Every request, just before schemathesis sends it."""
    drop_invalid_optional_headers(case)
    if case.operation.path == UPLOAD_PATH and isinstance(case.body, dict):
        as_its_sender_makes_it(case, case.body)


if __name__ == "_schemathesis_hooks":
    schemathesis.serializer("audio/wav", "audio/x-wav", "audio/wave")(encode_audio)
    schemathesis.hook(before_call)
