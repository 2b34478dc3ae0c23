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
    key_type text;
    key_expression text;
    empty_key_refusal text;
    -- The keys of this chunk: (last_key, upper], read without locks in key order.
    bound_text text;
    row_count bigint;
    upper_key text;
    written bigint;
    table_finished boolean;
    local_node text := sync.node_name();
BEGIN
    -- Below deadlock_timeout (1 s): a chunk that meets a producer's edit in progress is the
    -- one to give up, never the producer; the caller tries the chunk again.
    PERFORM set_config('lock_timeout', snapshot_chunk.lock_timeout, true);
    SELECT s.* INTO shot FROM sync.snapshots s WHERE s.id = snapshot_chunk.snapshot;
    IF shot IS NULL OR shot.state <> 'running' THEN
        RAISE EXCEPTION 'sync.snapshot_chunk: snapshot % is not running', snapshot
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
    SELECT format_type(a.atttypid, a.atttypmod) INTO key_type
      FROM pg_attribute a
     WHERE a.attrelid = part.relation AND a.attname = part.key_column AND a.attnum > 0
       AND NOT a.attisdropped;
    IF key_type IS NULL THEN
        RAISE EXCEPTION 'sync.snapshot_chunk: table % has no column %', part.relation,
            part.key_column USING ERRCODE = 'undefined_column';
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
    -- The chunk's upper key: the chunk_size-th key after the last one sent, in key order (the
    -- greatest by the key's own ordering: max() exists for few types, a uuid's not among them).
    bound_text := CASE WHEN part.last_key IS NULL
        THEN format('SELECT (array_agg(c.k::text ORDER BY c.k DESC))[1], count(*)'
                    ' FROM (SELECT r.%1$I AS k FROM %2$s AS r ORDER BY r.%1$I LIMIT $1) AS c',
                    part.key_column, part.relation)
        ELSE format('SELECT (array_agg(c.k::text ORDER BY c.k DESC))[1], count(*)'
                    ' FROM (SELECT r.%1$I AS k FROM %2$s AS r'
                    ' WHERE r.%1$I > CAST($2 AS %3$s) ORDER BY r.%1$I LIMIT $1) AS c',
                    part.key_column, part.relation, key_type)
    END;
    EXECUTE bound_text INTO upper_key, row_count USING chunk_size, part.last_key;
    written := 0;
    IF row_count > 0 THEN
        -- The rows of (last_key, upper], locked, written in key order. A table tracked both ways
        -- sends each row with its stored version (1970-01-01 on this node for a row never
        -- versioned), so that it never wins over a newer edit made on another node.
        EXECUTE format(
            $chunk$
            WITH chosen AS (
                SELECT r.%1$I AS k, (%4$s) COLLATE pg_catalog."C" AS entity_id,
                       to_json(r.*) AS payload
                  FROM %2$s AS r
                 WHERE (CAST($1 AS text) IS NULL OR r.%1$I > CAST($1 AS %3$s))
                   AND r.%1$I <= CAST($2 AS %3$s)
                   FOR SHARE OF r
            ), sent AS (
                INSERT INTO sync.events_outbox
                       (op, entity_type, entity_id, payload, created_at, origin, snapshot_id,
                        target_consumer)
                SELECT 'upsert', $3, c.entity_id, c.payload,
                       CASE WHEN $6 THEN coalesce(v.version_ts, 'epoch') ELSE clock_timestamp() END,
                       CASE WHEN $6 THEN nullif(coalesce(v.version_node, $7), $7) END,
                       $4, $5
                  FROM chosen c
                       LEFT JOIN sync.row_versions v
                              ON $6 AND v.entity_type = $3 AND v.entity_id = c.entity_id
                 ORDER BY c.k
                RETURNING 1
            )
            SELECT count(*) FROM sent
            $chunk$,
            part.key_column, part.relation, key_type, key_expression)
        INTO written
        USING part.last_key, upper_key, part.entity_type, snapshot, shot.consumer,
              part.both_ways, local_node;
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
