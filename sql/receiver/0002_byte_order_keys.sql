-- Entity keys compare byte by byte (COLLATE "C").
--
-- Every applied entry probes the primary key twice (ON CONFLICT's check, then the insert) and
-- the batch is sorted by key for DISTINCT ON; with the database's default collation each of those
-- comparisons went through strcoll. Keys are identifiers, not text for people to sort, so byte
-- order is the right order for them, and the comparisons become memcmp. Measured in bench/ (500k
-- events through HTTP, three interleaved pairs): the receiver's PostgreSQL used 0.8 us less CPU
-- per event (16.3 -> 15.5), 2-4 % more events/s.
--
-- Upgrading: a collation change does not rewrite the table, but it rebuilds the primary key under
-- an exclusive lock; the view depends on the columns, so it is dropped and made again.
DROP VIEW ingest.live_entities;

ALTER TABLE ingest.entities
    ALTER COLUMN entity_type TYPE text COLLATE "C",
    ALTER COLUMN entity_id TYPE text COLLATE "C";

CREATE VIEW ingest.live_entities AS
SELECT entity_type, entity_id, seq, payload, source_created_at, applied_at
FROM ingest.entities
WHERE NOT deleted;
