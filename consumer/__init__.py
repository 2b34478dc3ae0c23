"""serversync: a gap-safe PostgreSQL outbox, offset-tracking consumers and a reference receiver."""

__version__ = "0.1.0"
