-- The reference receiver's store, ingest, as it stands after every migration: the file to read.
--
-- Databases are made by `serversync migrate --receiver` (or the receiver at its start), not
-- from this file, and ingest.schema_migrations is the runner's. tests/test_schema.py checks
-- that this file and the migrations make the same schema.

-- Generic on purpose: any well-formed entity type is kept, so a newly tracked table needs no
-- receiver change.
CREATE SCHEMA IF NOT EXISTS ingest;

CREATE TABLE ingest.entities (
    -- The keys compare byte by byte (COLLATE "C"): they are identifiers, not text for people to
    -- sort, and every applied entry probes the primary key twice (ON CONFLICT's check, then the
    -- insert) and is sorted by key for DISTINCT ON, which under the database's default collation
    -- went through strcoll (2-4 % more events/s in bench/).
    entity_type text        COLLATE "C" NOT NULL,
    entity_id   text        COLLATE "C" NOT NULL,
    -- The version guard: the outbox seq of the change that produced this state. An entry with a
    -- seq not above it is stale and changes nothing.
    seq         bigint      NOT NULL,
    -- A delete keeps the row as a tombstone (deleted, payload NULL) so that a late, older upsert
    -- cannot bring the entity back.
    deleted     boolean     NOT NULL DEFAULT false,
    payload     jsonb,
    source_created_at timestamptz,
    applied_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (entity_type, entity_id)
);

-- The live entities, without tombstones.
CREATE VIEW ingest.live_entities AS
SELECT entity_type, entity_id, seq, payload, source_created_at, applied_at
FROM ingest.entities
WHERE NOT deleted;
