-- Wake-ups that cost producers (almost) nothing under load.
--
-- NOTIFY takes a cluster-wide lock at commit in every notifying transaction (async.c); with a
-- NOTIFY in every write transaction, producers at 8 connections ran at 0.31x of an untracked
-- table. A consumer that is busy draining needs no wake-up, so the relay notifies only while some
-- consumer says it is waiting (sync.consumer_waits), and checks that once per transaction.
--
-- Why no wake-up is lost: a consumer first marks itself waiting, then reads once more, and only
-- then sleeps. A producer transaction that checked the flag before it was set is either committed
-- before that read (the read sees its rows) or still running during it (the read's snapshot has
-- xmin < xmax, "held back", and the consumer re-checks on its short timer instead of sleeping).
--
-- The mode can be forced per session, role or database with the sync.notify setting:
-- 'auto' (default), 'always' (the naive relay: every transaction notifies) or 'off'.

-- Unlogged: after a crash the table is empty, consumers reconnect and announce themselves again.
CREATE UNLOGGED TABLE sync.consumer_waits (
    consumer   text        PRIMARY KEY,
    waiting    boolean     NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- The relay no longer looks at OLD for every UPDATE: a changed key is rare, so sync.track adds
-- a second trigger, sync_rekey, that fires only WHEN the key column changed and emits the delete
-- of the old key (it sorts before sync_relay, so the delete precedes the new key's upsert).
CREATE OR REPLACE FUNCTION sync.relay() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    row_json    jsonb;
    must_notify boolean;
BEGIN
    -- The wake-up check rides on the outbox INSERT's RETURNING: a separate statement (or a
    -- once-per-transaction marker in a setting) cost producers 10-15 % of their throughput in
    -- bench/, this costs next to nothing. PostgreSQL folds repeated identical notifications of
    -- one transaction into one.
    row_json := to_jsonb(CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END);
    INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
    VALUES (CASE WHEN TG_OP = 'DELETE' THEN 'delete' ELSE 'upsert' END,
            TG_ARGV[0], row_json ->> TG_ARGV[1], row_json)
    RETURNING CASE coalesce(nullif(current_setting('sync.notify', true), ''), 'auto')
                  WHEN 'always' THEN true
                  WHEN 'off' THEN false
                  ELSE EXISTS (SELECT 1 FROM sync.consumer_waits WHERE waiting)
              END
    INTO must_notify;
    IF must_notify THEN
        -- A wake-up only: no event data.
        PERFORM pg_notify('sync_outbox', '');
    END IF;
    RETURN NULL;
END;
$$;

-- An UPDATE that changed the key: the old entity is gone (its delete carries the old row).
CREATE FUNCTION sync.relay_rekey() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    old_row jsonb := to_jsonb(OLD);
BEGIN
    INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
    VALUES ('delete', TG_ARGV[0], old_row ->> TG_ARGV[1], old_row);
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION sync.track(
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
    EXECUTE format('DROP TRIGGER IF EXISTS sync_rekey ON %s', target);
    EXECUTE format(
        'CREATE TRIGGER sync_relay AFTER INSERT OR UPDATE OR DELETE ON %s '
        'FOR EACH ROW EXECUTE FUNCTION sync.relay(%L, %L)',
        target, entity_type, key_column
    );
    EXECUTE format(
        'CREATE TRIGGER sync_rekey AFTER UPDATE ON %s FOR EACH ROW '
        'WHEN (OLD.%I IS DISTINCT FROM NEW.%I) EXECUTE FUNCTION sync.relay_rekey(%L, %L)',
        target, key_column, key_column, entity_type, key_column
    );
END;
$$;

CREATE OR REPLACE FUNCTION sync.untrack(target regclass) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('DROP TRIGGER IF EXISTS sync_relay ON %s', target);
    EXECUTE format('DROP TRIGGER IF EXISTS sync_rekey ON %s', target);
END;
$$;

-- Re-attach the tables tracked so far, so that they get the rekey trigger too.
SELECT sync.track(table_name, entity_type, key_column) FROM sync.tracked_tables;
