"""The published contract stays valid and in step with the receiver's routes."""

from __future__ import annotations

import re
from pathlib import Path

from openapi_spec_validator import validate
from openapi_spec_validator.readers import read_from_filename

from consumer.receiver.app import build_app
from consumer.receiver.store import EntityStore
from consumer.receiver.uploads import RecordingFiles

OPENAPI = Path(__file__).resolve().parent.parent / "docs" / "openapi.yaml"


def test_openapi_document_is_valid() -> None:
    spec, _ = read_from_filename(str(OPENAPI))
    validate(spec)


def test_openapi_documents_every_route_of_the_receiver(tmp_path: Path) -> None:
    spec, _ = read_from_filename(str(OPENAPI))
    app = build_app(
        EntityStore(None),  # type: ignore[arg-type] # routes only: no request is served
        max_body_bytes=1024,
        recordings=RecordingFiles(tmp_path, max_bytes=1024),
    )
    served = {
        (route.method.lower(), route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None and route.method != "HEAD"
    }
    documented = {
        (method, _shape(path))
        for path, item in spec["paths"].items()
        for method in item
        if method != "parameters"
    }
    assert {(method, _shape(path)) for method, path in served} <= documented


def _shape(path: str) -> str:
    """A path with its variables unnamed: aiohttp and OpenAPI name and spell them apart."""
    return re.sub(r"\{[^}]*\}", "{}", path.replace("[^/]+", ""))
