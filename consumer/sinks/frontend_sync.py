"""The JSON sync: POST each batch as JSON to a receiver's /api/ingest/sync. frontend-sync delivers
through it to FRONTEND_BASE_URL, and so does every declared consumer of sink "json" to its url."""

from __future__ import annotations

from typing import Any

import aiohttp

from consumer.core.events import Batch, DeliveryError, Outcome
from consumer.sinks.http import HttpSink, answer_of, client_span
from consumer.wire.contract import IDEMPOTENCY_KEY_HEADER, SYNC_PATH
from consumer.wire.signing import sign


class FrontendSyncSink(HttpSink):
    """Delivers a batch in one request: {"entries": [...]} (see docs/wire-contract.md)."""

    name = "frontend-sync"

    def __init__(
        self,
        base_url: str,
        *,
        timeout_sec: float,
        shared_secret: str | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(timeout_sec)
        if name is not None:
            # The consumer's name: it starts each Idempotency-Key, so two consumers posting to
            # one receiver never send the same key for different batches.
            self.name = name
        self.url = base_url.rstrip("/") + SYNC_PATH
        self._secret = shared_secret

    async def deliver(self, batch: Batch) -> Outcome:
        """POST the batch: delivered, or already processed (409); any other non-2xx answer,
        timeout or network error is a DeliveryError."""
        # The batch's entries already are the wire format: wrap them without parsing.
        body = b'{"entries":' + batch.entries_json + b"}"
        headers = {
            "Content-Type": "application/json",
            # The same batch always gets the same key, so a receiver can recognise a retry.
            IDEMPOTENCY_KEY_HEADER: f"{self.name}:{batch.min_seq}:{batch.max_seq}:{batch.count}",
            **sign(self._secret, body),
        }
        with client_span("POST", self.url, headers):
            try:
                async with self.post(self.url, data=body, headers=headers) as response:
                    answer = await answer_of(response, f"POST {self.url}", is_sync_answer)
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise DeliveryError(
                    f"POST {self.url} failed: {type(exc).__name__}: {exc}", code="NETWORK_ERROR"
                ) from exc
        return answer.outcome


def is_sync_answer(answer: dict[str, Any]) -> bool:
    """The receiver's answer to a batch: a JSON object with "ok": true (docs/wire-contract.md)."""
    return answer.get("ok") is True
