"""What the tests share, named after the product they exercise: the backend database as a
producer writes it and a consumer reads it (backend), waiting for delivery (waiting), fake and
real receivers (receivers), dead letters (dlq), serversync processes (processes), recordings and
their uploads (recordings, uploads), the command line (cli), secrets that must not leak (leaks)
and the exported metrics (metrics).

A test module imports from here and from tests.conftest only, never from another test module."""
