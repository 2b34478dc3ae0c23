-- Snapshots: the current state of tracked tables written into the stream on demand, for a
-- receiver that is new, rebuilt or restored from a backup, and for a table that held rows before
-- it was tracked (the relay writes changes only, and cleanup deletes old ones).
--
-- The functions that write a snapshot (functions/snapshot.sql) are applied after this
-- migration. docs/design.md, Snapshots, has why a snapshot row never overwrites newer data.
--
-- Every statement leaves in place what it finds (IF NOT EXISTS), as 0002 does.

-- == The outbox: whose rows ======================================================================
-- snapshot_id: the snapshot a row belongs to (NULL: a change). Its wire entry carries it, and a
-- consumer sends it even to the node the row's version came from (a node being rebuilt needs it;
-- one that holds it ignores it by its version guard).
-- target_consumer: NULL, every consumer reads the row; else only the consumer of that name (a
-- snapshot for one consumer), and every other passes over it as it passes over entity types it
-- does not carry. Neither has a default: the relay's INSERT does not pay for them.
ALTER TABLE sync.events_outbox ADD COLUMN IF NOT EXISTS snapshot_id bigint;
ALTER TABLE sync.events_outbox ADD COLUMN IF NOT EXISTS target_consumer text;

-- == Snapshots ====================================================================================
-- One row per snapshot asked for, by an operator (`serversync snapshot`) or for a consumer that
-- registered when the outbox no longer held the whole history. A snapshot is written in chunks,
-- each its own short transaction, and resumed from its last chunk after a crash or a stop.
CREATE TABLE IF NOT EXISTS sync.snapshots (
    id             bigserial   PRIMARY KEY,
    -- NULL: for every consumer; else for this one only (its rows carry target_consumer).
    consumer       text        CHECK (consumer ~ '^[a-z][a-z0-9_-]{0,62}$'),
    requested_by   text        NOT NULL CHECK (requested_by IN ('operator', 'new consumer')),
    -- End with a sweep marker per entity type: a receiver may then delete what the snapshot did
    -- not mention (docs/wire-contract.md, Snapshots).
    delete_missing boolean     NOT NULL DEFAULT false,
    state          text        NOT NULL DEFAULT 'running'
                               CHECK (state IN ('running', 'done', 'cancelled')),
    -- An outbox seq taken when the snapshot began, once every transaction that could still write
    -- a lower one had ended: every row it sends has a higher seq. NULL until it has begun.
    begin_seq      bigint,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    finished_at    timestamptz
);
CREATE INDEX IF NOT EXISTS idx_snapshots_running ON sync.snapshots (consumer) WHERE state = 'running';

-- The tables of a snapshot, sent one after the other in `position` order, each in key order:
-- last_key is the key (as text) up to which the table is sent.
CREATE TABLE IF NOT EXISTS sync.snapshot_tables (
    snapshot_id bigint   NOT NULL REFERENCES sync.snapshots (id) ON DELETE CASCADE,
    position    integer  NOT NULL,
    relation    regclass NOT NULL,
    entity_type text     NOT NULL,
    key_column  text     NOT NULL,
    both_ways   boolean  NOT NULL DEFAULT false,
    last_key    text,
    -- Rows the table held when the snapshot was asked for (a count, for progress only).
    rows_total  bigint   NOT NULL DEFAULT 0,
    rows_sent   bigint   NOT NULL DEFAULT 0,
    done        boolean  NOT NULL DEFAULT false,
    PRIMARY KEY (snapshot_id, position)
);

-- == Whether the outbox holds the whole history ================================================
-- One row: false once `serversync cleanup` deleted outbox rows, or a table that already held rows
-- was tracked. A consumer registered after that starts with a snapshot of the tables it carries
-- (unless told to start from now or from the outbox's start).
CREATE TABLE IF NOT EXISTS sync.outbox_history (
    one_row  boolean     PRIMARY KEY DEFAULT true CHECK (one_row),
    complete boolean     NOT NULL DEFAULT true,
    reason   text,
    since    timestamptz
);
-- A database that tracked tables before it had this table may have tracked them full, or
-- deleted old outbox rows: its history is taken as incomplete, so that a consumer registered
-- from now on starts with a snapshot (the safe side).
INSERT INTO sync.outbox_history (one_row, complete, reason, since)
SELECT true, false, 'tables were tracked before snapshots existed', now()
 WHERE EXISTS (SELECT FROM pg_trigger t WHERE t.tgname = 'sync_relay' AND NOT t.tgisinternal)
ON CONFLICT DO NOTHING;
INSERT INTO sync.outbox_history (one_row) VALUES (true) ON CONFLICT DO NOTHING;

-- == Dead letters: a sweep marker may be parked too =================================================
ALTER TABLE sync.dlq_messages DROP CONSTRAINT IF EXISTS dlq_messages_op_check;
ALTER TABLE sync.dlq_messages ADD CONSTRAINT dlq_messages_op_check
    CHECK (op IN ('upsert', 'delete', 'sweep'));
