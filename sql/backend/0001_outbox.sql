-- serversync core: the outbox, consumer positions and the relay trigger.
--
-- Why the outbox stores the writing transaction's id (txid):
-- seq values are taken when a row is inserted, but transactions commit in another order, so a
-- reader that follows "seq > last_seq" skips a row whose transaction commits after a higher seq
-- was already delivered. A consumer therefore only reads rows whose transaction is older than the
-- xmin of its own snapshot (every such transaction has ended, so that part of the outbox can no
-- longer change) and orders its position by (txid, seq). See consumer/store/outbox.py.

CREATE SCHEMA IF NOT EXISTS sync;

CREATE TABLE sync.events_outbox (
    seq         bigserial   PRIMARY KEY,
    txid        xid8        NOT NULL DEFAULT pg_current_xact_id(),
    op          text        NOT NULL CHECK (op IN ('upsert', 'delete')),
    entity_type text        NOT NULL CHECK (entity_type <> ''),
    entity_id   text        NOT NULL CHECK (entity_id <> ''),
    payload     jsonb       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The delivery order, and the read path's only index.
CREATE INDEX events_outbox_position_idx ON sync.events_outbox (txid, seq);
-- For retention and --to-datetime resets.
CREATE INDEX events_outbox_created_at_idx ON sync.events_outbox USING brin (created_at);

CREATE TABLE sync.consumer_offsets (
    consumer        text        PRIMARY KEY CHECK (consumer ~ '^[a-z][a-z0-9_-]{0,62}$'),
    -- The position: everything up to and including (last_txid, last_seq) is delivered.
    last_txid       xid8        NOT NULL DEFAULT '0',
    last_seq        bigint      NOT NULL DEFAULT 0,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    -- Fencing: every leader takes a new epoch; an offset write names its epoch and is refused
    -- once a newer leader has taken over.
    leader_epoch    bigint      NOT NULL DEFAULT 0,
    leader_host     text,
    leader_pid      integer,
    leader_since    timestamptz,
    delivered_total bigint      NOT NULL DEFAULT 0,
    last_error      text,
    last_error_at   timestamptz
);

-- The relay: one trigger function for every tracked table.
-- TG_ARGV[0] = entity type, TG_ARGV[1] = key column.
CREATE FUNCTION sync.relay() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    entity_type text := TG_ARGV[0];
    key_column  text := TG_ARGV[1];
    new_row     jsonb;
    old_row     jsonb;
BEGIN
    IF TG_OP = 'DELETE' THEN
        old_row := to_jsonb(OLD);
        INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
        VALUES ('delete', entity_type, old_row ->> key_column, old_row);
    ELSE
        new_row := to_jsonb(NEW);
        IF TG_OP = 'UPDATE' THEN
            old_row := to_jsonb(OLD);
            -- A changed key is a delete of the old entity and an upsert of the new one.
            IF (old_row -> key_column) IS DISTINCT FROM (new_row -> key_column) THEN
                INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
                VALUES ('delete', entity_type, old_row ->> key_column, old_row);
            END IF;
        END IF;
        INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
        VALUES ('upsert', entity_type, new_row ->> key_column, new_row);
    END IF;
    -- A wake-up only: no event data. Identical notifications in one transaction are folded
    -- into one by PostgreSQL, so a transaction sends at most one.
    PERFORM pg_notify('sync_outbox', '');
    RETURN NULL;
END;
$$;

CREATE FUNCTION sync.track(
    target      regclass,
    entity_type text,
    key_column  text DEFAULT 'id'
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF entity_type IS NULL OR entity_type !~ '^[A-Za-z_][A-Za-z0-9_.-]{0,127}$' THEN
        RAISE EXCEPTION 'sync.track: entity type % is not an identifier', quote_literal(entity_type)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT EXISTS (
        SELECT 1 FROM pg_attribute
        WHERE attrelid = target AND attname = key_column AND attnum > 0 AND NOT attisdropped
    ) THEN
        RAISE EXCEPTION 'sync.track: table % has no column %', target, quote_ident(key_column)
            USING ERRCODE = 'undefined_column';
    END IF;
    EXECUTE format('DROP TRIGGER IF EXISTS sync_relay ON %s', target);
    EXECUTE format(
        'CREATE TRIGGER sync_relay AFTER INSERT OR UPDATE OR DELETE ON %s '
        'FOR EACH ROW EXECUTE FUNCTION sync.relay(%L, %L)',
        target, entity_type, key_column
    );
END;
$$;

CREATE FUNCTION sync.untrack(target regclass) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('DROP TRIGGER IF EXISTS sync_relay ON %s', target);
END;
$$;

-- What is tracked, for operators: table, entity type, key column.
CREATE VIEW sync.tracked_tables AS
SELECT t.tgrelid::regclass AS table_name,
       convert_from(split_part(encode(t.tgargs, 'escape'), '\000', 1)::bytea, 'UTF8') AS entity_type,
       convert_from(split_part(encode(t.tgargs, 'escape'), '\000', 2)::bytea, 'UTF8') AS key_column
FROM pg_trigger t
WHERE t.tgname = 'sync_relay' AND NOT t.tgisinternal;
