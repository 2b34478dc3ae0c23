"""What the tests share, named after the product they exercise: the backend database as a
producer writes it and a consumer reads it (backend), a consumer runtime in the test's event loop
with a sink of the test's (runtime), waiting for delivery (waiting), fake and real receivers
(receivers), dead letters (dlq), serversync processes (processes), recordings and their uploads
(recordings, uploads), the command line (cli), secrets that must not leak (leaks), the exported
metrics (metrics) and what the operations tests scrape and collect (operations).

A test module imports from here and from tests.conftest only, never from another test module."""
