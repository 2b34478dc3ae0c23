-- serversync's schema, sync, as it stands after every migration: the file to read.
--
-- It holds the outbox, the consumers' positions and leadership, the wake-up, the dead-letter
-- queue, this node's name and the row versions of tables tracked both ways, and the roles and
-- grants that keep producers out of all of it; then, through psql's \ir, the function files
-- (functions/enqueue.sql: sync.enqueue, an event that is not a row; functions/horizon.sql:
-- sync.read_horizon, how far consumers may read; functions/relay.sql: the
-- relay's helpers and the view of what is tracked; functions/snapshot.sql: writing a snapshot;
-- functions/track.sql: sync.track, which generates the relay of a table, and sync.untrack),
-- each of which lives in that one file only.
--
-- Databases are made by `serversync migrate` (versioned migrations, then the function files;
-- consumer/store/migrations.py), not from this file, and serversync's bookkeeping table
-- sync.schema_migrations is the runner's. tests/test_schema.py checks that this file and the
-- migrations make the same schema: a migration that changes the schema changes this file too.
-- To load it by hand: psql -v ON_ERROR_STOP=1 -f sql/backend/schema.sql

CREATE SCHEMA IF NOT EXISTS sync;

-- == The outbox =================================================================================
-- Every change to a tracked table is one row, written by the relay in the producer's own
-- transaction. Why the row keeps the writing transaction's id (txid): seq values are taken when
-- a row is inserted, but transactions commit in another order, so a reader that follows
-- "seq > last_seq" skips a row whose transaction commits after a higher seq was delivered. A
-- consumer reads only rows of transactions older than its snapshot's xmin (every one of them
-- has ended, so that part of the outbox can no longer change) and orders its position by
-- (txid, seq) (sql/queries.sql, read_batch).
--
-- What a producer pays for each outbox row is the set-up of every constraint and index in the
-- executor run of the relay's INSERT, so the table has as few as it can:
-- * no CHECK constraints: they are read back from their stored form and planned afresh in every
--   run (a third of what the relay cost). What they guarded is guarded where rows are made: op
--   is a constant in every generated function, sync.track validates the entity type, and the
--   relay refuses an empty or NULL key with check_violation (sync.refuse_empty_key).
-- * one B-tree, the primary key in delivery order; (txid, seq) is unique because seq is.
-- * no index on created_at: a BRIN cost every row ~14k instructions (brininsert rebuilds its
--   descriptor in every executor run) and served only occasional operator commands (cleanup's
--   count, `offsets reset --to-datetime`), which scan instead.
-- payload is json, the text to_json wrote: it is never queried in the database, and json is
-- read out as a copy where jsonb costs a conversion at both ends.
CREATE TABLE sync.events_outbox (
    seq         bigserial   NOT NULL,
    txid        xid8        NOT NULL DEFAULT pg_current_xact_id(),
    op          text        NOT NULL,  -- 'upsert' or 'delete'
    entity_type text        NOT NULL,
    entity_id   text        NOT NULL,
    payload     json        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- NULL: the change was made on this node; else the node where it was first made. A
    -- receiver applies a batch in one transaction and says whose changes it applies with
    -- set_config('serversync.origin', NODE, true): every relay writing the outbox inside that
    -- transaction, the one-way templates included, records it through this default. The
    -- setting reads '' once a transaction that set it has ended, hence nullif.
    origin      text        DEFAULT nullif(current_setting('serversync.origin', true), ''),
    -- The snapshot the row belongs to (NULL: a change). Its wire entry carries it, and a
    -- consumer sends it even to the node the row's version came from (a node being rebuilt
    -- needs it; one that holds it ignores it by its version guard).
    snapshot_id bigint,
    -- NULL: every consumer reads the row; else only the consumer of that name (a snapshot for
    -- one consumer), and every other passes over it. Neither column has a default: the relay's
    -- INSERT does not pay for them.
    target_consumer text,
    PRIMARY KEY (txid, seq)
);

