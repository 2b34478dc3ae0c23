-- A leaner outbox row for producers: no CHECK constraints, one B-tree instead of two.
--
-- The relay inserts one outbox row per changed row, from a trigger, so every INSERT is a new
-- executor run, and that run pays a set-up cost for each constraint and index of the outbox
-- before it writes anything. Timed per row (50,000 single-row relay INSERTs in one session,
-- fsync off; medians of five alternating rounds, which varied by up to 30 %):
--   no trigger                                                            3.6 us
--   the 0001 outbox (3 CHECKs, PRIMARY KEY (seq), (txid, seq), BRIN)      34.6 us
--   the same without the CHECKs                                          23.4 us
--   one combined CHECK in place of the three                             31.4 us
--   no CHECKs, PRIMARY KEY (txid, seq), BRIN (this migration)            13.3 us
--   no CHECKs and no index at all                                        16.0 us (noise)
-- A table's CHECK constraints are read back from their stored form (stringToNode) and planned
-- (ExecPrepareExpr) afresh in every executor run that inserts a row (ExecRelCheck); one combined
-- CHECK cost about as much as three, and together they were a third of what the relay cost.
--
-- So:
-- * The CHECKs go. What they guarded is guarded where the rows are made: op is a constant in
--   every relay function, sync.track validates the entity type, and the relay refuses an empty
--   key with the same error class (check_violation, 23514) the constraint raised. NOT NULL stays
--   (it costs nothing).
-- * The position index becomes the primary key: (txid, seq) is unique because seq is. Nothing
--   looks rows up by seq alone on a hot path: `reset --to-seq` walks the position order, as it
--   did, and the oldest-row gauge now takes the first row in position order.
-- * The BRIN on created_at stays: retention and --to-datetime resets use it, and dropping it
--   made no difference outside the noise of the per-row timings.
--
-- Upgrading builds the new primary key once, under an exclusive lock on the outbox: run it when
-- the outbox is small, e.g. right after `serversync cleanup`.

ALTER TABLE sync.events_outbox
    DROP CONSTRAINT events_outbox_op_check,
    DROP CONSTRAINT events_outbox_entity_type_check,
    DROP CONSTRAINT events_outbox_entity_id_check,
    DROP CONSTRAINT events_outbox_pkey,
    ADD CONSTRAINT events_outbox_pkey PRIMARY KEY (txid, seq);
DROP INDEX sync.events_outbox_position_idx;

-- sync.track as in 0005, with the empty-key check that replaces the outbox's CHECK, and a
-- generated rekey function per table in place of the generic sync.relay_rekey: it runs at the
-- end of the statement (AFTER ROW triggers are queued until then) and sends the delete of the
-- old key only if no row holds that key by then. Keys swapped within one statement (a
-- deferrable or a non-unique key allows it) are two upserts: the generic function sent a delete
-- of each old key, and the second delete came after the first upsert, removing an entity that
-- still existed from the receiver.
CREATE OR REPLACE FUNCTION sync.track(
    target      regclass,
    entity_type text,
    key_column  text DEFAULT 'id'
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    relay text := format('sync.%I', 'relay_' || target::oid);
    rekey text := format('sync.%I', 'rekey_' || target::oid);
    wanted text := $check$
        CASE coalesce(nullif(current_setting('sync.notify', true), ''), 'auto')
            WHEN 'always' THEN true
            WHEN 'off' THEN false
            ELSE EXISTS (SELECT 1 FROM sync.consumer_waits WHERE waiting)
        END$check$;
    -- Replaces the outbox's CHECK (entity_id <> ''), in both generated functions. A NULL key
    -- still fails on the outbox's NOT NULL, as it did.
    refuse_empty_key text := format(
        $guard$IF event_key = '' THEN
                RAISE EXCEPTION 'sync relay: a row of %% has an empty key (column %%)',
                    TG_TABLE_NAME, %L
                    USING ERRCODE = 'check_violation';
            END IF;$guard$,
        key_column
    );
    body text;
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
    -- The body goes in as a quoted literal (%L), not dollar-quoted: no column name can end it.
    body := format(
        $body$
        DECLARE
            event_op text;
            event_key text;
            event_row json;
            must_notify boolean;
        BEGIN
            -- Generated by sync.track (sql/backend/0006_lean_outbox.sql).
            IF TG_OP = 'DELETE' THEN
                event_op := 'delete';
                event_key := to_json(OLD.%2$I) #>> '{}';
                event_row := to_json(OLD);
            ELSE
                event_op := 'upsert';
                event_key := to_json(NEW.%2$I) #>> '{}';
                event_row := to_json(NEW);
            END IF;
            %4$s
            INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
            VALUES (event_op, %1$L, event_key, event_row)
            RETURNING %3$s INTO must_notify;
            IF must_notify THEN
                -- A wake-up only: no event data.
                PERFORM pg_notify('sync_outbox', '');
            END IF;
            RETURN NULL;
        END;
        $body$,
        entity_type, key_column, wanted, refuse_empty_key
    );
    EXECUTE format(
        'CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS %L', relay, body
    );
    EXECUTE format(
        'CREATE TRIGGER sync_relay AFTER INSERT OR UPDATE OR DELETE ON %s '
        'FOR EACH ROW EXECUTE FUNCTION %s(%L, %L)',
        target, relay, entity_type, key_column
    );
    body := format(
        $body$
        DECLARE
            event_key text;
            key_taken boolean;
        BEGIN
            -- Generated by sync.track (sql/backend/0006_lean_outbox.sql). Runs only when a key
            -- changed, so the lookup may be planned on every call; TG_RELID keeps it right
            -- after the table is renamed.
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM %%s WHERE %%I = $1)', TG_RELID::regclass,
                           %1$L)
                INTO key_taken USING OLD.%1$I;
            IF key_taken THEN
                RETURN NULL;  -- another row took the old key in the same statement
            END IF;
            event_key := to_json(OLD.%1$I) #>> '{}';
            %3$s
            INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
            VALUES ('delete', %2$L, event_key, to_json(OLD));
            RETURN NULL;
        END;
        $body$,
        key_column, entity_type, refuse_empty_key
    );
    EXECUTE format(
        'CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS %L', rekey, body
    );
    EXECUTE format(
        'CREATE TRIGGER sync_rekey AFTER UPDATE ON %s FOR EACH ROW '
        'WHEN (OLD.%I IS DISTINCT FROM NEW.%I) EXECUTE FUNCTION %s(%L, %L)',
        target, key_column, key_column, rekey, entity_type, key_column
    );
END;
$$;

CREATE OR REPLACE FUNCTION sync.untrack(target regclass) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('DROP TRIGGER IF EXISTS sync_relay ON %s', target);
    EXECUTE format('DROP TRIGGER IF EXISTS sync_rekey ON %s', target);
    EXECUTE format('DROP FUNCTION IF EXISTS sync.%I()', 'relay_' || target::oid);
    EXECUTE format('DROP FUNCTION IF EXISTS sync.%I()', 'rekey_' || target::oid);
END;
$$;

-- Regenerate the relay of every tracked table; no trigger uses the generic rekey after that.
SELECT sync.track(table_name, entity_type, key_column) FROM sync.tracked_tables;
DROP FUNCTION sync.relay_rekey();
