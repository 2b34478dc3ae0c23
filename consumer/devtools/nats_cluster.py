"""A real NATS JetStream cluster on loopback, from the machine's nats-server (Debian's package
puts it in /usr/sbin): each node its own client, cluster and monitoring port and its own store
directory under `root`. The tests (tests/support/nats_cluster.py), the bench
(`python -m bench jetstream`) and the demo start it from here.

Nodes can be SIGKILLed and started again on the same store; every start is waited on with a
deadline (the node's /healthz, a JetStream API request answered through it, then a stream placed
on every node), never slept on. A stream's messages are read back through a pull consumer, as a
downstream service reads them.

This module imports nats-py (the `jetstream` extra): import it only where a cluster is wanted.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import nats
import nats.errors
import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext

from consumer.devtools.devdb import free_port

# Debian's package puts it here; PATH is looked at first.
DEBIAN_BINARY = "/usr/sbin/nats-server"
CLUSTER_NAME = "serversync-dev"
# How to get one, for the lines that say a cluster cannot be started.
INSTALL_HINT = "Debian: apt-get install nats-server"
# A stream made and deleted once every node runs, to wait until the cluster can place a stream
# with a replica on each node (a meta leader may be elected while a node's routes still churn,
# and a stream made then is refused: "no suitable peers for placement").
PLACEMENT_PROBE = "SERVERSYNC_PLACEMENT_PROBE"


def nats_server_binary() -> str | None:
    """The nats-server to run, or None when the machine has none."""
    found = shutil.which("nats-server")
    if found is not None:
        return found
    return DEBIAN_BINARY if Path(DEBIAN_BINARY).is_file() else None


class NatsServerError(Exception):
    """A node exited or did not come up in time; the message says which, with its log's end."""


async def _wait(
    check: Callable[[], Awaitable[bool]], *, timeout: float, what: str, interval: float = 0.05
) -> None:
    """Poll `check` until it holds; NatsServerError when `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise NatsServerError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(interval)  # poll again until the deadline


@dataclass
class Node:
    """One nats-server of the cluster."""

    name: str
    port: int
    cluster_port: int
    http_port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        """Where clients connect."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def config_path(self) -> Path:
        """Its configuration file."""
        return self.directory / "nats.conf"

    @property
    def log_path(self) -> Path:
        """Where its output goes (appended on each start)."""
        return self.directory / "nats.log"

    @property
    def running(self) -> bool:
        """Whether its process is alive."""
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        """Its process id while it runs."""
        return self.process.pid if self.process is not None and self.running else None