-- == Positions and leadership ===================================================================
-- One row per consumer name. One process leads a consumer at a time (an advisory lock held by
-- its connection); every new leader takes a new epoch, and every offset write names its epoch,
-- so a leader that lost its lock without noticing is refused (fencing) once a newer one took
-- over.
CREATE TABLE sync.consumer_offsets (
    consumer        text        PRIMARY KEY CHECK (consumer ~ '^[a-z][a-z0-9_-]{0,62}$'),
    -- The position: everything up to and including (last_txid, last_seq) is delivered.
    last_txid       xid8        NOT NULL DEFAULT '0',
    last_seq        bigint      NOT NULL DEFAULT 0,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    leader_epoch    bigint      NOT NULL DEFAULT 0,
    leader_host     text,
    leader_pid      integer,
    leader_since    timestamptz,
    delivered_total bigint      NOT NULL DEFAULT 0,
    last_error      text,
    last_error_at   timestamptz,
    -- While deliveries keep failing (the receiver down, or answering that it is the wrong
    -- destination) the offset is held and the batch retried for as long as it takes: since when
    -- and why, for `serversync status`, /readyz and the alert on a long streak. An offset commit
    -- clears them.
    failing_since   timestamptz,
    failing_reason  text
);

-- == The wake-up ================================================================================
-- NOTIFY only wakes (it carries no data). It takes a cluster-wide lock at commit in every
-- notifying transaction, so the relay notifies only while some consumer says it is waiting. No
-- wake-up is lost: a consumer first marks itself waiting, then reads once more, and only then
-- sleeps; a producer that checked before the mark is either committed before that read (the
-- read sees its rows) or still running during it (the read is "held back", and the consumer
-- re-checks on a short timer instead of sleeping). The setting sync.notify forces the mode for
-- a connection, a role or a database: 'always', 'off', or unset/'auto'.
--
-- Unlogged: after a crash the table is empty until consumers announce themselves again.
CREATE UNLOGGED TABLE sync.consumer_waits (
    consumer   text        PRIMARY KEY,
    waiting    boolean     NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- The number of waiting consumers, which the relay reads with pg_sequence_last_value(): a
-- function call PL/pgSQL evaluates as a simple expression (~2k instructions), where a query of
-- consumer_waits ran through the executor in every statement (~23k). setval() takes effect at
-- once and is seen without a snapshot, so a consumer is counted before it reads once more and
-- sleeps. Unlogged like the table: after a crash both start empty (the value is NULL, no
-- consumer waits) until consumers announce themselves again.
CREATE UNLOGGED SEQUENCE sync.waiting_consumers MINVALUE 0 START 0;
SELECT setval('sync.waiting_consumers', 0, true);

-- Recount after every change to consumer_waits, one recount at a time (a transaction-scoped
-- advisory lock): two consumers changing their flags at once recount one after the other, and
-- the later recount, a new statement, sees the earlier one's commit. A recount that is rolled
-- back leaves the count as it set it; the next change sets it right.
CREATE FUNCTION sync.count_waiting_consumers() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- One recount at a time; the count is a new statement, so it sees every recount committed
    -- before this one took the lock.
    PERFORM pg_advisory_xact_lock(hashtext('sync.waiting_consumers'));
    PERFORM setval('sync.waiting_consumers',
                   (SELECT count(*) FROM sync.consumer_waits WHERE waiting), true);
    RETURN NULL;
END;
$$;

-- Per row, so a consumer's INSERT ... ON CONFLICT DO UPDATE recounts once, not once for each
-- of the INSERT and UPDATE statement triggers it would fire; TRUNCATE has no rows.
CREATE TRIGGER sync_count_waiting
    AFTER INSERT OR UPDATE OR DELETE ON sync.consumer_waits
    FOR EACH ROW EXECUTE FUNCTION sync.count_waiting_consumers();
CREATE TRIGGER sync_count_waiting_truncate
    AFTER TRUNCATE ON sync.consumer_waits
    FOR EACH STATEMENT EXECUTE FUNCTION sync.count_waiting_consumers();

-- == The dead-letter queue ======================================================================
-- Events a consumer gave up on, parked (in the transaction that moves its offset past them) so
-- that the consumer moves on, and kept for an operator to inspect, retry or delete. The payload
-- is the json text the outbox held, which accepts what jsonb refuses ("\u0000", lone
-- surrogates): whatever the outbox holds can be parked, and is retried byte for byte.
CREATE TABLE sync.dlq_messages (
    id            uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    -- The consumer that parked it.
    consumer      text        NOT NULL,
    seq           bigint      NOT NULL,
    entity_type   text        NOT NULL,
    entity_id     text        NOT NULL,
    op            text        NOT NULL CHECK (op IN ('upsert', 'delete', 'sweep')),
    payload       json        NOT NULL,
    event_created_at timestamptz,
    error_code    text        NOT NULL,
    error_message text        NOT NULL,
    retry_count   integer     NOT NULL DEFAULT 0,
    max_retries   integer     NOT NULL DEFAULT 3 CHECK (max_retries >= 0),
    status        text        NOT NULL DEFAULT 'PENDING'
                              CHECK (status IN ('PENDING', 'RETRYING', 'RESOLVED', 'DEAD')),
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    last_retry_at timestamptz,
    -- The origin the event was delivered with (sync.events_outbox.origin), kept for its retry.
    origin        text,
    -- A batch replayed after a crash parks the same event again: once is enough.
    UNIQUE (consumer, seq)
);
-- A consumer's messages, newest first (dlq list and count, the status gauges).
CREATE INDEX idx_dlq_messages_consumer ON sync.dlq_messages (consumer, created_at DESC);
-- Retention's resolved messages.
CREATE INDEX idx_dlq_messages_status ON sync.dlq_messages (status);

CREATE FUNCTION sync.touch_updated_at() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.updated_at := now();
    RETURN NEW;
END;
$$;

CREATE TRIGGER dlq_messages_updated_at BEFORE UPDATE ON sync.dlq_messages
FOR EACH ROW EXECUTE FUNCTION sync.touch_updated_at();

-- == The node ===================================================================================
-- This database's name among the nodes that exchange changes: what an entry's origin says and
-- a row version's node, and what a consumer's target node is compared with to send no change
-- back where it came from. One row at most (the primary key is the constant true); no row: the
-- node is unnamed, as every database was before, and one-way tables work as they did. The name
-- follows the rule of a consumer's name.
CREATE TABLE sync.node (
    one_row boolean PRIMARY KEY DEFAULT true CHECK (one_row),
    name    text    NOT NULL CHECK (name ~ '^[a-z][a-z0-9_-]{0,62}$')
);

-- NULL while the node is unnamed. Whoever may use the schema sync may read the name (every
-- entry this node sends carries it), a consumer's role included, without a grant on the table:
-- SECURITY DEFINER, with a search_path no caller can change.
CREATE FUNCTION sync.node_name() RETURNS text
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT n.name FROM sync.node n
$$;

-- `serversync migrate --node NAME`. Renaming a node is allowed: versions written before keep
-- the name they were written with, which still orders them (a version names the node that made
-- it, not the node that holds it).
CREATE FUNCTION sync.set_node_name(name text) RETURNS void
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

-- == Row versions ===============================================================================
-- The version of the last change of each row of a table tracked both ways (sync.track's
-- both_ways), and the receiver's guard for every entity type it maps into a table: no column is
-- added to a user's table. A version is (version_ts, version_node), compared timestamps first,
-- then node names in byte order (hence COLLATE "C" on the key too: one order on every node);
-- the greater one wins. A local change gets greatest(clock_timestamp(), stored version_ts + 1
-- microsecond), so it follows every version this node has seen of the row; an applied change
-- keeps the version it came with. A delete is a version too (deleted), so an older upsert that
-- arrives late does not bring the row back.
CREATE TABLE sync.row_versions (
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

-- == Idempotency keys of sync.enqueue ===========================================================
-- A key given to sync.enqueue is taken here, in the caller's transaction, and a second enqueue
-- with the same key writes nothing; `serversync cleanup` removes keys with the outbox rows of
-- the same age.
CREATE TABLE sync.enqueue_keys (
    idempotency_key text        COLLATE "C" PRIMARY KEY,
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- == Snapshots ===================================================================================
-- One row per snapshot asked for, by an operator (`serversync snapshot`) or for a consumer that
-- registered when the outbox no longer held the whole history. A snapshot is written in chunks,
-- each its own short transaction (functions/snapshot.sql), and resumed from its last chunk after
-- a crash or a stop.
CREATE TABLE sync.snapshots (
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
CREATE INDEX idx_snapshots_running ON sync.snapshots (consumer) WHERE state = 'running';

-- The tables of a snapshot, sent one after the other in `position` order, each in key order:
-- last_key is the key (as text) up to which the table is sent.
CREATE TABLE sync.snapshot_tables (
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
CREATE TABLE sync.outbox_history (
    one_row  boolean     PRIMARY KEY DEFAULT true CHECK (one_row),
    complete boolean     NOT NULL DEFAULT true,
    reason   text,
    since    timestamptz
);
INSERT INTO sync.outbox_history (one_row) VALUES (true);

-- == Roles and grants ===========================================================================
-- A producer needs no privilege on the schema sync: the relay's generated functions are
-- SECURITY DEFINER and belong to serversync_relay, a NOLOGIN role that holds only what they use
-- (functions/track.sql hands them over and grants the per-table rest). Had producers INSERT on
-- the outbox, a role allowed to write one table could insert any event, a delete of any entity
-- included, and the consumer signs and delivers what the outbox holds.
--
-- Roles belong to the cluster: the role is created only when missing, and one made meanwhile by
-- another database's migration is fine. The migrating role becomes a member, which PostgreSQL
-- requires of whoever hands an object to another role (ALTER FUNCTION ... OWNER TO). Where the
-- migrating role may do neither (some managed services), the relay runs as the migrating role
-- instead, and sync.track says so (docs/security.md, Roles and grants).
DO $role$
DECLARE
    superuser boolean := (SELECT r.rolsuper FROM pg_catalog.pg_roles r
                           WHERE r.rolname = current_user);
BEGIN
    IF to_regrole('serversync_relay') IS NULL THEN
        BEGIN
            CREATE ROLE serversync_relay NOLOGIN;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN
                NULL;  -- the migration of another database of the cluster made it meanwhile
            WHEN insufficient_privilege THEN
                RAISE NOTICE 'serversync: % may not create roles, and role serversync_relay is '
                             'missing: the relay runs as % (docs/security.md, Roles and grants)',
                             current_user, current_user;
                RETURN;
        END;
    END IF;
    IF NOT superuser AND NOT pg_has_role(current_user, 'serversync_relay', 'USAGE') THEN
        BEGIN
            GRANT serversync_relay TO CURRENT_USER;
        EXCEPTION
            WHEN unique_violation THEN
                NULL;  -- granted meanwhile by the migration of another database
            WHEN insufficient_privilege THEN
                RAISE NOTICE 'serversync: % may not become a member of role serversync_relay: '
                             'the relay runs as % (docs/security.md, Roles and grants)',
                             current_user, current_user;
        END;
    END IF;
END
$role$;

-- What the relay's functions use: the outbox (INSERT, and its sequence for the seq default) and
-- the count of waiting consumers (SELECT: pg_sequence_last_value).
DO $grants$
BEGIN
    IF to_regrole('serversync_relay') IS NOT NULL THEN
        GRANT USAGE ON SCHEMA sync TO serversync_relay;
        GRANT INSERT ON sync.events_outbox TO serversync_relay;
        GRANT USAGE ON SEQUENCE sync.events_outbox_seq_seq TO serversync_relay;
        GRANT SELECT ON SEQUENCE sync.waiting_consumers TO serversync_relay;
    END IF;
END
$grants$;

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

-- No one but the outbox's owner and serversync_relay writes the outbox, takes its positions or
-- adds a trigger to it (a trigger on the outbox runs as the role that inserts, the relay's).
-- USAGE on the count of waiting consumers would let a role call nextval() on it and make every
-- producer notify until the next recount; consumers recount with UPDATE (setval). Default
-- privileges (ALTER DEFAULT PRIVILEGES, a common way to grant an application role every new
-- table) may have granted such rights when the tables were created: they are taken back.
REVOKE INSERT, UPDATE, DELETE, TRUNCATE, TRIGGER ON sync.events_outbox FROM PUBLIC;
REVOKE ALL ON SEQUENCE sync.events_outbox_seq_seq FROM PUBLIC;
DO $revoke$
DECLARE
    granted record;
BEGIN
    FOR granted IN
        SELECT DISTINCT c.oid::regclass AS object, c.relkind, a.grantee::regrole AS holder
          FROM pg_catalog.pg_class c
               CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) a
         WHERE c.oid IN ('sync.events_outbox'::regclass, 'sync.events_outbox_seq_seq'::regclass,
                         'sync.waiting_consumers'::regclass)
           AND a.grantee NOT IN (0, c.relowner)
           AND a.grantee::regrole::text <> 'serversync_relay'
           AND a.privilege_type IN ('INSERT', 'UPDATE', 'TRIGGER', 'USAGE')
    LOOP
        IF granted.object = 'sync.events_outbox'::regclass THEN
            EXECUTE format('REVOKE INSERT, UPDATE, TRIGGER ON sync.events_outbox FROM %s',
                           granted.holder);
        ELSIF granted.object = 'sync.events_outbox_seq_seq'::regclass THEN
            EXECUTE format('REVOKE USAGE, UPDATE ON SEQUENCE %s FROM %s',
                           granted.object, granted.holder);
        ELSE
            EXECUTE format('REVOKE USAGE ON SEQUENCE %s FROM %s', granted.object, granted.holder);
        END IF;
    END LOOP;
END
$revoke$;

-- == The relay ==================================================================================
\ir functions/enqueue.sql
\ir functions/horizon.sql
\ir functions/relay.sql
\ir functions/snapshot.sql
\ir functions/track.sql
