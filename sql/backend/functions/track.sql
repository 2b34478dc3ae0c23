-- sync.track and sync.untrack: the relay, generated for each tracked table.
--
-- A function file: `serversync migrate` applies it after the versioned migrations, again
-- whenever its text or functions/relay.sql changes, and it ends by generating the relay of every
-- tracked table again, so a change here reaches every table at the next migrate. Every statement
-- may run again on a database that has it: CREATE OR REPLACE, with the signatures it has.
--
-- What sync.track(table, entity type, key column, both ways) makes for a table, and why:
-- * Its own trigger functions, sync.relay_<oid> (upserts), sync.relay_delete_<oid> (deletes) and
--   sync.rekey_<oid> (a changed key), named by the table's oid so a renamed table keeps them.
--   The entity type is a constant in them and the key is read straight from the row, so each
--   change costs one to_json of the row and one INSERT; each does one thing, with no branch
--   and no variable: PL/pgSQL sets up every expression it evaluates once per transaction, and a
--   producer's transaction is often a single statement.
-- * On an ordinary table, statement triggers with a transition table (sync_relay on INSERT,
--   sync_relay_update, sync_relay_delete; a transition table serves one event only): a statement
--   that changes many rows writes their outbox rows with one INSERT ... SELECT, where a row
--   trigger pays the executor's set-up once per row. A partitioned table gets row triggers
--   (sync_relay on INSERT or UPDATE, sync_relay_delete) instead: PostgreSQL clones row triggers
--   onto every partition, attached later too, so writes made straight to a partition are
--   relayed, which the parent's statement triggers would miss.
-- * sync_rekey, a row trigger that fires only WHEN the key changed, and only on UPDATEs that name
--   the key column (UPDATE OF skips the trigger before its WHEN clause is planned; a table with
--   a BEFORE UPDATE row trigger, which could change the key unnamed, keeps it on every UPDATE).
--   Row triggers fire before statement triggers, so the old key's delete precedes the new key's
--   upsert. It runs at the end of the statement and sends the delete only if no row holds the
--   old key by then: keys swapped within one statement are two upserts.
-- * Every trigger carries (entity type, key column) as arguments, and 'both_ways' as a third
--   for a table tracked both ways: sync.tracked_tables reads them.
--
-- A table that already holds rows when it is first tracked (or tracked as another entity type,
-- or by another key): the relay sends changes only, so sync.track says, in a NOTICE, that those
-- rows reach consumers only by a snapshot (`serversync snapshot TABLE`), and records in
-- sync.outbox_history that the outbox no longer holds the whole history (so a consumer
-- registered later starts with a snapshot). Tracking a table again as it is tracked, as the
-- regeneration at the end of this file does, says and records nothing.
--
-- Both ways (sync.track(..., both_ways => true); 0002_both_directions.sql): a table edited here
-- and on another node, whose changes travel both ways. Its relay versions every changed row in
-- sync.row_versions, in one statement per trigger call (both_ways_insert below):
-- * a local edit takes the hybrid clock, greatest(clock_timestamp(), the stored version + 1
--   microsecond), with this node's name: it follows every version of the row this node has
--   seen, even one from a node whose clock runs ahead, and two changes of a row in one
--   transaction get two increasing versions. The outbox row's created_at is that version, its
--   origin NULL.
-- * inside a receiver's apply, the receiver wrote the row's version first, marked with its
--   transaction (applied_xact): the change goes on with that version as created_at and its node
--   as origin, so the next node orders it as the first one did. A row whose version this
--   transaction did not write (a change made by a trigger of the user's) is a local edit, even
--   when an older version of it is stored.
-- * a delete is a version too (deleted = true), and so is the old key of a changed key.
-- It needs this node's name (sync.node). It costs what one-way tables do not pay: a version
-- row's upsert per changed row, and a statement with four parts; one-way tables keep their
-- templates, and learn an apply's origin from the outbox column's default.
--
-- Least privilege. The generated functions are SECURITY DEFINER with `SET search_path =
-- pg_catalog, pg_temp` (PostgreSQL's "Writing SECURITY DEFINER Functions Safely"), every object
-- of serversync in them schema-qualified, and they belong to serversync_relay, which holds only
-- what they use (schema.sql, Roles and grants) plus, per table, SELECT on the key column
-- and a policy sync_relay_rekey FOR SELECT USING (true) for the rekey check, which must see
-- every row whatever row level security the table has or gets. Without that role, or without
-- membership in it, they belong to the role that runs sync.track, with a NOTICE saying so.
-- Handing a function over needs CREATE on its schema unless a superuser does it: lent to
-- serversync_relay for those statements only, inside the transaction. A producer needs no
-- privilege on the schema sync. Then:
-- * Only the owner of a table may track it (SQLSTATE 42501): tracking decides which rows go out
--   as which entity type, and grants the relay's role a column of the table.
-- * No code chosen by a role other than the table's owner runs inside the relay: casts to json
--   of a column's type (recursively through arrays, domains, composites, ranges), the key's `=`
--   and the table's policies run as serversync_relay, so sync.relay_refusal refuses a table
--   where any of them belongs to a role that is no superuser and not the owner or a role it is
--   a member of, and a table with a RESTRICTIVE policy (which the permissive one does not
--   override). One added later makes the rekey check refuse the key change (the producer's
--   statement fails) rather than send a delete of a live entity.
-- * EXECUTE on sync.track, sync.untrack and the generated functions is revoked from PUBLIC: a
--   trigger fires its function whatever the writer's privileges, while CREATE TRIGGER needs
--   EXECUTE on it, so no one can attach a relay function, whose entity type is written into it,
--   to a table of their own.
--
-- What it costs. Instructions the relay adds to a single-row statement that is its own
-- transaction (`python -m bench instructions`, bigint key; thousands), as a superuser: INSERT
-- 115.9, UPDATE 113.3, against 125.1 and 166.3 for the untracked statement (as a producer role,
-- measured before the outbox had an origin: INSERT 114.1, UPDATE 108.8, each ~3.8k and ~1.1k over
-- the superuser's). The origin column's default costs ~5.6k of it, in every outbox row; the
-- design keeps it, as the one way a one-way relay learns an apply's origin without a branch of
-- its own. SECURITY DEFINER costs ~10k (the user id switch and a search path
-- computed again), the SET clause ~8.5k more on PostgreSQL 15 (AtEOXact_GUC walks every
-- setting; 16 restores only those a function changed). The SET clause stays: without it the
-- relay's safety would rest on every name in what sync.track generates, now and later, being
-- qualified, and one that is not would let any producer run code as serversync_relay.

CREATE OR REPLACE FUNCTION sync.track(
    target      regclass,
    entity_type text,
    key_column  text DEFAULT 'id',
    both_ways   boolean DEFAULT false
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    relay text := format('sync.%I', 'relay_' || target::oid);
    relay_delete text := format('sync.%I', 'relay_delete_' || target::oid);
    rekey text := format('sync.%I', 'rekey_' || target::oid);
    -- The wake-up that follows the outbox INSERT (schema.sql, The wake-up); its %s is
    -- 'FOUND AND ' in a statement trigger, which wakes nobody when its statement changed no row,
    -- and empty in a row trigger. Two small tests rather than one CASE: PL/pgSQL sets up every
    -- expression again in each transaction, at a cost that grows with its size.
    wake_up text := $wake$
            IF %s(pg_sequence_last_value('sync.waiting_consumers') > 0
                  OR current_setting('sync.notify', true) = 'always') THEN
                IF coalesce(current_setting('sync.notify', true), '') <> 'off' THEN
                    PERFORM pg_notify('sync_outbox', '');  -- a wake-up only: no event data
                END IF;
            END IF;$wake$;
    -- The outbox INSERT of a table tracked both ways (the head comment, Both ways): %1$L the
    -- operation, %2$L the entity type, %4$s the key, %5$s the payload, %6$s whether the version
    -- is a delete, %7$s the FROM clause of the changed rows (none in a row trigger, whose row is
    -- NEW or OLD), %8$s when the version the receiver wrote is taken (never, in the rekey check:
    -- a receiver's apply changes no key). One statement, so that FOUND says whether it wrote.
    both_ways_insert text := $insert$
            WITH changed AS MATERIALIZED (
                SELECT (%4$s) COLLATE pg_catalog."C" AS entity_id, %5$s AS payload%7$s
            ), applied AS MATERIALIZED (
                -- The receiver's apply: it wrote each row's version first, and the change goes
                -- on with that version and the node it came from.
                SELECT v.entity_id, v.version_ts, v.version_node
                  FROM sync.row_versions AS v
                 WHERE %8$s
                   AND v.entity_type = %2$L
                   AND v.entity_id IN (SELECT c.entity_id FROM changed AS c)
            ), made_here AS (
                -- A local edit (or a row an apply wrote no version for): the hybrid clock,
                -- after every version of the row this node has seen.
                INSERT INTO sync.row_versions AS v
                       (entity_type, entity_id, version_ts, version_node, deleted)
                SELECT %2$L, d.entity_id, pg_catalog.clock_timestamp(),
                       (SELECT n.name FROM sync.node AS n), %6$s
                  FROM (SELECT DISTINCT c.entity_id FROM changed AS c
                         WHERE c.entity_id NOT IN (SELECT a.entity_id FROM applied AS a)) AS d
                ON CONFLICT (entity_type, entity_id) DO UPDATE
                   SET version_ts = GREATEST(EXCLUDED.version_ts,
                                             v.version_ts + interval '1 microsecond'),
                       version_node = EXCLUDED.version_node,
                       deleted = EXCLUDED.deleted,
                       applied_xact = NULL
                RETURNING v.entity_id, v.version_ts, NULL::text AS version_node
            )
            INSERT INTO sync.events_outbox
                   (op, entity_type, entity_id, payload, created_at, origin)
            SELECT %1$L, %2$L, c.entity_id, c.payload, w.version_ts, w.version_node
              FROM changed AS c
                   JOIN (SELECT * FROM applied UNION ALL SELECT * FROM made_here) AS w
                     ON w.entity_id = c.entity_id;$insert$;
    applying text := $applying$v.applied_xact = pg_catalog.pg_current_xact_id()$applying$;
    -- Every generated function runs as its owner, with a search_path no caller can change.
    create_function text := 'CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql '
                            'SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS %L';
    definer text := current_user;
    as_relay boolean := false;
    lend_create boolean;
    table_owner oid;
    table_schema text;
    qualified text;
    partitioned boolean;
    key_named text;
    key_type text;
    key_equals text;
    equals_schema text;
    needed_schema text;
    template text;
    new_row text;
    old_row text;
    body text;
    refusal text[];
    payload_of text;
    changed_rows text;
    rekey_delete text;
    both_ways_argument text := '';
    tracked_before boolean;
    holds_rows boolean := false;
    shell_name text;
BEGIN
    both_ways := coalesce(both_ways, false);
    IF entity_type IS NULL OR entity_type !~ '^[A-Za-z_][A-Za-z0-9_.-]{0,127}$' THEN
        RAISE EXCEPTION 'sync.track: entity type % is not an identifier', quote_literal(entity_type)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF sync.relay_key_expression(target, key_column, 'r') IS NULL THEN
        RAISE EXCEPTION 'sync.track: table % has no column %', target, quote_ident(key_column)
            USING ERRCODE = 'undefined_column';
    END IF;
    SELECT format('%I.%I', n.nspname, c.relname), n.nspname, c.relkind = 'p', c.relowner
      INTO qualified, table_schema, partitioned, table_owner
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = target;
    -- A version names the node that made it: a table edited here and elsewhere needs a name.
    IF both_ways AND sync.node_name() IS NULL THEN
        RAISE EXCEPTION 'sync.track: table % cannot be tracked both ways: this database has no '
                        'node name', target
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Name it with `serversync migrate --node NAME` (or SELECT '
                         'sync.set_node_name(''NAME'')), then track the table again.';
    END IF;
    -- Tracking decides which rows go out as which entity type, and grants the relay's role a
    -- column of the table: only the table's owner (or a role with its privileges) may do it.
    IF NOT pg_has_role(current_user, table_owner, 'USAGE') THEN
        RAISE EXCEPTION 'sync.track: only the owner of table % may track it', target
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    -- No code of a role other than the table's owner may run inside the relay.
    refusal := sync.relay_refusal(target, key_column);
    IF refusal IS NOT NULL THEN
        RAISE EXCEPTION '%', refusal[1]
            USING ERRCODE = 'insufficient_privilege', HINT = refusal[2];
    END IF;
    -- Who the generated functions run as: serversync_relay, when it exists and the caller may
    -- hand objects to it; else the caller, which must then be able to write the outbox.
    IF to_regrole('serversync_relay') IS NOT NULL THEN
        as_relay := pg_has_role(current_user, 'serversync_relay', 'USAGE');
    END IF;
    IF as_relay THEN
        definer := 'serversync_relay';
    ELSE
        IF NOT has_table_privilege('sync.events_outbox', 'INSERT') THEN
            RAISE EXCEPTION 'sync.track: % may neither act as role serversync_relay nor write '
                            'sync.events_outbox', current_user
                USING ERRCODE = 'insufficient_privilege',
                      HINT = 'Run sync.track as the role that ran serversync migrate.';
        END IF;
        RAISE NOTICE 'sync.track: the relay of % runs as %: role serversync_relay is missing or '
                     '% may not act as it (docs/security.md, Roles and grants)',
                     target, current_user, current_user;
    END IF;
    -- The rekey check compares keys with the equality operator the caller's search_path gives
    -- the key's type now, schema-qualified: the check runs with search_path pg_catalog.
    SELECT format_type(a.atttypid, NULL) INTO key_type
      FROM pg_attribute a
     WHERE a.attrelid = target AND a.attname = key_column AND a.attnum > 0
       AND NOT a.attisdropped;
    SELECT format('OPERATOR(%I.%s)', n.nspname, o.oprname), n.nspname
      INTO key_equals, equals_schema
      FROM pg_operator o JOIN pg_namespace n ON n.oid = o.oprnamespace
     WHERE o.oid = to_regoperator(format('=(%s,%s)', key_type, key_type));
    IF key_equals IS NULL THEN
        -- No operator of exactly that type (varchar, a domain): PostgreSQL's own choice among
        -- the built-in ones.
        key_equals := 'OPERATOR(pg_catalog.=)';
        equals_schema := 'pg_catalog';
    END IF;
    -- Tracked already, as this entity type by this key: its rows went out as changes since it
    -- was first tracked, and tracking it again (as a migration regenerates every relay) leaves
    -- the outbox's history whole.
    tracked_before := EXISTS (SELECT 1 FROM sync.tracked_tables t
                               WHERE t.table_name = target
                                 AND t.entity_type = track.entity_type
                                 AND t.key_column = track.key_column);
    PERFORM sync.drop_relay_triggers(target);
    -- The bodies go in as quoted literals (%L), not dollar-quoted: no name can end them. One
    -- function for upserts and one for deletes, each with no branch to take. Their SQL
    -- names every column through its row, r, NEW or OLD, and a row as a whole as r.* (a bare r
    -- would be a column named r); any other bare name is one of PL/pgSQL's (TG_RELID), which
    -- `#variable_conflict use_variable` says even where a column has the same name.
    IF partitioned THEN
        -- A row trigger, cloned onto every partition (statement triggers with transition
        -- tables are not).
        template := $body$#variable_conflict use_variable
        BEGIN
            -- Generated by sync.track (sql/backend/functions/track.sql).
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
            -- Generated by sync.track (sql/backend/functions/track.sql).
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
    IF both_ways THEN
        template := $body$#variable_conflict use_variable
        BEGIN
            -- Generated by sync.track (sql/backend/functions/track.sql), tracked both ways.$body$
            || both_ways_insert || $body$%3$s
            RETURN NULL;
        END;
        $body$;
        both_ways_argument := ', ''both_ways''';
    END IF;
    IF partitioned THEN
        payload_of := 'to_json(%s)';
        changed_rows := '';
    ELSE
        payload_of := 'to_json(%s.*)';
        changed_rows := ' FROM sync_changed_rows AS r';
    END IF;
    -- %1$L the operation, %2$L the entity type, %3$s the wake-up, %4$s the key, %5$s the row;
    -- a table tracked both ways: %5$s its payload, %6$s .. %8$s (both_ways_insert).
    wake_up := format(wake_up, CASE WHEN partitioned THEN '' ELSE 'FOUND AND ' END);
    EXECUTE format(
        create_function, relay,
        format(template, 'upsert', entity_type, wake_up,
               sync.relay_key_expression(target, key_column, new_row),
               CASE WHEN both_ways THEN format(payload_of, new_row) ELSE new_row END,
               'false', changed_rows, applying)
    );
    EXECUTE format(
        create_function, relay_delete,
        format(template, 'delete', entity_type, wake_up,
               sync.relay_key_expression(target, key_column, old_row),
               CASE WHEN both_ways THEN format(payload_of, old_row) ELSE old_row END,
               'true', changed_rows, applying)
    );
    -- The old key's delete: of a table tracked both ways, a version too.
    IF both_ways THEN
        rekey_delete := format(both_ways_insert, 'delete', entity_type, '',
                               sync.relay_key_expression(target, key_column, 'OLD'),
                               'to_json(OLD)', 'true', '', 'false');
    ELSE
        rekey_delete := format(
            $insert$
            INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
            VALUES ('delete', %L, %s, to_json(OLD));$insert$,
            entity_type, sync.relay_key_expression(target, key_column, 'OLD')
        );
    END IF;
    body := format(
        $body$#variable_conflict use_variable
        DECLARE
            key_taken boolean;
        BEGIN
            -- Generated by sync.track (sql/backend/functions/track.sql). Runs only when a
            -- key changed, so the lookup may be planned on every call. The table is
            -- named from its oid when the lookup runs, so a renamed table is still found; a
            -- partitioned one is read through its parent, whose rows hold the key. A
            -- RESTRICTIVE policy added since sync.track would hide rows from the check (a key
            -- taken would go unseen, and a live entity be deleted downstream) and run its
            -- code as this role: the key change is refused instead, before the policy is read.
            IF pg_catalog.row_security_active(%4$L::oid) AND EXISTS (
                SELECT 1 FROM pg_catalog.pg_policy p
                 WHERE p.polrelid = %4$L::oid AND NOT p.polpermissive
                   AND p.polcmd IN ('r', '*')
                   AND (0::oid OPERATOR(pg_catalog.=) ANY (p.polroles)
                        OR EXISTS (SELECT 1 FROM pg_catalog.unnest(p.polroles) AS r(oid)
                                    WHERE pg_catalog.pg_has_role(r.oid, 'MEMBER')))
            ) THEN
                RAISE EXCEPTION 'serversync: the key of a row of %% changed, and the table has a '
                                'RESTRICTIVE policy, which hides rows from the relay''s check '
                                'that no other row took the old key', %4$L::oid::regclass
                    USING ERRCODE = 'insufficient_privilege',
                          HINT = 'Drop the policy, or make it PERMISSIVE, then run sync.track '
                                 'on the table again.';
            END IF;
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM %%s AS t WHERE t.%%I %%s $1)',
                           %4$L::oid::regclass, %1$L, %3$L)
                INTO key_taken USING OLD.%1$I;
            IF key_taken THEN
                RETURN NULL;  -- another row took the old key in the same statement
            END IF;%5$s
            RETURN NULL;
        END;
        $body$,
        key_column, entity_type, key_equals, target::oid, rekey_delete
    );
    EXECUTE format(create_function, rekey, body);
    -- No one calls them but their triggers: CREATE TRIGGER needs EXECUTE on the function, a
    -- trigger that fires does not.
    EXECUTE format('REVOKE ALL ON FUNCTION %s(), %s(), %s() FROM PUBLIC',
                   relay, relay_delete, rekey);
    -- Every relay trigger carries (entity type, key column): sync.tracked_tables reads them.
    IF partitioned THEN
        EXECUTE format(
            'CREATE TRIGGER sync_relay AFTER INSERT OR UPDATE ON %s '
            'FOR EACH ROW EXECUTE FUNCTION %s(%L, %L%s)',
            qualified, relay, entity_type, key_column, both_ways_argument
        );
        EXECUTE format(
            'CREATE TRIGGER sync_relay_delete AFTER DELETE ON %s '
            'FOR EACH ROW EXECUTE FUNCTION %s(%L, %L%s)',
            qualified, relay_delete, entity_type, key_column, both_ways_argument
        );
    ELSE
        EXECUTE format(
            'CREATE TRIGGER sync_relay AFTER INSERT ON %s '
            'REFERENCING NEW TABLE AS sync_changed_rows '
            'FOR EACH STATEMENT EXECUTE FUNCTION %s(%L, %L%s)',
            qualified, relay, entity_type, key_column, both_ways_argument
        );
        EXECUTE format(
            'CREATE TRIGGER sync_relay_update AFTER UPDATE ON %s '
            'REFERENCING NEW TABLE AS sync_changed_rows '
            'FOR EACH STATEMENT EXECUTE FUNCTION %s(%L, %L%s)',
            qualified, relay, entity_type, key_column, both_ways_argument
        );
        EXECUTE format(
            'CREATE TRIGGER sync_relay_delete AFTER DELETE ON %s '
            'REFERENCING OLD TABLE AS sync_changed_rows '
            'FOR EACH STATEMENT EXECUTE FUNCTION %s(%L, %L%s)',
            qualified, relay_delete, entity_type, key_column, both_ways_argument
        );
    END IF;
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
    -- A table that holds rows when it is first tracked: the relay sends changes only, so those
    -- rows reach a consumer only by a snapshot, and the outbox no longer holds the whole history
    -- (a consumer registered from now on starts with a snapshot). Whether it holds any is one
    -- row read, never a count.
    IF NOT tracked_before THEN
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s LIMIT 1)', target) INTO holds_rows;
    END IF;
    IF holds_rows THEN
        -- The table's name as a shell word for the hint: quoted when it is more than letters,
        -- digits, '_' and '.'.
        shell_name := target::text;
        IF shell_name !~ '^[A-Za-z0-9_.]+$' THEN
            shell_name := '''' || replace(shell_name, '''', '''\''''') || '''';
        END IF;
        IF NOT has_table_privilege('sync.outbox_history', 'SELECT, UPDATE') THEN
            RAISE EXCEPTION 'sync.track: table % already holds rows, and % may not record that '
                            'the outbox lacks their history (sync.outbox_history)',
                            target, current_user
                USING ERRCODE = 'insufficient_privilege',
                      HINT = 'Run sync.track as the role that ran serversync migrate.';
        END IF;
        UPDATE sync.outbox_history h
           SET complete = false, since = now(),
               reason = format('table %s was tracked holding rows', target)
         WHERE h.complete;
        RAISE NOTICE 'sync.track: table % already holds rows: they reach consumers only by a '
                     'snapshot', target
            USING HINT = format('Run `serversync snapshot %s` to send them.', shell_name);
    END IF;
    IF NOT as_relay THEN
        RETURN;
    END IF;
    -- Hand the functions to serversync_relay. A new owner needs CREATE on the functions' schema
    -- unless a superuser hands them over: lent for these statements, taken back before the
    -- transaction ends, one sync.track at a time (two grants on one schema at once fail).
    lend_create := NOT (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = current_user)
                   AND NOT has_schema_privilege('serversync_relay', 'sync', 'CREATE')
                   AND EXISTS (SELECT 1 FROM pg_proc p
                                WHERE p.oid IN (to_regprocedure(relay || '()'),
                                                to_regprocedure(relay_delete || '()'),
                                                to_regprocedure(rekey || '()'))
                                  AND p.proowner <> 'serversync_relay'::regrole);
    IF lend_create THEN
        PERFORM pg_advisory_xact_lock(hashtext('sync.track'));
        GRANT CREATE ON SCHEMA sync TO serversync_relay;
    END IF;
    EXECUTE format('ALTER FUNCTION %s() OWNER TO serversync_relay', relay);
    EXECUTE format('ALTER FUNCTION %s() OWNER TO serversync_relay', relay_delete);
    EXECUTE format('ALTER FUNCTION %s() OWNER TO serversync_relay', rekey);
    IF lend_create THEN
        REVOKE CREATE ON SCHEMA sync FROM serversync_relay;
    END IF;
    -- What the rekey check reads: the key column, every row of it whatever row level security
    -- the table has or gets (a policy does nothing while the table has none), the table's
    -- schema and the equality operator's.
    EXECUTE format('REVOKE ALL ON TABLE %s FROM serversync_relay', qualified);
    EXECUTE format('GRANT SELECT (%I) ON TABLE %s TO serversync_relay', key_column, qualified);
    IF EXISTS (SELECT 1 FROM pg_policy
                WHERE polrelid = target AND polname = 'sync_relay_rekey') THEN
        EXECUTE format('DROP POLICY sync_relay_rekey ON %s', qualified);
    END IF;
    EXECUTE format(
        'CREATE POLICY sync_relay_rekey ON %s AS PERMISSIVE FOR SELECT TO serversync_relay '
        'USING (true)', qualified
    );
    FOREACH needed_schema IN ARRAY ARRAY[table_schema, equals_schema] LOOP
        IF NOT has_schema_privilege('serversync_relay', needed_schema, 'USAGE') THEN
            EXECUTE format('GRANT USAGE ON SCHEMA %I TO serversync_relay', needed_schema);
        END IF;
        IF NOT has_schema_privilege('serversync_relay', needed_schema, 'USAGE') THEN
            RAISE EXCEPTION 'sync.track: the relay of % needs USAGE on schema %, which % may '
                            'not grant', target, quote_ident(needed_schema), current_user
                USING ERRCODE = 'insufficient_privilege',
                      HINT = format('GRANT USAGE ON SCHEMA %I TO serversync_relay, then track '
                                    'the table again.', needed_schema);
        END IF;
    END LOOP;
END;
$$;

CREATE OR REPLACE FUNCTION sync.untrack(target regclass) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    qualified text;
BEGIN
    PERFORM sync.drop_relay_triggers(target);
    EXECUTE format('DROP FUNCTION IF EXISTS sync.%I()', 'relay_' || target::oid);
    EXECUTE format('DROP FUNCTION IF EXISTS sync.%I()', 'relay_delete_' || target::oid);
    EXECUTE format('DROP FUNCTION IF EXISTS sync.%I()', 'rekey_' || target::oid);
    SELECT format('%I.%I', n.nspname, c.relname) INTO qualified
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = target;
    IF EXISTS (SELECT 1 FROM pg_policy
                WHERE polrelid = target AND polname = 'sync_relay_rekey') THEN
        EXECUTE format('DROP POLICY sync_relay_rekey ON %s', qualified);
    END IF;
    IF to_regrole('serversync_relay') IS NOT NULL THEN
        EXECUTE format('REVOKE ALL ON TABLE %s FROM serversync_relay', qualified);
    END IF;
END;
$$;

REVOKE EXECUTE ON FUNCTION sync.track(regclass, text, text, boolean), sync.untrack(regclass)
    FROM PUBLIC;

-- Generate the relay of every tracked table again, as sync.track above makes it. A table that
-- sync.track now refuses loses its relay, with a WARNING naming it, why, and the sync.track
-- call to run once fixed, rather than failing the whole migration; until then its writes are
-- NOT relayed. Its old relay must not stay: it was made by rules sync.track no longer keeps.
DO $regenerate$
DECLARE
    tracked record;
    refusal text[];
BEGIN
    FOR tracked IN SELECT table_name, entity_type, key_column, both_ways
                     FROM sync.tracked_tables LOOP
        refusal := sync.relay_refusal(tracked.table_name, tracked.key_column);
        IF refusal IS NULL THEN
            PERFORM sync.track(tracked.table_name, tracked.entity_type, tracked.key_column,
                               tracked.both_ways);
        ELSE
            PERFORM sync.untrack(tracked.table_name);
            RAISE WARNING 'serversync: table % is no longer tracked (entity type %): its changes '
                          'are NOT relayed from now on, and its relay was removed. %',
                          tracked.table_name, quote_literal(tracked.entity_type), refusal[1]
                USING HINT = refusal[2] || format(' Then: SELECT sync.track(%L, %L, %L, %L);',
                                                  tracked.table_name::text,
                                                  tracked.entity_type, tracked.key_column,
                                                  tracked.both_ways);
        END IF;
    END LOOP;
END
$regenerate$;
