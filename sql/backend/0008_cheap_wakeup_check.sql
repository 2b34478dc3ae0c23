-- What the relay costs a producer, once more: its wake-up check no longer runs a query, the
-- outbox no longer has a BRIN index, integer, uuid and text keys are taken as they are, and an
-- UPDATE that does not name the key column skips the rekey trigger.
-- Instructions the relay adds to a one-row statement (callgrind, a single-user backend on a
-- fresh copy of one cluster for every run, 2,000 statements in one transaction, bigint key,
-- one consumer registered and busy; thousands):
--                                                    INSERT   UPDATE
--   0007                                                117      132
--   without the BRIN on created_at                      103
--   and the wake-up check reading a counter               80       95
--   and an integer key's text taken as it is             76       91
--   and the rekey trigger only on UPDATEs naming the
--   key column (0008)                                    76       78
--   for scale: the bench's minimal trigger (one INSERT
--   of row_to_json(NEW) into a two-column table, no
--   position, key or wake-up)                             48       52
--
-- The wake-up check. The relay notifies only while some consumer waits (0002), and asked
-- sync.consumer_waits with EXISTS (SELECT ...): a subquery, so PL/pgSQL ran it through the
-- executor, set up and torn down in every statement (~23k instructions). A counter of waiting
-- consumers in a sequence is read by pg_sequence_last_value(), a function call PL/pgSQL
-- evaluates as a simple expression (~2k). A trigger on sync.consumer_waits recounts after every
-- change to it, under a transaction-scoped advisory lock, so two consumers changing their flags
-- at once recount one after the other and the later recount sees the earlier one's commit.
-- setval() takes effect at once, before the consumer's transaction commits, and a producer sees
-- it without a snapshot: a consumer is counted before it reads once more and sleeps, so the
-- argument of 0002 (no wake-up is lost) holds as it did. A recount that is rolled back leaves
-- the counter as it set it; the next change to the table sets it right. The sequence is
-- unlogged like the table: after a crash both start empty (pg_sequence_last_value() is NULL,
-- no consumer waits) until consumers announce themselves again. A role that writes to tracked
-- tables now needs USAGE or SELECT on the sequence instead of SELECT on sync.consumer_waits.
--
-- The BRIN on created_at cost every outbox row ~14k instructions: an INSERT run by a trigger is
-- a new executor, and each builds the BRIN's descriptor again (brininsert). It served only
-- `serversync cleanup`'s count of old rows and `serversync offsets reset --to-datetime`, both
-- occasional operator commands; they now scan the outbox (its rows in position order are also
-- nearly in time order, and the deletes already walk the primary key).

DROP INDEX sync.events_outbox_created_at_idx;

CREATE UNLOGGED SEQUENCE sync.waiting_consumers MINVALUE 0 START 0;

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

SELECT setval('sync.waiting_consumers',
              (SELECT count(*) FROM sync.consumer_waits WHERE waiting), true);

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
            ELSE pg_sequence_last_value('sync.waiting_consumers') > 0
        END$check$;
    partitioned boolean;
    key_named text;
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
    -- The body goes in as a quoted literal (%L), not dollar-quoted: no column name can end it.
    body := format(
        $body$
        DECLARE
            event_op text;
            event_key text;
            event_row json;
        BEGIN
            -- Generated by sync.track (sql/backend/0008_cheap_wakeup_check.sql).
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
            VALUES (event_op, %1$L, event_key, event_row);
            IF (%2$s) THEN
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
            -- Generated by sync.track (sql/backend/0008_cheap_wakeup_check.sql). Runs only when a key
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

-- Regenerate the relay of every tracked table.
SELECT sync.track(table_name, entity_type, key_column) FROM sync.tracked_tables;
