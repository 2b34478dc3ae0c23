-- Writing a snapshot: the current rows of a tracked table into the outbox as upserts, a chunk at
-- a time, and the end of a snapshot (consumer/store/snapshots.py drives them; `serversync
-- snapshot` and a new consumer's leader call it).
--
-- A function file: `serversync migrate` applies it after the versioned migrations and again
-- whenever its text changes, so every statement is CREATE OR REPLACE with the signatures it has.
--
-- Why a snapshot row never overwrites newer data (docs/design.md, Snapshots): receivers keep the
-- version of what they applied (the outbox seq, or for a table tracked both ways the row's
-- version), and a chunk reads its rows FOR SHARE in the transaction that writes their outbox
-- rows. A change committed before the chunk locked a row wrote its outbox row (and took its seq)
-- before, with the content the chunk reads; a change after waits for the chunk's commit, so its
-- outbox row comes after. A row gone or moved to another key by the time it is locked is left
-- out: the change that removed or moved it is in the stream.
--
-- The rule of the relay holds here too (functions/relay.sql): format strings are constants, a
-- user's name goes in through %I (or as a regclass), a value through a parameter.
--
-- SECURITY INVOKER: whoever writes a snapshot reads the tables (SELECT, and UPDATE for FOR
-- SHARE) and writes the outbox; docs/security.md has the grants.

-- One chunk of one table of a snapshot: up to `chunk_size` rows after the table's last sent key,
-- in key order, written to the outbox; the table's progress moves in the same transaction.
-- Returns how many rows were written and whether the table is done. Call it in a transaction
-- of its own: the rows stay locked (FOR SHARE) until it ends, and lock_timeout holds to its end.
CREATE OR REPLACE FUNCTION sync.snapshot_chunk(snapshot bigint, table_position integer,
                                               chunk_size integer,
                                               lock_timeout text DEFAULT '200ms')
RETURNS TABLE (rows_written bigint, table_done boolean)
LANGUAGE plpgsql AS $$
DECLARE
    part record;
    shot record;
    key_type oid;
    key_type_name text;
    -- The key type's own ordering (its default B-tree operator class), as OPERATOR(schema.op):
    -- the ORDER BY and the comparisons of the cursor must agree, whatever the search_path.
    less text;
    less_or_equal text;
    greater text;
    relation_ref text;
    key_expression text;
    empty_key_refusal text;
    null_key boolean;
    after_last text := '';
    row_count bigint;
    upper_key text;
    locked_tables oid[];
    locked_rows tid[];
    written bigint;
    table_finished boolean;
    local_node text := sync.node_name();
BEGIN
    -- Below deadlock_timeout (1 s): a chunk that meets a producer's edit in progress is the
    -- one to give up, never the producer; the caller tries the chunk again.
    PERFORM set_config('lock_timeout', snapshot_chunk.lock_timeout, true);
    -- The cursor is a key as text, read back by whichever process resumes: written and read
    -- in one fixed style, whatever the session's.
    PERFORM set_config('DateStyle', 'ISO, YMD', true);
    PERFORM set_config('IntervalStyle', 'postgres', true);
    PERFORM set_config('extra_float_digits', '3', true);
    SELECT s.* INTO shot FROM sync.snapshots s WHERE s.id = snapshot_chunk.snapshot;
    IF shot IS NULL OR shot.state <> 'running' THEN
        RAISE EXCEPTION 'sync.snapshot_chunk: snapshot % is not running', snapshot
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF shot.begin_seq IS NULL THEN
        RAISE EXCEPTION 'sync.snapshot_chunk: snapshot % has not begun (no begin seq)', snapshot
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    SELECT t.* INTO part FROM sync.snapshot_tables t
     WHERE t.snapshot_id = snapshot_chunk.snapshot AND t.position = table_position
       FOR UPDATE;
    IF part IS NULL THEN
        RAISE EXCEPTION 'sync.snapshot_chunk: snapshot % has no table at position %',
            snapshot, table_position USING ERRCODE = 'no_data_found';
    END IF;
    IF part.done THEN
        RETURN QUERY SELECT 0::bigint, true;
        RETURN;
    END IF;
    -- A table dropped since (ONLY: an inherited table's children are tables of their own,
    -- which its relay does not send; a partitioned table's partitions are its rows).
    SELECT CASE WHEN c.relkind = 'p' THEN c.oid::regclass::text ELSE 'ONLY ' || c.oid::regclass END
      INTO relation_ref
      FROM pg_class c WHERE c.oid = part.relation;
    IF relation_ref IS NULL THEN
        RAISE EXCEPTION 'snapshot %: table % (entity type %) no longer exists; cancel the '
                        'snapshot (serversync snapshot --cancel %)', snapshot,
                        part.relation::oid, part.entity_type, snapshot
            USING ERRCODE = 'undefined_table';
    END IF;
    SELECT a.atttypid, format_type(a.atttypid, a.atttypmod) INTO key_type, key_type_name
      FROM pg_attribute a
     WHERE a.attrelid = part.relation AND a.attname = part.key_column AND a.attnum > 0
       AND NOT a.attisdropped;
    IF key_type IS NULL THEN
        RAISE EXCEPTION 'snapshot %: table % has no column % any more; track it again and '
                        'cancel the snapshot (serversync snapshot --cancel %)', snapshot,
                        part.relation, part.key_column, snapshot
            USING ERRCODE = 'undefined_column';
    END IF;
    SELECT format('OPERATOR(%I.%s)', n1.nspname, o1.oprname),
           format('OPERATOR(%I.%s)', n2.nspname, o2.oprname),
           format('OPERATOR(%I.%s)', n5.nspname, o5.oprname)
      INTO less, less_or_equal, greater
      FROM (SELECT CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END AS oid
              FROM pg_type t WHERE t.oid = key_type) AS k
           JOIN pg_opclass oc
             ON oc.opcdefault
            AND (oc.opcintype = k.oid
                 OR oc.opcintype IN (SELECT c.casttarget FROM pg_cast c
                                      WHERE c.castsource = k.oid AND c.castmethod = 'b'))
           JOIN pg_am am ON am.oid = oc.opcmethod AND am.amname = 'btree'
           JOIN pg_amop a1 ON a1.amopfamily = oc.opcfamily AND a1.amopstrategy = 1
                          AND a1.amoplefttype = oc.opcintype AND a1.amoprighttype = oc.opcintype
           JOIN pg_operator o1 ON o1.oid = a1.amopopr
           JOIN pg_namespace n1 ON n1.oid = o1.oprnamespace
           JOIN pg_amop a2 ON a2.amopfamily = oc.opcfamily AND a2.amopstrategy = 2
                          AND a2.amoplefttype = oc.opcintype AND a2.amoprighttype = oc.opcintype
           JOIN pg_operator o2 ON o2.oid = a2.amopopr
           JOIN pg_namespace n2 ON n2.oid = o2.oprnamespace
           JOIN pg_amop a5 ON a5.amopfamily = oc.opcfamily AND a5.amopstrategy = 5
                          AND a5.amoplefttype = oc.opcintype AND a5.amoprighttype = oc.opcintype
           JOIN pg_operator o5 ON o5.oid = a5.amopopr
           JOIN pg_namespace n5 ON n5.oid = o5.oprnamespace
     ORDER BY oc.opcintype = k.oid DESC
     LIMIT 1;
    IF less IS NULL THEN
        RAISE EXCEPTION 'snapshot %: the key % of table % has type %, which has no ordering '
                        '(a default B-tree operator class) to send it in chunks by', snapshot,
                        part.key_column, part.relation, key_type_name
            USING ERRCODE = 'feature_not_supported';
    END IF;
    key_expression := sync.relay_key_expression(part.relation, part.key_column, 'r');
    -- The relay's expression refuses an empty key naming the table by TG_RELID, which exists
    -- in a trigger only: here the table is named by its oid. Only the refusal the expression
    -- ends with is replaced (a quoted column name may hold any text).
    empty_key_refusal := format('sync.refuse_empty_key(TG_RELID::regclass, %L::text))',
                                part.key_column);
    IF right(key_expression, length(empty_key_refusal)) = empty_key_refusal THEN
        key_expression := left(key_expression, length(key_expression) - length(empty_key_refusal))
            || format('sync.refuse_empty_key(%s::oid::regclass, %L::text))', part.relation::oid,
                      part.key_column);
    END IF;
    IF part.last_key IS NULL THEN
        -- A NULL key sorts after every other and matches no range: refused as the relay would
        -- refuse it, before anything of the table is sent.
        EXECUTE format('SELECT EXISTS (SELECT FROM %s AS r WHERE r.%I IS NULL)', relation_ref,
                       part.key_column)
           INTO null_key;
        IF null_key THEN
            PERFORM sync.refuse_empty_key(part.relation, part.key_column);
        END IF;
    ELSE
        after_last := format('r.%I %s CAST($2 AS %s) AND ', part.key_column, greater,
                             key_type_name);
    END IF;
    -- The chunk's upper key: the chunk_size-th key after the last one sent, in key order (read
    -- without locks; the last one by the key's ordering: max() exists for few types).
    EXECUTE format('SELECT (array_agg(c.k::text ORDER BY c.k USING %5$s))[1], count(*)'
                   ' FROM (SELECT r.%1$I AS k FROM %2$s AS r WHERE %3$s r.%1$I IS NOT NULL'
                   ' ORDER BY r.%1$I USING %4$s LIMIT $1) AS c',
                   part.key_column, relation_ref, after_last, less, greater)
       INTO upper_key, row_count
       USING chunk_size, part.last_key;
    written := 0;
    IF row_count > 0 THEN
        -- The rows of (last_key, upper], locked FOR SHARE: a writer in progress is waited for,
        -- and no one changes them until this transaction ends. A row gone or moved out of the
        -- range by then is not locked: the change that removed or moved it is in the stream.
        EXECUTE format('SELECT array_agg(l.tableoid), array_agg(l.ctid) FROM ('
                       'SELECT r.tableoid, r.ctid FROM %2$s AS r'
                       ' WHERE %3$s r.%1$I %4$s CAST($3 AS %5$s) FOR SHARE OF r) AS l',
                       part.key_column, relation_ref, after_last, less_or_equal, key_type_name)
           INTO locked_tables, locked_rows
           USING chunk_size, part.last_key, upper_key;
    END IF;
    IF locked_rows IS NOT NULL THEN
        -- The locked rows as this next statement sees them (each statement of a READ COMMITTED
        -- transaction takes a new snapshot): their latest committed versions, and for a table
        -- tracked both ways their stored versions, which only a writer of the row changes.
        -- Written in key order, each with that version (1970-01-01 on this node for a row
        -- never versioned), so that a snapshot never wins over a newer edit on another node.
        EXECUTE format(
            $chunk$
            WITH chosen AS (
                SELECT r.%1$I AS k, (%4$s) COLLATE pg_catalog."C" AS entity_id,
                       to_json(r.*) AS payload
                  FROM %2$s AS r
                 WHERE %3$s r.%1$I %5$s CAST($9 AS %6$s)
                   AND (r.tableoid, r.ctid) IN (SELECT l.t, l.c FROM unnest($7, $8) AS l(t, c))
            ), sent AS (
                INSERT INTO sync.events_outbox
                       (op, entity_type, entity_id, payload, created_at, origin, snapshot_id,
                        target_consumer)
                SELECT 'upsert', $3, c.entity_id, c.payload,
                       CASE WHEN $10 THEN coalesce(v.version_ts, 'epoch') ELSE clock_timestamp() END,
                       CASE WHEN $10 THEN nullif(coalesce(v.version_node, $11), $11) END,
                       $4, $5
                  FROM chosen c
                       LEFT JOIN sync.row_versions v
                              ON $10 AND v.entity_type = $3 AND v.entity_id = c.entity_id
                 ORDER BY c.k USING %7$s
                RETURNING 1
            )
            SELECT count(*) FROM sent
            $chunk$,
            part.key_column, relation_ref, after_last, key_expression, less_or_equal,
            key_type_name, less)
        INTO written
        USING chunk_size, part.last_key, part.entity_type, snapshot, shot.consumer,
              NULL::text, locked_tables, locked_rows, upper_key, part.both_ways, local_node;
    END IF;
    table_finished := row_count < chunk_size;
    UPDATE sync.snapshot_tables t
       SET last_key = coalesce(upper_key, t.last_key),
           rows_sent = t.rows_sent + written,
           done = table_finished
     WHERE t.snapshot_id = snapshot_chunk.snapshot AND t.position = table_position;
    UPDATE sync.snapshots s SET updated_at = now() WHERE s.id = snapshot_chunk.snapshot;
    IF written > 0 THEN
        PERFORM pg_notify('sync_outbox', '');  -- a wake-up only, as the relay's
    END IF;
    RETURN QUERY SELECT written, table_finished;
END;
$$;

-- The end of a snapshot whose tables are all sent: with delete_missing, a sweep marker per
-- entity type (docs/wire-contract.md, Snapshots), then the snapshot is done. In one transaction,
-- so a crash in between leaves it running, and resuming it ends it once.
CREATE OR REPLACE FUNCTION sync.snapshot_finish(snapshot bigint) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    shot record;
BEGIN
    SELECT s.* INTO shot FROM sync.snapshots s WHERE s.id = snapshot_finish.snapshot FOR UPDATE;
    IF shot IS NULL OR shot.state <> 'running' THEN
        RAISE EXCEPTION 'sync.snapshot_finish: snapshot % is not running', snapshot
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF shot.begin_seq IS NULL THEN
        RAISE EXCEPTION 'sync.snapshot_finish: snapshot % has not begun (no begin seq)', snapshot
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF EXISTS (SELECT FROM sync.snapshot_tables t
                WHERE t.snapshot_id = snapshot_finish.snapshot AND NOT t.done) THEN
        RAISE EXCEPTION 'sync.snapshot_finish: snapshot % has tables not sent yet', snapshot
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF shot.delete_missing THEN
        INSERT INTO sync.events_outbox
               (op, entity_type, entity_id, payload, snapshot_id, target_consumer)
        SELECT 'sweep', t.entity_type, shot.id::text,
               jsonb_build_object('snapshot', shot.id, 'keepFromSeq', shot.begin_seq)::json,
               shot.id, shot.consumer
          FROM (SELECT DISTINCT t.entity_type FROM sync.snapshot_tables t
                 WHERE t.snapshot_id = snapshot_finish.snapshot) AS t
         ORDER BY t.entity_type;
        PERFORM pg_notify('sync_outbox', '');
    END IF;
    UPDATE sync.snapshots s
       SET state = 'done', updated_at = now(), finished_at = now()
     WHERE s.id = snapshot_finish.snapshot;
END;
$$;
