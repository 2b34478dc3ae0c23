"""The reference receiver (`serversync ingest-server`): applies entries as idempotent upserts."""
