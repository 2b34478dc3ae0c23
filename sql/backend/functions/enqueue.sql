-- sync.enqueue: an event that is not a row of a tracked table (a command, a notice, a value
-- computed in the application), written to the outbox in the caller's transaction.
--
-- A function file: `serversync migrate` applies it after the versioned migrations and again
-- whenever its text changes; every statement may run again on a database that has it.
--
-- The event goes through the same outbox as the relay's, in the same transaction: it takes the
-- transaction's txid and the next seq, so it is delivered after every change the transaction
-- made before the call and before every change it makes after, and not at all if the
-- transaction rolls back. It wakes a waiting consumer as the relay does (schema.sql, The
-- wake-up). Its origin is the outbox column's default: NULL, or the node whose change a
-- receiver's apply transaction is applying.
--
-- idempotency_key: an event requested twice (a client's retry, a job run again) is written once.
-- The key is taken in sync.enqueue_keys in the caller's transaction; a second call with the
-- same key, in this transaction or after the first one committed, writes nothing and returns
-- NULL; a call concurrent with an uncommitted first one waits for it, then returns NULL if it
-- committed (or writes the event, if it rolled back). Keys are removed by `serversync cleanup`
-- with the outbox rows of the same age: the key of an event older than the retention may be
-- used again.
--
-- Who may call it: an event is delivered as trusted data (the consumer signs what the outbox
-- holds), so not PUBLIC but the role serversync_producer (0002_both_directions.sql), given to
-- the application roles that may write events. It runs as serversync_relay, the relay's owner
-- (SECURITY DEFINER with a pinned search_path, like the generated relays): the caller needs no
-- privilege on the outbox.
CREATE OR REPLACE FUNCTION sync.enqueue(
    entity_type     text,
    entity_id       text,
    payload         json,
    op              text DEFAULT 'upsert',
    idempotency_key text DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
    written bigint;
BEGIN
    -- What the outbox's readers rely on, refused here as sync.track and the relay refuse it.
    IF entity_type IS NULL OR entity_type !~ '^[A-Za-z_][A-Za-z0-9_.-]{0,127}$' THEN
        RAISE EXCEPTION 'sync.enqueue: entity type % is not an identifier',
                        quote_nullable(entity_type)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF entity_id IS NULL OR entity_id = '' THEN
        RAISE EXCEPTION 'sync.enqueue: an event of % has an empty or NULL entity id', entity_type
            USING ERRCODE = 'check_violation';
    END IF;
    IF op IS NULL OR op NOT IN ('upsert', 'delete') THEN
        RAISE EXCEPTION 'sync.enqueue: op is ''upsert'' or ''delete'', not %', quote_nullable(op)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF payload IS NULL THEN
        RAISE EXCEPTION 'sync.enqueue: an event of % has no payload (json ''null'' is one)',
                        entity_type
            USING ERRCODE = 'not_null_violation';
    END IF;
    IF idempotency_key IS NOT NULL THEN
        -- A concurrent insert of the same key waits here for the other transaction's end.
        INSERT INTO sync.enqueue_keys (idempotency_key) VALUES (idempotency_key)
        ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
    END IF;
    -- The seq is taken first: RETURNING would need SELECT on the outbox, which the relay's
    -- role does not have. The transaction's id before it: every outbox row's seq is taken
    -- after its transaction has an id, as the relay's are (a snapshot that begins at a seq
    -- waits for every transaction with an id that could still write below it; docs/design.md,
    -- Snapshots).
    PERFORM pg_current_xact_id();
    written := nextval('sync.events_outbox_seq_seq');
    INSERT INTO sync.events_outbox (seq, op, entity_type, entity_id, payload)
    VALUES (written, op, entity_type, entity_id, payload);
    IF pg_sequence_last_value('sync.waiting_consumers') > 0
       OR current_setting('sync.notify', true) = 'always' THEN
        IF coalesce(current_setting('sync.notify', true), '') <> 'off' THEN
            PERFORM pg_notify('sync_outbox', '');  -- a wake-up only: no event data
        END IF;
    END IF;
    RETURN written;
END;
$$;

REVOKE ALL ON FUNCTION sync.enqueue(text, text, json, text, text) FROM PUBLIC;

-- Hand it to serversync_relay (what it writes is granted to that role) and let producers call
-- it. As in sync.track: a new owner needs CREATE on the schema unless a superuser hands the
-- function over, lent for this statement only; without the role, or membership in it, the
-- function stays the migrating role's, which owns the outbox.
DO $owner$
DECLARE
    lend_create boolean;
BEGIN
    IF to_regrole('serversync_relay') IS NOT NULL
       AND pg_has_role(current_user, 'serversync_relay', 'USAGE') THEN
        lend_create := NOT (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = current_user)
                       AND NOT has_schema_privilege('serversync_relay', 'sync', 'CREATE')
                       AND (SELECT p.proowner <> 'serversync_relay'::regrole FROM pg_proc p
                             WHERE p.oid = 'sync.enqueue(text, text, json, text, text)'
                                           ::regprocedure);
        IF lend_create THEN
            PERFORM pg_advisory_xact_lock(hashtext('sync.track'));
            GRANT CREATE ON SCHEMA sync TO serversync_relay;
        END IF;
        ALTER FUNCTION sync.enqueue(text, text, json, text, text) OWNER TO serversync_relay;
        IF lend_create THEN
            REVOKE CREATE ON SCHEMA sync FROM serversync_relay;
        END IF;
    ELSE
        RAISE NOTICE 'serversync: sync.enqueue runs as %: role serversync_relay is missing or % '
                     'may not act as it (docs/security.md, Roles and grants)',
                     current_user, current_user;
    END IF;
    IF to_regrole('serversync_producer') IS NOT NULL THEN
        GRANT EXECUTE ON FUNCTION sync.enqueue(text, text, json, text, text)
            TO serversync_producer;
    END IF;
END
$owner$;