@dataclass
class NatsCluster:
    """`size` JetStream nodes routed to each other (three; one is a lone server);
    `max_payload` is each node's limit on one message (headers and body), `extra` more of
    each node's configuration (an authorization block, say)."""

    binary: str
    root: Path
    max_payload: int = 1024 * 1024
    size: int = 3
    extra: str = ""
    # What this module's own clients log in with (nats.connect's options), when `extra` asks.
    credentials: dict[str, Any] = field(default_factory=dict)
    cluster_name: str = CLUSTER_NAME
    # The file store each node may fill.
    max_file_store: str = "2GB"
    nodes: list[Node] = field(default_factory=list)
    # Pull consumers made so far to read a stream back (each read makes one).
    readers: int = 0

    def __post_init__(self) -> None:
        for number in range(1, self.size + 1):
            directory = self.root / f"n{number}"
            (directory / "store").mkdir(parents=True)
            self.nodes.append(Node(f"n{number}", free_port(), free_port(), free_port(), directory))
        routes = ", ".join(f"nats-route://127.0.0.1:{node.cluster_port}" for node in self.nodes)
        for node in self.nodes:
            node.config_path.write_text(
                f"server_name: {node.name}\n"
                f"listen: 127.0.0.1:{node.port}\n"
                f"http: 127.0.0.1:{node.http_port}\n"
                f"max_payload: {self.max_payload}\n"
                "jetstream {\n"
                f'  store_dir: "{node.directory / "store"}"\n'
                "  max_memory_store: 64MB\n"
                f"  max_file_store: {self.max_file_store}\n"
                "}\n"
                + (
                    "cluster {\n"
                    f"  name: {self.cluster_name}\n"
                    f"  listen: 127.0.0.1:{node.cluster_port}\n"
                    f"  routes: [{routes}]\n"
                    "}\n"
                    if self.size > 1
                    else ""
                )
                + self.extra
            )

    @property
    def urls(self) -> list[str]:
        """Every node's client URL."""
        return [node.url for node in self.nodes]

    def node(self, name: str) -> Node:
        """The node called `name` (n1, n2, n3)."""
        return next(node for node in self.nodes if node.name == name)

    def launch(self, node: Node) -> None:
        """Start the node's process (it may still be joining when this returns)."""
        if node.running:
            raise NatsServerError(f"{node.name} runs already")
        node.starts += 1
        with node.log_path.open("ab") as log:
            log.write(f"===== start {node.starts} =====\n".encode())
            log.flush()
            node.process = subprocess.Popen(
                [self.binary, "-c", str(node.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def kill(self, node: Node) -> None:
        """SIGKILL the node and reap it."""
        if node.process is not None and node.process.poll() is None:
            node.process.send_signal(signal.SIGKILL)
            node.process.wait(timeout=10)

    async def start(self, nodes: Sequence[Node] | None = None, *, timeout: float = 30.0) -> None:
        """Start `nodes` (every node that is down when None) and wait until each serves, then
        until the cluster's JetStream answers through each of them, then (when every node
        runs) until it can place a stream on all of them."""
        starting = [node for node in (nodes or self.nodes) if not node.running]
        for node in starting:
            self.launch(node)
        for node in starting:
            await self.wait_healthy(node, timeout=timeout)
        for node in starting:
            await self.wait_jetstream(node, timeout=timeout)
        if starting and all(node.running for node in self.nodes):
            await self.wait_placement(timeout=timeout)

    def _alive(self, node: Node) -> None:
        if not node.running:
            raise NatsServerError(f"nats-server {node.name} exited:\n{self.log(node)[-4000:]}")

    async def wait_healthy(self, node: Node, *, timeout: float = 30.0) -> None:
        """Until the node's /healthz?js-enabled-only=true answers 200."""
        url = f"http://127.0.0.1:{node.http_port}/healthz?js-enabled-only=true"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:

            async def healthy() -> bool:
                self._alive(node)
                try:
                    async with http.get(url) as response:
                        return response.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    return False

            await _wait(healthy, timeout=timeout, what=f"nats-server {node.name} healthy")

    async def wait_jetstream(self, node: Node, *, timeout: float = 30.0) -> None:
        """Until a JetStream account info request sent through `node` is answered (the cluster
        has a meta leader and the node knows it)."""
        async with connected([node.url], **self.credentials) as nc:

            async def answers() -> bool:
                self._alive(node)
                try:
                    reply = await nc.request("$JS.API.INFO", b"", timeout=1)
                except (nats.errors.Error, TimeoutError):
                    return False
                answer: dict[str, Any] = orjson.loads(reply.data)
                return "error" not in answer

            await _wait(answers, timeout=timeout, what=f"JetStream through {node.name}")

    async def wait_placement(self, *, timeout: float = 30.0) -> None:
        """Until a stream with a replica on every node can be made (it is deleted at once)."""
        config = {
            "name": PLACEMENT_PROBE,
            "subjects": ["serversync-placement-probe"],
            "num_replicas": len(self.nodes),
            "storage": "memory",
        }
        async with connected(self.running_urls(), **self.credentials) as nc:

            async def placed() -> bool:
                try:
                    reply = await nc.request(
                        f"$JS.API.STREAM.CREATE.{PLACEMENT_PROBE}", orjson.dumps(config), timeout=2
                    )
                except (nats.errors.Error, TimeoutError):
                    return False
                return "error" not in orjson.loads(reply.data)

            await _wait(placed, timeout=timeout, what="a stream placed on every node")
        await self.delete_stream(PLACEMENT_PROBE, timeout=timeout)

    async def stream_info(self, stream: str, *, timeout: float = 20.0) -> dict[str, Any]:
        """The stream's info (config, state, cluster), asked until a leader answers."""
        found: list[dict[str, Any]] = []
        async with connected(self.running_urls(), **self.credentials) as nc:

            async def answered() -> bool:
                try:
                    reply = await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=1)
                except (nats.errors.Error, TimeoutError):
                    return False
                info: dict[str, Any] = orjson.loads(reply.data)
                if "error" in info:
                    return False
                found.append(info)
                return True

            await _wait(answered, timeout=timeout, what=f"{stream}'s info")
        return found[0]

    async def delete_stream(self, stream: str, *, timeout: float = 20.0) -> None:
        """Delete the stream and its messages (their files on every node)."""
        async with connected(self.running_urls(), **self.credentials) as nc:
            reply = await nc.request(f"$JS.API.STREAM.DELETE.{stream}", b"", timeout=timeout)
        answer: dict[str, Any] = orjson.loads(reply.data)
        if "error" in answer:
            raise NatsServerError(f"cannot delete stream {stream}: {answer['error']}")

    async def meta_leader(self, *, timeout: float = 20.0) -> Node:
        """The node that leads the cluster's JetStream metadata (it makes streams and
        consumers), as a running node's monitoring endpoint reports it."""
        found: list[str] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:

            async def reported() -> bool:
                for node in self.nodes:
                    if not node.running:
                        continue
                    url = f"http://127.0.0.1:{node.http_port}/jsz"
                    try:
                        async with http.get(url) as response:
                            report = await response.json()
                    except (aiohttp.ClientError, TimeoutError, ValueError):
                        continue
                    leader = (report.get("meta_cluster") or {}).get("leader")
                    if leader:
                        found.append(leader)
                        return True
                return False

            await _wait(reported, timeout=timeout, what="the cluster's meta leader")
        return self.node(found[0])

    async def stream_leader(self, stream: str) -> Node:
        """The node that leads the stream now."""
        info = await self.stream_info(stream)
        return self.node(info["cluster"]["leader"])

    async def messages(self, stream: str, *, timeout: float = 120.0) -> list[StoredMessage]:
        """Every message the stream holds, in stream order, read as a downstream service reads
        it: through a durable pull consumer of its own (no acks: it only reads)."""
        info = await self.stream_info(stream)
        total = int(info["state"]["messages"])
        self.readers += 1
        stored: list[StoredMessage] = []
        async with connected(self.running_urls(), **self.credentials) as nc:
            js = nc.jetstream(timeout=2)
            config = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL)
            made: list[JetStreamContext.PullSubscription] = []

            async def make_reader() -> bool:
                # Consumers are made by the cluster's meta leader; a request sent while a
                # killed node's successor is still being elected goes unanswered, so it is
                # asked again (the durable name makes a repeated create the same consumer).
                try:
                    made.append(
                        await js.pull_subscribe(
                            "", durable=f"reader-{self.readers}", stream=stream, config=config
                        )
                    )
                except nats.errors.TimeoutError:
                    return False
                return True

            await _wait(make_reader, timeout=timeout, interval=0, what=f"a reader of {stream}")
            reader = made[0]

            async def read_all() -> bool:
                with contextlib.suppress(nats.errors.TimeoutError):
                    for msg in await reader.fetch(batch=1000, timeout=1):
                        stored.append(StoredMessage.of(msg))
                return len(stored) >= total

            await _wait(read_all, timeout=timeout, interval=0, what=f"{total} messages of {stream}")
        return stored

    def running_urls(self) -> list[str]:
        """The client URLs of the nodes that run."""
        return [node.url for node in self.nodes if node.running]

    def log(self, node: Node) -> str:
        """What the node wrote so far."""
        return node.log_path.read_text(errors="replace") if node.log_path.exists() else ""

    def close(self, *, show_logs: bool = False) -> None:
        """Kill every node; with `show_logs`, print the end of each one's log (pytest shows
        them when a test fails)."""
        for node in self.nodes:
            self.kill(node)
        if show_logs:
            for node in self.nodes:
                print(f"===== nats-server {node.name} =====")
                print(self.log(node)[-4000:])


@dataclass(frozen=True)
class StoredMessage:
    """One message as the stream stores it."""

    sequence: int
    subject: str
    headers: dict[str, str]
    body: bytes

    @classmethod
    def of(cls, msg: Msg) -> StoredMessage:
        """From a message a consumer of the stream received."""
        return cls(msg.metadata.sequence.stream, msg.subject, dict(msg.headers or {}), msg.data)

    @property
    def entry(self) -> dict[str, Any]:
        """The body: the wire entry."""
        entry: dict[str, Any] = orjson.loads(self.body)
        return entry


@contextlib.asynccontextmanager
async def connected(servers: list[str], **options: Any) -> AsyncIterator[NATS]:
    """A client of this module's own (no reconnects beyond a few, quiet on errors); `options`
    for nats.connect (credentials)."""

    async def quiet(_error: Exception) -> None:
        return None

    nc = await nats.connect(
        servers,
        connect_timeout=2,
        max_reconnect_attempts=3,
        reconnect_time_wait=0.1,
        error_cb=quiet,
        **options,
    )
    try:
        yield nc
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def running_cluster(
    binary: str, root: Path, *, show_logs: bool = False, **options: Any
) -> AsyncIterator[NatsCluster]:
    """A started cluster under `root` (`options` as NatsCluster takes them), killed at the end
    whatever happened to it; `show_logs` prints the nodes' logs then."""
    cluster = NatsCluster(binary, root, **options)
    try:
        await cluster.start()
        yield cluster
    finally:
        cluster.close(show_logs=show_logs)
