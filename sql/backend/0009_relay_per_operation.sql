-- The relay's trigger functions do one thing each: sync.track generates one for a table's
-- upserts (INSERT and UPDATE) and one for its deletes, with no branch on the trigger's level or
-- operation and no variables; and the wake-up check is two small tests instead of one CASE.
-- PL/pgSQL sets up every expression it evaluates once per transaction, at a cost that grows
-- with the expression, and a producer's transaction is often a single statement.
-- Instructions the relay adds to a single-row statement that is its own transaction
-- (`python -m bench instructions`: callgrind, single-user backends, bigint key, no consumer
-- waiting; thousands):
--                                                    INSERT   UPDATE
--   0008                                                101       98
--   one function per operation                           95       92
--   and the wake-up check as two tests (0009)            89       86
--   for scale: the bench's minimal trigger (one INSERT
--   of row_to_json(NEW) into a two-column table)         58       56
-- 0008's header counted 2,000 statements in one transaction, where each expression is set up
-- once: its figures are lower than these.
--
-- A partitioned table gets two row triggers, sync_relay (INSERT or UPDATE) and
-- sync_relay_delete, where it had one. sync.untrack drops the new function too.

CREATE OR REPLACE FUNCTION sync.track(
    target      regclass,
    entity_type text,
    key_column  text DEFAULT 'id'
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    relay text := format('sync.%I', 'relay_' || target::oid);
    relay_delete text := format('sync.%I', 'relay_delete_' || target::oid);
    rekey text := format('sync.%I', 'rekey_' || target::oid);
    -- The wake-up that follows the outbox INSERT (0002, 0008); %s is 'FOUND AND ' in a
    -- statement trigger, which wakes nobody when its statement changed no row. sync.notify =
    -- 'always' notifies in every transaction, 'off' in none; unset, empty or 'auto', a
    -- transaction notifies while some consumer waits. Written as two tests so that the one every
    -- statement makes is small: PL/pgSQL sets up an expression again in every transaction, at a
    -- cost that grows with its size (0008's one CASE cost ~16k instructions a statement, these
    -- ~11k).
    wake_up text := $wake$
            IF %s(pg_sequence_last_value('sync.waiting_consumers') > 0
                  OR current_setting('sync.notify', true) = 'always') THEN
                IF coalesce(current_setting('sync.notify', true), '') <> 'off' THEN
                    PERFORM pg_notify('sync_outbox', '');  -- a wake-up only: no event data
                END IF;
            END IF;$wake$;
    partitioned boolean;
    key_named text;
    key_of text;
    template text;
    new_row text;
    old_row text;
    body text;
BEGIN
    IF entity_type IS NULL OR entity_type !~ '^[A-Za-z_][A-Za-z0-9_.-]{0,127}$' THEN
        RAISE EXCEPTION 'sync.track: entity type % is not an identifier', quote_literal(entity_type)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The key of a row (%1$s: r, NEW or OLD) as its JSON text. The relay refuses an empty or
    -- NULL one, but a key of a number, date, time, boolean, enum or uuid type in a NOT NULL
    -- column can be neither, and is not checked: the check's function call costs every
    -- statement ~10k instructions to set up, whether it is made or not. The text of an
    -- integer, a uuid, a text or a varchar is its JSON text, and is taken as it is (~3k
    -- instructions less than writing it as JSON and reading it back); a date or timestamp's
    -- JSON text is ISO 8601 whatever DateStyle says, so other types go through to_json.
    SELECT CASE
               WHEN a.attnotnull
                    AND t.oid IN ('int2'::regtype, 'int4'::regtype, 'int8'::regtype,
                                  'uuid'::regtype)
               THEN format('%%1$s.%I::text', key_column)
               WHEN a.attnotnull AND t.typcategory IN ('N', 'D', 'B', 'T', 'E')
               THEN format('to_json(%%1$s.%I) #>> %L', key_column, '{}')
               WHEN t.oid IN ('text'::regtype, 'varchar'::regtype)
               THEN format(
                   'coalesce(nullif(%%1$s.%I::text, %L), sync.refuse_empty_key(TG_RELID, %L))',
                   key_column, '', key_column
               )
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
    -- The bodies go in as quoted literals (%L), not dollar-quoted: no column name can end them.
    -- One function for upserts and one for deletes, each with no branch to take: PL/pgSQL
    -- sets up every expression it evaluates once per transaction (~2k instructions and more),
    -- and a producer's transaction is often one statement.
    IF partitioned THEN
        -- A row trigger, cloned onto every partition (statement triggers with transition
        -- tables are not).
        template := $body$
        BEGIN
            -- Generated by sync.track (sql/backend/0009_relay_per_operation.sql).
            INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
            VALUES (%1$L, %2$L, %4$s, to_json(%5$s));%3$s
            RETURN NULL;
        END;
        $body$;
    ELSE
        template := $body$
        BEGIN
            -- Generated by sync.track (sql/backend/0009_relay_per_operation.sql).
            -- sync_changed_rows: the statement's new rows, or its old ones for a DELETE.
            INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
            SELECT %1$L, %2$L, %4$s, to_json(%5$s) FROM sync_changed_rows AS %5$s;
            -- A statement that changed no row wrote nothing and wakes nobody.%3$s
            RETURN NULL;
        END;
        $body$;
    END IF;
    -- %1$L the operation, %2$L the entity type, %3$s the wake-up, %4$s the key, %5$s the row:
    -- r (a row of sync_changed_rows), NEW or OLD.
    new_row := CASE WHEN partitioned THEN 'NEW' ELSE 'r' END;
    old_row := CASE WHEN partitioned THEN 'OLD' ELSE 'r' END;
    wake_up := format(wake_up, CASE WHEN partitioned THEN '' ELSE 'FOUND AND ' END);
    EXECUTE format(
        'CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS %L', relay,
        format(template, 'upsert', entity_type, wake_up, format(key_of, new_row), new_row)
    );
    EXECUTE format(
        'CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS %L', relay_delete,
        format(template, 'delete', entity_type, wake_up, format(key_of, old_row), old_row)
    );
    -- Every relay trigger carries (entity type, key column): sync.tracked_tables reads them.
    IF partitioned THEN
        EXECUTE format(
            'CREATE TRIGGER sync_relay AFTER INSERT OR UPDATE ON %s '
            'FOR EACH ROW EXECUTE FUNCTION %s(%L, %L)',
            target, relay, entity_type, key_column
        );
        EXECUTE format(
            'CREATE TRIGGER sync_relay_delete AFTER DELETE ON %s '
            'FOR EACH ROW EXECUTE FUNCTION %s(%L, %L)',
            target, relay_delete, entity_type, key_column
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
            target, relay_delete, entity_type, key_column
        );
    END IF;
    body := format(
        $body$
        DECLARE
            key_taken boolean;
        BEGIN
            -- Generated by sync.track (sql/backend/0009_relay_per_operation.sql). Runs only when a key
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
    -- UPDATE OF the key column: an UPDATE that does not name the key skips the trigger before
    -- its WHEN clause is read back from its stored form and planned (~14k instructions in
    -- every such statement). A BEFORE UPDATE row trigger could change the key without the
    -- UPDATE naming it, so a table that has one keeps the trigger on every UPDATE (one added
    -- later needs sync.track again, as a renamed key column does).
    IF EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgrelid = target AND NOT tgisinternal
          AND (tgtype::integer & 19) = 19  -- ROW | BEFORE | UPDATE
    ) THEN
        key_named := '';
    ELSE
        key_named := format(' OF %I', key_column);
    END IF;
    EXECUTE format(
        'CREATE TRIGGER sync_rekey AFTER UPDATE%s ON %s FOR EACH ROW '
        'WHEN (OLD.%I IS DISTINCT FROM NEW.%I) EXECUTE FUNCTION %s(%L, %L)',
        key_named, target, key_column, key_column, rekey, entity_type, key_column
    );
END;
$$;


CREATE OR REPLACE FUNCTION sync.untrack(target regclass) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM sync.drop_relay_triggers(target);
    EXECUTE format('DROP FUNCTION IF EXISTS sync.%I()', 'relay_' || target::oid);
    EXECUTE format('DROP FUNCTION IF EXISTS sync.%I()', 'relay_delete_' || target::oid);
    EXECUTE format('DROP FUNCTION IF EXISTS sync.%I()', 'rekey_' || target::oid);
END;
$$;

-- Regenerate the relay of every tracked table.
SELECT sync.track(table_name, entity_type, key_column) FROM sync.tracked_tables;
