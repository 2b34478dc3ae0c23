-- The relay for tables and columns of any legal name. What sync.track generated, and what read
-- its triggers back, broke on names a user may legally give:
--
-- * A column named r. The statement relay reads the changed rows as
--   `FROM sync_changed_rows AS r` and wrote `to_json(r)`: a bare name is a column before it is a
--   table's whole row, so the payload was that column's value. It now writes `to_json(r.*)`,
--   which names the alias's whole row and nothing else (no column can be called r.*), and
--   parses to the same whole-row reference that `r` did when no column shadowed it.
-- * A % in the key column's name. The key's expression was made by a format() whose result,
--   with the quoted name in it, was the format string of a second format() that put in the row
--   (r, NEW or OLD): `k%1$s` became the column kr, `share%%` the column share% (no such column:
--   every write failed), and `a%sb` or `%I` made sync.track fail for want of arguments. The
--   expression is now made in one format() (sync.relay_key_expression), whose format string is a
--   constant and whose arguments are the row and the name (%I) or its text (%L).
-- * A key column name holding the text \000. sync.tracked_tables escaped the trigger's arguments
--   (encode(tgargs, 'escape')), split the text at '\000' and read each part back as bytea: such
--   a name was cut inside itself and left a lone backslash, which is no bytea, so the view
--   failed, and with it every migration that regenerates the relays from it. The view now cuts
--   the bytes of tgargs at their NUL bytes (no name can hold one) and decodes each part as it
--   is, in the database's encoding.
-- * A column named tg_relid, with a key of text or of a nullable column. The refusal of an
--   empty key names the table by TG_RELID, in the statement that reads the changed rows: with
--   that column the reference is ambiguous (PL/pgSQL's default, variable_conflict = error) and
--   every write to the table failed. The generated functions declare
--   `#variable_conflict use_variable`: their SQL names no column unqualified, so every bare
--   name in it is one of PL/pgSQL's (TG_RELID), and the option is read once, when the function
--   is compiled.
--
-- The rule this keeps, in the generated code and in what generates it: a format string is a
-- constant; a user's name goes in as an argument, through %I where it is an identifier and %L
-- where it is a value; a column is always qualified by the row it belongs to (r, NEW, OLD); a
-- table is named as %I.%I of its schema and name, so no search_path decides what it means.
-- The relay keeps its shape (one function for upserts and one for deletes; statement triggers
-- with a transition table on an ordinary table, row triggers on a partitioned one) and its
-- statements: only the text of the names in them changes. Instructions the relay adds to a
-- single-row statement that is its own transaction (`python -m bench instructions`, bigint key;
-- thousands): INSERT 89.3 under 0009 and 89.3 under 0011, UPDATE 86.3 and 86.4.
-- sync.untrack (0009) and sync.refuse_empty_key (0007) already took names only as values or
-- through %I and stay as they are.
--
-- The relay of every tracked table is generated again, from the view redefined first.

CREATE OR REPLACE VIEW sync.tracked_tables AS
SELECT t.tgrelid::regclass AS table_name,
       convert_from(substr(t.tgargs, 1, cut.at - 1), getdatabaseencoding()) AS entity_type,
       convert_from(substr(t.tgargs, cut.at + 1, length(t.tgargs) - cut.at - 1),
                    getdatabaseencoding()) AS key_column
FROM pg_trigger t
     -- tgargs: the entity type, NUL, the key column, NUL (every relay trigger has these two).
     CROSS JOIN LATERAL (SELECT position(decode('00', 'hex') IN t.tgargs) AS at) cut
WHERE t.tgname = 'sync_relay' AND NOT t.tgisinternal AND t.tgparentid = 0 AND t.tgnargs = 2;

-- The key of a row as its JSON text, as an expression of the generated relay: `row_ref` is the
-- row (r, NEW or OLD; never a user's name), `key_column` the key's name. NULL when the table has
-- no such column. The relay refuses an empty or NULL key, but a key of a number, date, time,
-- boolean, enum or uuid type in a NOT NULL column can be neither, and is not checked: the
-- check's function call costs every statement ~10k instructions to set up, whether it is made
-- or not. The text of an integer, a uuid, a text or a varchar is its JSON text, and is taken as
-- it is; a date or timestamp's JSON text is ISO 8601 whatever DateStyle says, so other types go
-- through to_json (0008).
CREATE FUNCTION sync.relay_key_expression(target regclass, key_column text, row_ref text)
RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
               WHEN a.attnotnull
                    AND t.oid IN ('int2'::regtype, 'int4'::regtype, 'int8'::regtype,
                                  'uuid'::regtype)
               THEN format('%s.%I::text', row_ref, key_column)
               WHEN a.attnotnull AND t.typcategory IN ('N', 'D', 'B', 'T', 'E')
               THEN format('to_json(%s.%I) #>> %L', row_ref, key_column, '{}')
               WHEN t.oid IN ('text'::regtype, 'varchar'::regtype)
               THEN format(
                   'coalesce(nullif(%s.%I::text, %L), sync.refuse_empty_key(TG_RELID, %L))',
                   row_ref, key_column, '', key_column
               )
               ELSE format(
                   'coalesce(nullif(to_json(%s.%I) #>> %L, %L), '
                   'sync.refuse_empty_key(TG_RELID, %L))',
                   row_ref, key_column, '{}', '', key_column
               )
           END
      FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
     WHERE a.attrelid = target AND a.attname = key_column AND a.attnum > 0
       AND NOT a.attisdropped;
$$;

-- The relay's triggers on a table, whichever of them it has (none, when it was never tracked;
-- a partition's clones go with its parent's trigger).
CREATE OR REPLACE FUNCTION sync.drop_relay_triggers(target regclass) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    existing text;
    qualified text;
BEGIN
    SELECT format('%I.%I', n.nspname, c.relname) INTO qualified
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = target;
    FOR existing IN
        SELECT tgname FROM pg_trigger
        WHERE tgrelid = target AND tgparentid = 0
          AND tgname IN ('sync_relay', 'sync_relay_update', 'sync_relay_delete', 'sync_rekey')
    LOOP
        EXECUTE format('DROP TRIGGER %I ON %s', existing, qualified);
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
    relay_delete text := format('sync.%I', 'relay_delete_' || target::oid);
    rekey text := format('sync.%I', 'rekey_' || target::oid);
    -- The wake-up that follows the outbox INSERT (0002, 0008, 0009); its %s is 'FOUND AND ' in
    -- a statement trigger, which wakes nobody when its statement changed no row, and empty in a
    -- row trigger.
    wake_up text := $wake$
            IF %s(pg_sequence_last_value('sync.waiting_consumers') > 0
                  OR current_setting('sync.notify', true) = 'always') THEN
                IF coalesce(current_setting('sync.notify', true), '') <> 'off' THEN
                    PERFORM pg_notify('sync_outbox', '');  -- a wake-up only: no event data
                END IF;
            END IF;$wake$;
    qualified text;
    partitioned boolean;
    key_named text;
    template text;
    new_row text;
    old_row text;
    body text;
BEGIN
    IF entity_type IS NULL OR entity_type !~ '^[A-Za-z_][A-Za-z0-9_.-]{0,127}$' THEN
        RAISE EXCEPTION 'sync.track: entity type % is not an identifier', quote_literal(entity_type)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF sync.relay_key_expression(target, key_column, 'r') IS NULL THEN
        RAISE EXCEPTION 'sync.track: table % has no column %', target, quote_ident(key_column)
            USING ERRCODE = 'undefined_column';
    END IF;
    SELECT format('%I.%I', n.nspname, c.relname), c.relkind = 'p' INTO qualified, partitioned
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = target;
    PERFORM sync.drop_relay_triggers(target);
    -- The bodies go in as quoted literals (%L), not dollar-quoted: no name can end them. One
    -- function for upserts and one for deletes, each with no branch to take (0009). Their SQL
    -- names every column through its row, r, NEW or OLD, and a row as a whole as r.* (a bare r
    -- would be a column named r); any other bare name is one of PL/pgSQL's (TG_RELID), which
    -- `#variable_conflict use_variable` says even where a column has the same name.
    IF partitioned THEN
        -- A row trigger, cloned onto every partition (statement triggers with transition
        -- tables are not).
        template := $body$#variable_conflict use_variable
        BEGIN
            -- Generated by sync.track (sql/backend/0011_relay_any_identifier.sql).
            INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
            VALUES (%1$L, %2$L, %4$s, to_json(%5$s));%3$s
            RETURN NULL;
        END;
        $body$;
        new_row := 'NEW';
        old_row := 'OLD';
    ELSE
        template := $body$#variable_conflict use_variable
        BEGIN
            -- Generated by sync.track (sql/backend/0011_relay_any_identifier.sql).
            -- sync_changed_rows: the statement's new rows, or its old ones for a DELETE.
            INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
            SELECT %1$L, %2$L, %4$s, to_json(%5$s.*) FROM sync_changed_rows AS %5$s;
            -- A statement that changed no row wrote nothing and wakes nobody.%3$s
            RETURN NULL;
        END;
        $body$;
        new_row := 'r';
        old_row := 'r';
    END IF;
    -- %1$L the operation, %2$L the entity type, %3$s the wake-up, %4$s the key, %5$s the row.
    wake_up := format(wake_up, CASE WHEN partitioned THEN '' ELSE 'FOUND AND ' END);
    EXECUTE format(
        'CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS %L', relay,
        format(template, 'upsert', entity_type, wake_up,
               sync.relay_key_expression(target, key_column, new_row), new_row)
    );
    EXECUTE format(
        'CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS %L', relay_delete,
        format(template, 'delete', entity_type, wake_up,
               sync.relay_key_expression(target, key_column, old_row), old_row)
    );
    -- Every relay trigger carries (entity type, key column): sync.tracked_tables reads them.
    IF partitioned THEN
        EXECUTE format(
            'CREATE TRIGGER sync_relay AFTER INSERT OR UPDATE ON %s '
            'FOR EACH ROW EXECUTE FUNCTION %s(%L, %L)',
            qualified, relay, entity_type, key_column
        );
        EXECUTE format(
            'CREATE TRIGGER sync_relay_delete AFTER DELETE ON %s '
            'FOR EACH ROW EXECUTE FUNCTION %s(%L, %L)',
            qualified, relay_delete, entity_type, key_column
        );
    ELSE
        EXECUTE format(
            'CREATE TRIGGER sync_relay AFTER INSERT ON %s '
            'REFERENCING NEW TABLE AS sync_changed_rows '
            'FOR EACH STATEMENT EXECUTE FUNCTION %s(%L, %L)',
            qualified, relay, entity_type, key_column
        );
        EXECUTE format(
            'CREATE TRIGGER sync_relay_update AFTER UPDATE ON %s '
            'REFERENCING NEW TABLE AS sync_changed_rows '
            'FOR EACH STATEMENT EXECUTE FUNCTION %s(%L, %L)',
            qualified, relay, entity_type, key_column
        );
        EXECUTE format(
            'CREATE TRIGGER sync_relay_delete AFTER DELETE ON %s '
            'REFERENCING OLD TABLE AS sync_changed_rows '
            'FOR EACH STATEMENT EXECUTE FUNCTION %s(%L, %L)',
            qualified, relay_delete, entity_type, key_column
        );
    END IF;
    body := format(
        $body$#variable_conflict use_variable
        DECLARE
            key_taken boolean;
        BEGIN
            -- Generated by sync.track (sql/backend/0011_relay_any_identifier.sql). Runs only
            -- when a key changed, so the lookup may be planned on every call; TG_TABLE_SCHEMA
            -- and TG_TABLE_NAME keep it right after the table is renamed.
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM %%I.%%I WHERE %%I = $1)',
                           TG_TABLE_SCHEMA, TG_TABLE_NAME, %1$L)
                INTO key_taken USING OLD.%1$I;
            IF key_taken THEN
                RETURN NULL;  -- another row took the old key in the same statement
            END IF;
            INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
            VALUES ('delete', %2$L, %3$s, to_json(OLD));
            RETURN NULL;
        END;
        $body$,
        key_column, entity_type, sync.relay_key_expression(target, key_column, 'OLD')
    );
    EXECUTE format(
        'CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql AS %L', rekey, body
    );
    -- UPDATE OF the key column: an UPDATE that does not name the key skips the trigger before
    -- its WHEN clause is read back from its stored form and planned (~14k instructions in
    -- every such statement). A BEFORE UPDATE row trigger could change the key without the
    -- UPDATE naming it, so a table that has one keeps the trigger on every UPDATE (one added
    -- later needs sync.track again, as a renamed key column does). In a trigger's WHEN clause
    -- OLD and NEW are the only relations, and the key is named through them.
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
        key_named, qualified, key_column, key_column, rekey, entity_type, key_column
    );
END;
$$;

-- Regenerate the relay of every tracked table.
SELECT sync.track(table_name, entity_type, key_column) FROM sync.tracked_tables;
