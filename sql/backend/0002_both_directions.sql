-- Both directions: the same machinery runs from a frontend's database to a backend's as from a
-- backend's to a frontend's, so every database is a node with a name, every event says on which
-- node its change was first made (origin), and a table edited on both sides carries a version
-- per row that decides which of two concurrent edits wins (sync.row_versions). Also events that
-- are not rows (sync.enqueue, functions/enqueue.sql) and the role allowed to write them.
--
-- The functions that use these (the relay's templates in functions/track.sql, sync.enqueue in
-- functions/enqueue.sql) live in the function files, applied after this migration.
--
-- Every statement leaves in place what it finds (IF NOT EXISTS, OR REPLACE): a database that
-- has these objects without the record of this migration (loaded from schema.sql by hand, or a
-- development build's database adopted as the baseline) is brought up to date, not refused.

-- == The node ===================================================================================
-- This database's name among the nodes that exchange changes: what an entry's origin says and
-- a row version's node, and what a consumer's target node is compared with to send no change
-- back where it came from. One row at most (the primary key is the constant true); no row: the
-- node is unnamed, as every database was before, and one-way tables work as they did. The name
-- follows the rule of a consumer's name.
CREATE TABLE IF NOT EXISTS sync.node (
    one_row boolean PRIMARY KEY DEFAULT true CHECK (one_row),
    name    text    NOT NULL CHECK (name ~ '^[a-z][a-z0-9_-]{0,62}$')
);

-- NULL while the node is unnamed. Whoever may use the schema sync may read the name (every
-- entry this node sends carries it), a consumer's role included, without a grant on the table:
-- SECURITY DEFINER, with a search_path no caller can change.
CREATE OR REPLACE FUNCTION sync.node_name() RETURNS text
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT n.name FROM sync.node n
$$;

-- `serversync migrate --node NAME`. Renaming a node is allowed: versions written before keep
-- the name they were written with, which still orders them (a version names the node that made
-- it, not the node that holds it).
CREATE OR REPLACE FUNCTION sync.set_node_name(name text) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF name IS NULL OR name !~ '^[a-z][a-z0-9_-]{0,62}$' THEN
        RAISE EXCEPTION 'sync.set_node_name: % is not a node name (a lowercase letter, then up '
                        'to 62 lowercase letters, digits, _ or -)', quote_nullable(name)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO sync.node AS n (one_row, name) VALUES (true, set_node_name.name)
    ON CONFLICT (one_row) DO UPDATE SET name = EXCLUDED.name;
END;
$$;

REVOKE EXECUTE ON FUNCTION sync.set_node_name(text) FROM PUBLIC;

-- == Origins ====================================================================================
-- NULL: the change was made on this node; else the node where it was first made. A receiver
-- applies a batch in one transaction and says whose changes it applies with
-- set_config('serversync.origin', NODE, true): every relay writing the outbox inside that
-- transaction, the one-way templates included, records it through this default, at no cost to
-- them beyond the default's evaluation. The setting reads '' once a transaction that set it has
-- ended, hence nullif.
ALTER TABLE sync.events_outbox
    ADD COLUMN IF NOT EXISTS origin text DEFAULT nullif(current_setting('serversync.origin', true), '');

-- A parked event keeps the origin it was delivered with, and is retried with it.
ALTER TABLE sync.dlq_messages ADD COLUMN IF NOT EXISTS origin text;

-- == Row versions ===============================================================================
-- The version of the last change of each row of a table tracked both ways (sync.track's
-- both_ways), and the receiver's guard for every entity type it maps into a table: no column is
-- added to a user's table. A version is (version_ts, version_node), compared timestamps first,
-- then node names in byte order (hence COLLATE "C" on the key too: one order on every node);
-- the greater one wins. A local change gets greatest(clock_timestamp(), stored version_ts + 1
-- microsecond), so it follows every version this node has seen of the row; an applied change
-- keeps the version it came with. A delete is a version too (deleted), so an older upsert that
-- arrives late does not bring the row back.
CREATE TABLE IF NOT EXISTS sync.row_versions (
    entity_type  text        COLLATE "C" NOT NULL,
    entity_id    text        COLLATE "C" NOT NULL,
    version_ts   timestamptz NOT NULL,
    version_node text        NOT NULL,
    deleted      boolean     NOT NULL DEFAULT false,
    -- The transaction of the receiver's apply that wrote this version: the relay of a both-ways
    -- table takes a row's version as applied only when its own transaction wrote it, so a row
    -- the apply did not write (a user's trigger changing another row) is a local edit.
    applied_xact xid8,
    PRIMARY KEY (entity_type, entity_id)
)
-- Room on every page for the next version of its rows: an upsert that changes no key column
-- then stays on the page (a HOT update, no new index entry), which is most of what the guard
-- costs a receiver per entry.
WITH (fillfactor = 70);
ALTER TABLE sync.row_versions ADD COLUMN IF NOT EXISTS applied_xact xid8;
ALTER TABLE sync.row_versions SET (fillfactor = 70);

-- == Idempotency keys of sync.enqueue ===========================================================
-- A key given to sync.enqueue is taken here, in the caller's transaction, and a second enqueue
-- with the same key writes nothing; `serversync cleanup` removes keys with the outbox rows of
-- the same age.
CREATE TABLE IF NOT EXISTS sync.enqueue_keys (
    idempotency_key text        COLLATE "C" PRIMARY KEY,
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- == Roles and grants ===========================================================================
-- serversync_producer: the role allowed to call sync.enqueue (functions/enqueue.sql grants
-- EXECUTE to it alone). An event is delivered as trusted data, signed by the consumer, so
-- writing one is a privilege an application role is given on purpose (GRANT
-- serversync_producer TO app_role), never PUBLIC's. NOLOGIN, created when missing as
-- serversync_relay is (0001_baseline.sql); where the migrating role may not create it, sync.enqueue
-- is callable by its owner only, and a NOTICE says so.
DO $role$
BEGIN
    IF to_regrole('serversync_producer') IS NULL THEN
        BEGIN
            CREATE ROLE serversync_producer NOLOGIN;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN
                NULL;  -- the migration of another database of the cluster made it meanwhile
            WHEN insufficient_privilege THEN
                RAISE NOTICE 'serversync: % may not create roles, and role serversync_producer '
                             'is missing: sync.enqueue is for its owner only (docs/security.md, '
                             'Roles and grants)', current_user;
        END;
    END IF;
END
$role$;

-- A producer finds sync.enqueue by its name (USAGE on the schema, which grants no table), and
-- the relay's functions read and write what the both-ways templates and sync.enqueue use.
DO $grants$
BEGIN
    IF to_regrole('serversync_producer') IS NOT NULL THEN
        GRANT USAGE ON SCHEMA sync TO serversync_producer;
    END IF;
    IF to_regrole('serversync_relay') IS NOT NULL THEN
        GRANT SELECT ON sync.node TO serversync_relay;
        GRANT SELECT, INSERT, UPDATE ON sync.row_versions TO serversync_relay;
        GRANT INSERT ON sync.enqueue_keys TO serversync_relay;
    END IF;
END
$grants$;

-- sync.track gains the parameter both_ways (functions/track.sql). CREATE OR REPLACE with one
-- more parameter would make a second function beside this one, and a call with three
-- arguments would match both.
DROP FUNCTION IF EXISTS sync.track(regclass, text, text);
