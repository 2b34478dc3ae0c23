-- The relay once per statement: a statement that changes many rows writes their outbox rows with
-- one INSERT ... SELECT, instead of one trigger call and one INSERT per row.
--
-- A row trigger runs the generated function, and the outbox INSERT's executor, once per changed
-- row; most of what the relay costs a row is that set-up, not the row it writes. An AFTER
-- STATEMENT trigger with a transition table (the statement's changed rows) pays it once per
-- statement. What the relay adds to a statement, in CPU instructions (callgrind, a single-user
-- backend on a fresh copy of one cluster for every run, so the counts repeat to within 0.1 %;
-- 2,000 statements in one transaction, bigint key; thousands of instructions):
--                                       row relay (0006)   statement relay (0007)
--   one-row INSERT                            101                   109
--   one-row UPDATE                            113                   119
--   one-row DELETE                             97                   105
--   100-row INSERT, per row                    96                    37
--   100-row UPDATE, per row                    94                    34
-- A one-row statement costs ~7 % more relay than before: a transition table's scan is set up
-- in every run (ExecInitNamedTuplestoreScan, ~14k), and the wake-up check is a statement of its
-- own instead of the outbox INSERT's RETURNING. A many-row statement costs less than half. With
-- a key that may be empty or NULL (a text key, a nullable column) a one-row INSERT costs ~18k
-- more than under the row relay: the refusal is a function call in the INSERT, and a call of a
-- PL/pgSQL function is set up in every run of the statement, whether it is made or not.
-- bench/producer.py measures both kinds of transaction with pgbench (the bulk_ modes).
--
-- What each change emits is what the row relay emitted: an upsert of each inserted or updated
-- row, a delete of each deleted row, the row as JSON, the key as its JSON text, in the order the
-- statement changed the rows; an UPDATE that changes a key still emits the delete of the old
-- key first (sync_rekey stays a row trigger that fires only WHEN the key changed; row triggers
-- fire before the statement's). The wake-up check runs once per statement that wrote events.
--
-- A transition table may serve only one event, so an ordinary table gets three triggers:
-- sync_relay (INSERT), sync_relay_update and sync_relay_delete. A partitioned table keeps the one
-- row trigger sync_relay: PostgreSQL clones row triggers onto every partition, including those
-- attached later, so writes made straight to a partition are relayed too, which the parent's
-- statement triggers would miss. The generated function serves both kinds (TG_LEVEL).

-- The empty-key refusal of 0006, in one place for every generated function, now for a NULL
-- key too (it failed on the outbox's NOT NULL). The relay passes TG_RELID, so the message names
-- the table as it is called when the row is refused.
CREATE FUNCTION sync.refuse_empty_key(target regclass, key_column text) RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'sync relay: a row of % has an empty or NULL key (column %)', target, key_column
        USING ERRCODE = 'check_violation';
END;
$$;

-- The relay's triggers on a table, whichever of them it has (none, when it was never tracked;
-- a partition's clones go with its parent's trigger).
CREATE FUNCTION sync.drop_relay_triggers(target regclass) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    existing text;
BEGIN
    FOR existing IN
        SELECT tgname FROM pg_trigger
        WHERE tgrelid = target AND tgparentid = 0
          AND tgname IN ('sync_relay', 'sync_relay_update', 'sync_relay_delete', 'sync_rekey')
    LOOP
        EXECUTE format('DROP TRIGGER %I ON %s', existing, target);
    END LOOP;
END;
$$;

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
    partitioned boolean;
    key_of text;
    body text;
BEGIN
    IF entity_type IS NULL OR entity_type !~ '^[A-Za-z_][A-Za-z0-9_.-]{0,127}$' THEN
        RAISE EXCEPTION 'sync.track: entity type % is not an identifier', quote_literal(entity_type)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The key of a row (%1$s: r, NEW or OLD) as its JSON text. The relay refuses an empty or
    -- NULL one, but a key of a number, date, time, boolean, enum or uuid type in a NOT NULL
    -- column can be neither, and is not checked: the check's function call costs every
    -- statement ~10k instructions to set up, whether it is made or not.
    SELECT CASE
               WHEN a.attnotnull
                    AND (t.typcategory IN ('N', 'D', 'B', 'T', 'E') OR t.oid = 'uuid'::regtype)
               THEN format('to_json(%%1$s.%I) #>> %L', key_column, '{}')
               ELSE format(
                   'coalesce(nullif(to_json(%%1$s.%I) #>> %L, %L), '
                   'sync.refuse_empty_key(TG_RELID, %L))',
                   key_column, '{}', '', key_column
               )
           END
      INTO key_of
      FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
     WHERE a.attrelid = target AND a.attname = key_column AND a.attnum > 0
       AND NOT a.attisdropped;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'sync.track: table % has no column %', target, quote_ident(key_column)
            USING ERRCODE = 'undefined_column';
    END IF;
    SELECT relkind = 'p' INTO partitioned FROM pg_class WHERE oid = target;
    PERFORM sync.drop_relay_triggers(target);
    -- The body goes in as a quoted literal (%L), not dollar-quoted: no column name can end it.
    body := format(
        $body$
        DECLARE
            event_op text;
            event_key text;
            event_row json;
            must_notify boolean;
        BEGIN
            -- Generated by sync.track (sql/backend/0007_statement_relay.sql).
            IF TG_LEVEL = 'STATEMENT' THEN
                -- sync_changed_rows: the statement's new rows, or its old ones for a DELETE.
                IF TG_OP = 'DELETE' THEN
                    INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
                    SELECT 'delete', %1$L, %3$s, to_json(r) FROM sync_changed_rows AS r;
                ELSE
                    INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
                    SELECT 'upsert', %1$L, %3$s, to_json(r) FROM sync_changed_rows AS r;
                END IF;
                -- A statement that changed no row wrote nothing and wakes nobody.
                IF FOUND THEN
                    IF (%2$s) THEN
                        PERFORM pg_notify('sync_outbox', '');  -- a wake-up only: no event data
                    END IF;
                END IF;
                RETURN NULL;
            END IF;
            IF TG_OP = 'DELETE' THEN
                event_op := 'delete';
                event_key := %5$s;
                event_row := to_json(OLD);
            ELSE
                event_op := 'upsert';
                event_key := %4$s;
                event_row := to_json(NEW);
            END IF;
            INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
            VALUES (event_op, %1$L, event_key, event_row)
            RETURNING %2$s INTO must_notify;
            IF must_notify THEN
                PERFORM pg_notify('sync_outbox', '');
            END IF;
            RETURN NULL;
        END;
        $body$,
        entity_type, wanted, format(key_of, 'r'), format(key_of, 'NEW'), format(key_of, 'OLD')
    );
    EXECUTE format(
        'CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS %L', relay, body
    );
    -- Every relay trigger carries (entity type, key column): sync.tracked_tables reads them.
    IF partitioned THEN
        EXECUTE format(
            'CREATE TRIGGER sync_relay AFTER INSERT OR UPDATE OR DELETE ON %s '
            'FOR EACH ROW EXECUTE FUNCTION %s(%L, %L)',
            target, relay, entity_type, key_column
        );
    ELSE
        EXECUTE format(
            'CREATE TRIGGER sync_relay AFTER INSERT ON %s '
            'REFERENCING NEW TABLE AS sync_changed_rows '
            'FOR EACH STATEMENT EXECUTE FUNCTION %s(%L, %L)',
            target, relay, entity_type, key_column
        );
        EXECUTE format(
            'CREATE TRIGGER sync_relay_update AFTER UPDATE ON %s '
            'REFERENCING NEW TABLE AS sync_changed_rows '
            'FOR EACH STATEMENT EXECUTE FUNCTION %s(%L, %L)',
            target, relay, entity_type, key_column
        );
        EXECUTE format(
            'CREATE TRIGGER sync_relay_delete AFTER DELETE ON %s '
            'REFERENCING OLD TABLE AS sync_changed_rows '
            'FOR EACH STATEMENT EXECUTE FUNCTION %s(%L, %L)',
            target, relay, entity_type, key_column
        );
    END IF;
    body := format(
        $body$
        DECLARE
            key_taken boolean;
        BEGIN
            -- Generated by sync.track (sql/backend/0007_statement_relay.sql). Runs only when a key
            -- changed, so the lookup may be planned on every call; TG_RELID keeps it right
            -- after the table is renamed.
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM %%s WHERE %%I = $1)', TG_RELID::regclass,
                           %1$L)
                INTO key_taken USING OLD.%1$I;
            IF key_taken THEN
                RETURN NULL;  -- another row took the old key in the same statement
            END IF;
            INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
            VALUES ('delete', %2$L, %3$s, to_json(OLD));
            RETURN NULL;
        END;
        $body$,
        key_column, entity_type, format(key_of, 'OLD')
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
    PERFORM sync.drop_relay_triggers(target);
    EXECUTE format('DROP FUNCTION IF EXISTS sync.%I()', 'relay_' || target::oid);
    EXECUTE format('DROP FUNCTION IF EXISTS sync.%I()', 'rekey_' || target::oid);
END;
$$;

-- A partition of a tracked partitioned table holds a clone of its sync_relay trigger (with
-- tgparentid set): the table tracked is the parent, not each partition.
CREATE OR REPLACE VIEW sync.tracked_tables AS
SELECT t.tgrelid::regclass AS table_name,
       convert_from(split_part(encode(t.tgargs, 'escape'), '\000', 1)::bytea, 'UTF8') AS entity_type,
       convert_from(split_part(encode(t.tgargs, 'escape'), '\000', 2)::bytea, 'UTF8') AS key_column
FROM pg_trigger t
WHERE t.tgname = 'sync_relay' AND NOT t.tgisinternal AND t.tgparentid = 0;

-- Regenerate the relay of every tracked table.
SELECT sync.track(table_name, entity_type, key_column) FROM sync.tracked_tables;
