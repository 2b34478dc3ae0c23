-- What the pre-release migrations (0001_outbox .. 0012_relay_least_privilege, squashed into
-- 0001_baseline.sql) left in a database that the baseline does not make. `serversync migrate`
-- runs this once, when it adopts such a database as being at 0001_baseline; it then applies
-- the function files, which replace every function they define and generate every relay again.
-- Nothing released ever ran the pre-release migrations: this serves databases of development
-- builds (a demo, a developer's database).

-- The first, generic relay: no trigger has used it since relays are generated per table.
DROP FUNCTION IF EXISTS sync.relay();
-- Nothing reads the dead letters by created_at alone: a consumer's are listed through
-- idx_dlq_messages_consumer (consumer, created_at DESC).
DROP INDEX IF EXISTS sync.idx_dlq_messages_created_at;
