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

CREATE OR REPLACE FUNCTION sync.relay() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    entity_type text := TG_ARGV[0];
    key_column  text := TG_ARGV[1];
    new_row     jsonb;
    old_row     jsonb;
    notify_mode text;
BEGIN
    IF TG_OP = 'DELETE' THEN
        old_row := to_jsonb(OLD);
        INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
        VALUES ('delete', entity_type, old_row ->> key_column, old_row);
    ELSE
        new_row := to_jsonb(NEW);
        IF TG_OP = 'UPDATE' THEN
            old_row := to_jsonb(OLD);
            -- A changed key is a delete of the old entity and an upsert of the new one.
            IF (old_row -> key_column) IS DISTINCT FROM (new_row -> key_column) THEN
                INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
                VALUES ('delete', entity_type, old_row ->> key_column, old_row);
            END IF;
        END IF;
        INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
        VALUES ('upsert', entity_type, new_row ->> key_column, new_row);
    END IF;
    -- Once per transaction (a transaction-local marker; a rolled-back savepoint undoes it along
    -- with any NOTIFY it sent, so the next row checks again).
    IF current_setting('sync.wakeup_checked', true) IS DISTINCT FROM 'on' THEN
        PERFORM set_config('sync.wakeup_checked', 'on', true);
        notify_mode := coalesce(nullif(current_setting('sync.notify', true), ''), 'auto');
        IF notify_mode = 'always'
           OR (notify_mode = 'auto' AND EXISTS (SELECT 1 FROM sync.consumer_waits WHERE waiting))
        THEN
            -- A wake-up only: no event data.
            PERFORM pg_notify('sync_outbox', '');
        END IF;
    END IF;
    RETURN NULL;
END;
$$;
