-- Named, parameterised queries of serversync (loaded by consumer/store/queries.py).
-- A block starts with "-- name: NAME" and runs to the next such line.

-- name: read_batch
-- The gap-safe read. One statement, so the horizon and the rows come from the same snapshot: only
-- transactions older than the horizon are read (sync.read_horizon: the oldest transaction running
-- when the snapshot was taken, other databases' left out); every one of them has ended or is
-- another database's, so nothing can later appear behind the position. `held_back` says that
-- committed rows wait behind the horizon for an older transaction that is still running: nothing
-- will notify when that one ends if it writes no outbox row, so the caller re-checks soon instead
-- of waiting for the poll timer. A row at or beyond the horizon that this snapshot sees is
-- committed (a running transaction's rows are not visible to it); only a running transaction
-- (horizon < xmax) can hold one back. The probe is the largest txid this snapshot sees, read
-- backwards from the end of the primary key past the running transactions' rows: a few index
-- entries at any outbox size (an EXISTS over `txid >= xmin` was planned as a sequential scan that
-- stops at the first match, and there is none when nothing waits), compared with the horizon or the
-- position, whichever is later: the horizon can step back behind the position (another database's
-- transaction that ends between the snapshot and the read of the activity is no longer known to be
-- another database's), and rows behind the position were delivered. `horizon` is 2 then, 1 while
-- transactions run but nothing committed waits (one of them may have written an outbox row before
-- the consumer announced its wait, and will commit without a NOTIFY: the caller re-checks at its
-- re-check interval), and 0 when none of this database runs.
--
-- A snapshot does not list every running transaction: one whose xid is at or beyond its xmax
-- (no later xid has ended yet) is running for it without being in pg_snapshot_xip. A producer
-- can take such an xid after the consumer's announcement took its own, yet check the count of
-- waiting consumers before the announcement changed it, and so commit without a NOTIFY. So a
-- read made while the consumer's wait is announced (`announced`), when the snapshot shows none
-- of this database running, asks pg_stat_activity whether a backend of this database holds an
-- xid: then it says 1 and the consumer re-checks instead of sleeping until the poll timer. The
-- activity is read after the snapshot, and such a producer took its xid before the announcement
-- ended, so it is seen while it runs.
--
-- One row per event, in delivery order, each carrying the horizon's state; with no event, one row
-- of NULLs that still carries it. The LATERAL subquery refers to the horizon, so PostgreSQL can only
-- run it as a nested loop under the horizon's single row, and the rows come out in the index
-- order of the subquery: an ORDER BY out here would sort the batch a second time for nothing.
-- The entries are not built here as JSON: string_agg over the concatenated entry text cost
-- more in the server than fetching plain rows and letting orjson write them
-- (consumer/wire/entries.py; docs/performance.md has the timings). The entry's columns end the
-- row (consumer/wire/entries.py, ENTRY_COLUMNS); target_consumer, before them, names the one
-- consumer a snapshot's row is for (NULL: every consumer).
WITH snapshot AS MATERIALIZED (
    SELECT sync.read_horizon(s) AS xmin, pg_snapshot_xmax(s) AS xmax
    FROM pg_current_snapshot() AS s
), horizon AS MATERIALIZED (
    SELECT t.xmin,
           CASE WHEN t.xmin = t.xmax THEN
                     CASE WHEN %(announced)s AND EXISTS (
                              SELECT FROM pg_stat_activity a
                              WHERE a.backend_xid IS NOT NULL
                                AND a.datid = (SELECT d.oid FROM pg_database d
                                               WHERE d.datname = current_database()))
                          THEN 1 ELSE 0 END
                WHEN (SELECT max(w.txid) FROM sync.events_outbox w)
                     >= greatest(t.xmin, %(txid)s::xid8) THEN 2
                ELSE 1
           END AS horizon
    FROM snapshot t
)
SELECT h.horizon, b.txid::text, b.target_consumer, b.seq, b.op, b.entity_type, b.entity_id,
       b.payload::text, b.created_at, b.origin, b.snapshot_id
FROM horizon h
LEFT JOIN LATERAL (
    SELECT o.txid, o.target_consumer, o.seq, o.op, o.entity_type, o.entity_id,
           -- Not fetched for a row of a snapshot for another consumer: it is passed over.
           CASE WHEN o.target_consumer IS NULL OR o.target_consumer = %(consumer)s
                THEN o.payload END AS payload,
           o.created_at, o.origin, o.snapshot_id
    FROM sync.events_outbox o
    WHERE (o.txid, o.seq) > (%(txid)s::xid8, %(seq)s::bigint)
      AND o.txid < h.xmin
    ORDER BY o.txid, o.seq
    LIMIT %(limit)s
) b ON true;

-- name: ensure_consumer
-- Register a consumer at a position unless it is registered: a row back when it registered now,
-- none when it was there already (a second process of a new consumer waits here for the first
-- one's transaction, then finds it registered).
INSERT INTO sync.consumer_offsets (consumer, last_txid, last_seq)
VALUES (%(consumer)s, %(txid)s::xid8, %(seq)s)
ON CONFLICT (consumer) DO NOTHING
RETURNING consumer;

-- name: try_leader_lock
SELECT pg_try_advisory_lock(hashtext('serversync.consumer'), hashtext(%(consumer)s)) AS locked;

-- name: unlock_leader
SELECT pg_advisory_unlock(hashtext('serversync.consumer'), hashtext(%(consumer)s)) AS unlocked;

-- name: commit_durably
-- Inside a transaction on a connection with synchronous_commit off: this commit waits for the
-- WAL flush all the same.
SET LOCAL synchronous_commit = on;

-- name: take_leadership
-- A new leader takes a new epoch; offset writes of any older epoch are refused from now on.
UPDATE sync.consumer_offsets
SET leader_epoch = leader_epoch + 1,
    leader_host = %(host)s,
    leader_pid = %(pid)s,
    leader_since = now()
WHERE consumer = %(consumer)s
RETURNING leader_epoch, last_txid::text AS last_txid, last_seq;

-- name: read_position
SELECT last_txid::text AS last_txid, last_seq
FROM sync.consumer_offsets
WHERE consumer = %(consumer)s AND leader_epoch = %(epoch)s;

-- name: commit_offset
-- Fenced: only the leader of the current epoch moves the offset.
UPDATE sync.consumer_offsets
SET last_txid = %(txid)s::xid8,
    last_seq = %(seq)s,
    updated_at = now(),
    delivered_total = delivered_total + %(delivered)s,
    last_error = NULL,
    last_error_at = NULL,
    failing_since = NULL,
    failing_reason = NULL
WHERE consumer = %(consumer)s AND leader_epoch = %(epoch)s;

-- name: record_error
UPDATE sync.consumer_offsets
SET last_error = %(error)s, last_error_at = now()
WHERE consumer = %(consumer)s AND leader_epoch = %(epoch)s;

-- name: record_failure
-- A delivery failed and is tried again with the offset held: the streak starts at its first
-- failure and ends with the next offset commit (commit_offset).
UPDATE sync.consumer_offsets
SET last_error = %(error)s,
    last_error_at = now(),
    failing_since = coalesce(failing_since, now()),
    failing_reason = %(reason)s
WHERE consumer = %(consumer)s AND leader_epoch = %(epoch)s;

-- name: clear_failure
-- The failing streak ended without an offset commit (a read the database refused went through).
UPDATE sync.consumer_offsets
SET failing_since = NULL, failing_reason = NULL
WHERE consumer = %(consumer)s AND leader_epoch = %(epoch)s;

-- name: release_leadership
UPDATE sync.consumer_offsets
SET leader_host = NULL, leader_pid = NULL, leader_since = NULL
WHERE consumer = %(consumer)s AND leader_epoch = %(epoch)s;

-- name: consumer_status
-- Per consumer: its position, what is still to deliver, and whether a leader holds its lock.
--
-- The backlog is counted exactly up to exact_up_to events and estimated beyond, from seq
-- numbers as PgQ does (`backlog_estimated`): the gauges run this every few seconds, and an exact
-- count scans the whole backlog, which made a consumer draining a large backlog count it again
-- and again (a million-event backlog cost the drain a second heap fetch per event). The
-- estimate runs from the smallest seq among the first events in delivery order to the newest
-- row's seq, so rows removed by retention do not count, while seqs that rolled-back
-- transactions took do. The lag is the age of the oldest of those first events.
WITH newest AS MATERIALIZED (
    SELECT o.seq FROM sync.events_outbox o ORDER BY o.txid DESC, o.seq DESC LIMIT 1
)
SELECT c.consumer,
       c.last_txid::text AS last_txid,
       c.last_seq,
       c.updated_at,
       c.delivered_total,
       c.leader_epoch,
       c.leader_host,
       c.leader_pid,
       c.leader_since,
       c.last_error,
       c.last_error_at,
       c.failing_since,
       c.failing_reason,
       extract(epoch FROM now() - c.failing_since)::float8 AS failing_seconds,
       lock.pid AS lock_backend_pid,
       CASE WHEN pending.counted <= %(exact_up_to)s::bigint THEN pending.counted
            ELSE greatest(pending.counted, (SELECT seq FROM newest) - pending.first_seq + 1)
       END AS backlog,
       pending.counted > %(exact_up_to)s::bigint AS backlog_estimated,
       pending.oldest_created_at,
       extract(epoch FROM now() - pending.oldest_created_at)::float8 AS lag_seconds,
       dlq.dlq_pending,
       dlq.dlq_retrying,
       dlq.dlq_resolved,
       dlq.dlq_dead
FROM sync.consumer_offsets c
LEFT JOIN LATERAL (
    SELECT l.pid
    FROM pg_locks l
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.classid = hashtext('serversync.consumer')::oid
      AND l.objid = hashtext(c.consumer)::oid
    LIMIT 1
) lock ON true
CROSS JOIN LATERAL (
    SELECT count(*) AS counted, min(first.seq) AS first_seq,
           min(first.created_at) AS oldest_created_at
    FROM (
        SELECT o.seq, o.created_at
        FROM sync.events_outbox o
        WHERE (o.txid, o.seq) > (c.last_txid, c.last_seq)
        ORDER BY o.txid, o.seq
        LIMIT %(exact_up_to)s::bigint + 1
    ) first
) pending
CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE d.status = 'PENDING') AS dlq_pending,
           count(*) FILTER (WHERE d.status = 'RETRYING') AS dlq_retrying,
           count(*) FILTER (WHERE d.status = 'RESOLVED') AS dlq_resolved,
           count(*) FILTER (WHERE d.status = 'DEAD') AS dlq_dead
    FROM sync.dlq_messages d
    WHERE d.consumer = c.consumer
) dlq
WHERE %(consumer)s::text IS NULL OR c.consumer = %(consumer)s
ORDER BY c.consumer;

-- name: outbox_stats
-- For the outbox gauges: PostgreSQL's row estimate (exact counting would scan the table on
-- every scrape) and the age of the oldest row (the first in delivery order, through the primary
-- key).
SELECT coalesce((SELECT n_live_tup FROM pg_stat_user_tables
                  WHERE relid = 'sync.events_outbox'::regclass), 0) AS outbox_rows,
       extract(epoch FROM now() - (SELECT o.created_at FROM sync.events_outbox o
                                    ORDER BY o.txid, o.seq LIMIT 1))::float8 AS oldest_age_seconds;

-- name: horizon_state
-- Committed events that no consumer can read yet because an older transaction is still open.
--
-- They are the rows from the read horizon on, walked along the primary key: the horizon is known
-- only when the query runs, and a plain count(*) WHERE txid >= horizon was planned as a scan of
-- the whole outbox (two seconds at 10 million rows, on every `serversync status`). The walk
-- counts up to 10,000 events (admin.EXACT_BACKLOG_UP_TO, written out so that the query takes no
-- parameter) and estimates beyond from seq numbers, as consumer_status does for the backlog
-- (`held_back_estimated`): a transaction left open while producers write holds back ever more.
-- The age is that of the oldest of those first events.
WITH horizon AS MATERIALIZED (
    SELECT sync.read_horizon(pg_current_snapshot()) AS xmin
), newest AS MATERIALIZED (
    SELECT o.seq FROM sync.events_outbox o ORDER BY o.txid DESC, o.seq DESC LIMIT 1
), first AS (
    SELECT o.seq, o.created_at
    FROM sync.events_outbox o
    WHERE o.txid >= (SELECT xmin FROM horizon)
    ORDER BY o.txid, o.seq
    LIMIT 10001
)
SELECT CASE WHEN count(*) <= 10000 THEN count(*)
            ELSE greatest(count(*), (SELECT seq FROM newest) - min(f.seq) + 1)
       END AS held_back_events,
       count(*) > 10000 AS held_back_estimated,
       extract(epoch FROM now() - min(f.created_at))::float8 AS oldest_held_back_seconds
FROM first f;

-- name: horizon_blockers
-- The oldest open transactions that hold an xid and the read horizon of every consumer waits for
-- (sync.read_horizon): this database's, those of no database, and every prepared transaction
-- (whichever database prepared it).
SELECT a.pid, a.datname, a.usename, a.application_name, a.state,
       extract(epoch FROM now() - a.xact_start)::float8 AS xact_age_seconds,
       left(a.query, 200) AS query
FROM pg_stat_activity a
WHERE a.backend_xid IS NOT NULL
  AND (a.datid IS NULL OR a.datname = current_database())
UNION ALL
SELECT NULL, p.database, p.owner, 'prepared: ' || p.gid, 'prepared',
       extract(epoch FROM now() - p.prepared)::float8, NULL
FROM pg_prepared_xacts p
ORDER BY xact_age_seconds DESC NULLS LAST
LIMIT %(limit)s;

-- name: position_latest
-- The end of what is final now: rows of still-open transactions are delivered after a reset.
-- The position queries ORDER BY o.txid: a bare `txid` there names the text output column, and
-- as text '10000' sorts before '9999'.
SELECT txid::text, seq
FROM sync.events_outbox o
WHERE txid < pg_snapshot_xmin(pg_current_snapshot())
ORDER BY o.txid DESC, o.seq DESC
LIMIT 1;

-- name: position_before_seq
-- Just before the first event (in delivery order) with seq > N: every such event is replayed.
SELECT txid::text, seq - 1
FROM sync.events_outbox o
WHERE seq > %(seq)s
ORDER BY o.txid, o.seq
LIMIT 1;

-- name: position_before_time
-- Just before the first event (in delivery order) created at or after the given time.
SELECT txid::text, seq - 1
FROM sync.events_outbox o
WHERE created_at >= %(at)s
ORDER BY o.txid, o.seq
LIMIT 1;

-- name: position_forward
-- The N-th final event after a position (N >= 1).
SELECT txid::text, seq
FROM sync.events_outbox o
WHERE (txid, seq) > (%(txid)s::xid8, %(seq)s::bigint)
  AND txid < pg_snapshot_xmin(pg_current_snapshot())
ORDER BY o.txid, o.seq
OFFSET %(n)s - 1
LIMIT 1;

-- name: position_backward
-- The position N events back from a position (N >= 1): the event before the N-th one back.
SELECT txid::text, seq
FROM sync.events_outbox o
WHERE (txid, seq) <= (%(txid)s::xid8, %(seq)s::bigint)
ORDER BY o.txid DESC, o.seq DESC
OFFSET %(n)s
LIMIT 1;

-- name: count_between
-- Events after position a up to and including position b.
SELECT count(*)
FROM sync.events_outbox
WHERE (txid, seq) > (%(a_txid)s::xid8, %(a_seq)s::bigint)
  AND (txid, seq) <= (%(b_txid)s::xid8, %(b_seq)s::bigint);

-- name: set_position
-- An operator moved the offset: a new epoch fences off any leader that still thinks it leads.
UPDATE sync.consumer_offsets
SET last_txid = %(txid)s::xid8,
    last_seq = %(seq)s,
    updated_at = now(),
    leader_epoch = leader_epoch + 1,
    leader_host = NULL,
    leader_pid = NULL,
    leader_since = NULL
WHERE consumer = %(consumer)s;

-- name: horizon_xmin
SELECT pg_snapshot_xmin(pg_current_snapshot())::text;

-- name: set_waiting
-- Tell producers whether this consumer waits for a NOTIFY (sql/backend/schema.sql, The wake-up).
INSERT INTO sync.consumer_waits (consumer, waiting, updated_at)
VALUES (%(consumer)s, %(waiting)s, now())
ON CONFLICT (consumer) DO UPDATE
SET waiting = EXCLUDED.waiting, updated_at = EXCLUDED.updated_at;

-- name: park_entries
-- Park events in the dead-letter queue (in the transaction that moves the offset past them).
-- One array per column, one element per event (consumer/store/dlq.py park_parameters); each
-- payload is the entry's JSON text as delivered, kept as json: the same text, byte for byte,
-- whatever the outbox's json accepted ("\u0000", lone surrogates, numbers no double holds).
-- The payloads are not taken out of a JSON document of entries with ->, json_to_record or
-- json_each: those de-escape every string of what they read and refuse "\u0000" and lone
-- surrogates anywhere in it, and a parking that fails holds the offset on that batch for ever.
-- origin is the entry's as delivered (this node's name for a change made here, when the node
-- is named), so a retry sends the event as it was sent.
INSERT INTO sync.dlq_messages
    (consumer, seq, entity_type, entity_id, op, payload, event_created_at, error_code,
     error_message, max_retries, origin)
SELECT %(consumer)s, e.seq, e.entity_type, e.entity_id, e.op, e.payload::json,
       e.created_at::timestamptz, e.error_code, e.error_message, %(max_retries)s, e.origin
FROM unnest(%(seqs)s::bigint[], %(entity_types)s::text[], %(entity_ids)s::text[],
            %(ops)s::text[], %(payloads)s::text[], %(created_ats)s::text[], %(codes)s::text[],
            %(messages)s::text[], %(origins)s::text[])
     AS e(seq, entity_type, entity_id, op, payload, created_at, error_code, error_message,
          origin)
ON CONFLICT (consumer, seq) DO NOTHING;

-- recording-upload --------------------------------------------------------------------------
-- The backend's recordings rows (sql/examples/voicebot.sql), read and marked by the
-- recording-upload sink and, for parked uploads, by its wiring (consumer/app/wiring.py).

-- name: recordings_table
SELECT to_regclass('public.recordings') IS NOT NULL AS present;

-- name: recording_get
SELECT id::text, call_log_id::text, file_path, upload_status, s3_url
  FROM public.recordings
 WHERE id = %(id)s::uuid;

-- name: recording_mark_uploaded
-- Only a row not marked yet: a replay neither rewrites the row nor sends a new event about it.
UPDATE public.recordings
   SET upload_status = 'uploaded', s3_url = %(file_url)s, updated_at = now()
 WHERE id = %(id)s::uuid AND upload_status <> 'uploaded';

-- name: recording_mark_failed
-- Its upload was parked in the dead-letter queue (or an operator's retry of it failed). Only a
-- row still pending: one uploaded meanwhile stays uploaded, and a replay changes nothing.
UPDATE public.recordings
   SET upload_status = 'failed', updated_at = now()
 WHERE id = %(id)s::uuid AND upload_status = 'pending';

-- name: recording_mark_pending
-- An operator retries its parked upload: pending again while it is tried.
UPDATE public.recordings
   SET upload_status = 'pending', updated_at = now()
 WHERE id = %(id)s::uuid AND upload_status = 'failed';

-- name: recordings_parked
-- The recordings uploads this consumer parked that an operator has not settled or taken up
-- (PENDING, DEAD), with the row as the parked event saw it (read in Python, never with ->: the
-- payload may hold what PostgreSQL's json functions refuse to de-escape).
SELECT entity_id, payload::text
  FROM sync.dlq_messages
 WHERE consumer = %(consumer)s
   AND entity_type = 'recording'
   AND op = 'upsert'
   AND status IN ('PENDING', 'DEAD');

-- name: recording_fail_parked
-- A row left pending although its upload was parked: the mark that follows the park's commit
-- was lost (a crash, the database gone for a moment). Only a row exactly as the parked event saw
-- it (the same updated_at): a row written since is a new request, uploaded through the event
-- that write made.
UPDATE public.recordings
   SET upload_status = 'failed', updated_at = now()
 WHERE id = %(id)s::uuid
   AND upload_status = 'pending'
   AND updated_at = %(updated_at)s::timestamptz;

-- name: dlq_count
SELECT count(*)
FROM sync.dlq_messages
WHERE consumer = %(consumer)s AND (%(status)s::text IS NULL OR status = %(status)s::text);

-- name: dlq_list
-- Newest first; events parked by one commit share created_at, so seq breaks the tie.
-- Every dlq_ query that returns messages returns the whole row (`*`, read into DlqMessage in
-- consumer/store/dlq.py, whose fields are the table's columns). The store reads the json payload
-- as its text, never decoded into Python numbers (a 64-bit integer or a double would not hold
-- every number a json value may carry).
SELECT *
FROM sync.dlq_messages
WHERE consumer = %(consumer)s AND (%(status)s::text IS NULL OR status = %(status)s::text)
ORDER BY created_at DESC, seq DESC
LIMIT %(limit)s OFFSET %(offset)s;

-- name: dlq_get
SELECT *
FROM sync.dlq_messages
WHERE id = %(id)s;

-- name: dlq_lock
-- Taken before a claim: concurrent claims of one message see each other's counts.
SELECT status, retry_count, max_retries
FROM sync.dlq_messages
WHERE id = %(id)s
FOR UPDATE;

-- name: dlq_claim
UPDATE sync.dlq_messages
SET status = 'RETRYING', retry_count = retry_count + 1, last_retry_at = now()
WHERE id = %(id)s
RETURNING *;

-- name: dlq_resolve
-- Unconditional: the event did reach the receiver, whatever a concurrent retry concluded.
UPDATE sync.dlq_messages
SET status = 'RESOLVED'
WHERE id = %(id)s
RETURNING *;

-- name: dlq_fail
-- Only a message still being retried: a concurrent retry that resolved it wins.
UPDATE sync.dlq_messages
SET status = CASE WHEN retry_count >= max_retries THEN 'DEAD' ELSE 'PENDING' END,
    error_code = %(code)s,
    error_message = %(message)s
WHERE id = %(id)s AND status = 'RETRYING'
RETURNING *;

-- name: dlq_delete
DELETE FROM sync.dlq_messages WHERE id = %(id)s RETURNING id;

-- name: dlq_retryable_ids
-- Keyset pages in id order: a message that fails again during a retry-all goes back to PENDING
-- behind the cursor, so no message is retried twice by one run.
SELECT id
FROM sync.dlq_messages
WHERE consumer = %(consumer)s
  AND status IN ('PENDING', 'RETRYING')
  AND retry_count < max_retries
  AND (%(after)s::uuid IS NULL OR id > %(after)s::uuid)
ORDER BY id
LIMIT %(limit)s;

-- retention --------------------------------------------------------------------------------------
-- `serversync cleanup` and `serversync consumers` (consumer/store/retention.py). Positions are
-- compared as (xid8, bigint) rows, never as text: as text '10000' sorts before '9999'.
-- Every row at or before a consumer's position belongs to a transaction that had ended when the
-- consumer read it (read_batch reads below the snapshot's xmin only), so nothing can appear
-- behind a position later, and a row behind every consumer's position is needed by none.

-- name: retention_try_lock
-- One cleanup at a time per database: two would pick the same rows and queue on each other's
-- row locks. Session-level, on the cleanup's autocommit connection.
SELECT pg_try_advisory_lock(hashtext('serversync.cleanup')) AS locked;

-- name: retention_unlock
SELECT pg_advisory_unlock(hashtext('serversync.cleanup')) AS unlocked;

-- name: retention_cutoff
-- The database's clock: created_at and updated_at were stamped with it, not with the caller's.
SELECT now() - %(older_than)s::interval AS cutoff;

-- name: retention_consumer_needs
-- Every registered consumer, its position, and the rows older than the cutoff it has not passed
-- yet (cleanup keeps those), counted among the first exact_up_to + 1 rows after its position
-- (`walked`: how many there were). When walked <= exact_up_to the count is the consumer's whole
-- need; otherwise it is a lower bound, and retention_outbox_plan's sample estimates the rest.
-- A consumer that keeps up has few rows after its position; an exact count for one far behind
-- would read the outbox from its position to the end.
SELECT c.consumer,
       c.last_txid::text AS last_txid,
       c.last_seq,
       c.updated_at,
       needed.walked,
       needed.old_rows_needed,
       needed.oldest_needed_at
FROM sync.consumer_offsets c
CROSS JOIN LATERAL (
    SELECT count(*) AS walked,
           count(*) FILTER (WHERE w.created_at < %(cutoff)s) AS old_rows_needed,
           min(w.created_at) FILTER (WHERE w.created_at < %(cutoff)s) AS oldest_needed_at
    FROM (
        SELECT o.created_at
        FROM sync.events_outbox o
        WHERE (o.txid, o.seq) > (c.last_txid, c.last_seq)
        ORDER BY o.txid, o.seq
        LIMIT %(exact_up_to)s::bigint + 1
    ) w
) needed
ORDER BY c.consumer;

-- name: retention_outbox_plan
-- Rows older than the cutoff, and for every consumer the ones it has not passed, counted in a
-- sample of about sample_blocks of the outbox's blocks (TABLESAMPLE SYSTEM: whole blocks, picked
-- at random), so that planning reads as much of a 10-million-row outbox as of a small one. No
-- index on created_at finds old rows (sql/backend/schema.sql says why): an exact count reads the
-- whole table. `percent` is the share of the blocks read: a count times 100 / percent estimates
-- the outbox's, and is exact when percent is 100 (an outbox of at most sample_blocks blocks is
-- read whole). oldest_needed_at is the oldest such row in the sample. With no consumer there is
-- one row, its consumer NULL.
WITH size AS MATERIALIZED (
    SELECT least(100, 100.0 * %(sample_blocks)s::bigint
                      / greatest(1, pg_relation_size('sync.events_outbox'::regclass)
                                    / current_setting('block_size')::bigint))::float8 AS percent
), sample AS MATERIALIZED (
    SELECT o.txid, o.seq, o.created_at
    FROM sync.events_outbox o TABLESAMPLE SYSTEM ((SELECT s.percent FROM size s))
    WHERE o.created_at < %(cutoff)s
)
SELECT (SELECT s.percent FROM size s) AS percent,
       (SELECT count(*) FROM sample) AS old_rows,
       c.consumer,
       needed.old_rows_needed,
       needed.oldest_needed_at
FROM (SELECT) one
LEFT JOIN sync.consumer_offsets c ON true
LEFT JOIN LATERAL (
    SELECT count(*) AS old_rows_needed, min(s.created_at) AS oldest_needed_at
    FROM sample s
    WHERE (s.txid, s.seq) > (c.last_txid, c.last_seq)
) needed ON c.consumer IS NOT NULL
ORDER BY c.consumer;

-- name: retention_delete_outbox
-- One batch: of the next `window` rows in position order after `after` that every consumer has
-- passed, the first `limit` older than the cutoff. `after` is where the previous batch stopped,
-- so no batch walks the index entries of rows deleted before it. The window bounds what one
-- batch reads wherever the old rows are: past them, a batch reads `window` younger rows and
-- deletes none, where a search for `limit` old ones would walk the rest of the outbox up to the
-- floor in one statement. The floor is read again by every batch, so a consumer registered or
-- reset meanwhile is honoured from the next batch on. DELETE takes ROW EXCLUSIVE on the table,
-- as producers' INSERTs do, and these two never conflict; the rows it locks are old ones no
-- producer touches. Returns how many went and the position of the last one; how many rows the
-- window held and the position of its last; and how many of them follow the last row picked
-- (all of them when none was): the younger rows the window ended with.
WITH floor AS MATERIALIZED (
    SELECT c.last_txid, c.last_seq
    FROM sync.consumer_offsets c
    ORDER BY c.last_txid, c.last_seq
    LIMIT 1
), examined AS MATERIALIZED (
    SELECT w.ctid AS row_id, w.txid, w.seq, w.created_at < %(cutoff)s AS old
    FROM floor f
    CROSS JOIN LATERAL (
        SELECT o.ctid, o.txid, o.seq, o.created_at
        FROM sync.events_outbox o
        WHERE (o.txid, o.seq) > (%(after_txid)s::xid8, %(after_seq)s::bigint)
          AND (o.txid, o.seq) <= (f.last_txid, f.last_seq)
        ORDER BY o.txid, o.seq
        LIMIT %(window)s
    ) w
), doomed AS MATERIALIZED (
    SELECT e.row_id, e.txid, e.seq
    FROM examined e
    WHERE e.old
    ORDER BY e.txid, e.seq
    LIMIT %(limit)s
), gone AS (
    DELETE FROM sync.events_outbox o
    WHERE o.ctid = ANY (ARRAY(SELECT row_id FROM doomed))
    RETURNING o.txid, o.seq
), last_doomed AS (
    SELECT d.txid, d.seq FROM doomed d ORDER BY d.txid DESC, d.seq DESC LIMIT 1
), last_examined AS (
    SELECT e.txid, e.seq FROM examined e ORDER BY e.txid DESC, e.seq DESC LIMIT 1
)
SELECT (SELECT count(*) FROM gone) AS deleted,
       (SELECT (array_agg(g.txid ORDER BY g.txid DESC, g.seq DESC))[1]::text FROM gone g)
           AS last_txid,
       (SELECT (array_agg(g.seq ORDER BY g.txid DESC, g.seq DESC))[1] FROM gone g) AS last_seq,
       (SELECT count(*) FROM examined) AS examined,
       (SELECT l.txid::text FROM last_examined l) AS end_txid,
       (SELECT l.seq FROM last_examined l) AS end_seq,
       (SELECT count(*)
        FROM examined e
        WHERE NOT EXISTS (SELECT FROM last_doomed d WHERE (e.txid, e.seq) <= (d.txid, d.seq)))
           AS young_tail;

-- name: retention_outbox_first
-- The first row in delivery order, read once after a cleanup deleted rows. Until VACUUM removes
-- them, the deleted rows' index entries stay at the start of the primary key, and the first walk
-- from the start (the outbox gauges' oldest row, a consumer at the start) visits every one's heap
-- tuple: 4.5 s after 3 million rows went, where the walks after it, which skip the entries it
-- marked dead, take milliseconds. The cleanup takes that first walk itself.
SELECT o.created_at FROM sync.events_outbox o ORDER BY o.txid, o.seq LIMIT 1;

-- name: retention_dlq_count
-- Dead letters resolved before the cutoff (updated_at is stamped when a message is resolved and
-- never changes afterwards). PENDING, RETRYING and DEAD ones wait for an operator.
SELECT count(*)
FROM sync.dlq_messages
WHERE status = 'RESOLVED' AND updated_at < %(cutoff)s;

-- name: retention_delete_dlq
-- One batch of retention_dlq_count's messages. The conditions are repeated on the deleted rows:
-- a message changed meanwhile is checked again as it now stands.
WITH gone AS (
    DELETE FROM sync.dlq_messages m
    WHERE m.id = ANY (ARRAY(
            SELECT d.id
            FROM sync.dlq_messages d
            WHERE d.status = 'RESOLVED' AND d.updated_at < %(cutoff)s
            LIMIT %(limit)s))
      AND m.status = 'RESOLVED'
      AND m.updated_at < %(cutoff)s
    RETURNING 1
)
SELECT count(*) AS deleted FROM gone;

-- name: retention_enqueue_keys_count
-- Idempotency keys of sync.enqueue taken before the cutoff: they go with the outbox rows of the
-- same age (a repeated key older than the retention is an event again).
SELECT count(*)
FROM sync.enqueue_keys
WHERE created_at < %(cutoff)s;

-- name: retention_delete_enqueue_keys
-- One batch of retention_enqueue_keys_count's keys.
WITH gone AS (
    DELETE FROM sync.enqueue_keys k
    WHERE k.ctid = ANY (ARRAY(
            SELECT d.ctid
            FROM sync.enqueue_keys d
            WHERE d.created_at < %(cutoff)s
            LIMIT %(limit)s))
      AND k.created_at < %(cutoff)s
    RETURNING 1
)
SELECT count(*) AS deleted FROM gone;

-- name: retention_consumer
SELECT c.consumer, c.last_txid::text AS last_txid, c.last_seq, c.updated_at,
       (SELECT count(*) FROM sync.dlq_messages m WHERE m.consumer = c.consumer) AS dead_letters
FROM sync.consumer_offsets c
WHERE c.consumer = %(consumer)s;

-- name: retention_consumer_sessions
-- The sessions of a consumer's processes, leader or standby: each keeps a connection for the
-- leader lock whose application_name starts with `prefix` (consumer/store/leadership.py).
SELECT a.pid, a.application_name
FROM pg_stat_activity a
WHERE a.datname = current_database()
  AND a.pid <> pg_backend_pid()
  AND starts_with(a.application_name, %(prefix)s)
ORDER BY a.backend_start, a.pid;

-- name: retention_remove_consumer
DELETE FROM sync.consumer_offsets
WHERE consumer = %(consumer)s
RETURNING last_txid::text AS last_txid, last_seq;

-- name: retention_cancel_snapshots
-- A removed consumer's unfinished snapshots: nobody is left to read them.
UPDATE sync.snapshots SET state = 'cancelled', updated_at = now(), finished_at = now()
WHERE consumer = %(consumer)s AND state = 'running';

-- name: retention_forget_waiting
-- A consumer stopped while idle leaves waiting = true behind, and the relay would NOTIFY in
-- every producer transaction for a consumer that will never listen again.
DELETE FROM sync.consumer_waits WHERE consumer = %(consumer)s;

-- name: retention_purge_dlq
DELETE FROM sync.dlq_messages WHERE consumer = %(consumer)s;

-- == Snapshots (consumer/store/snapshots.py, functions/snapshot.sql) ==========================

-- name: snapshot_tracked
-- The tracked tables, with what a snapshot needs of each; the parts of the name to count rows.
SELECT t.table_name::oid AS relation_oid, t.table_name::text AS relation, t.entity_type,
       t.key_column, t.both_ways, n.nspname AS schema_name, c.relname AS table_name,
       c.relkind::text AS relkind
FROM sync.tracked_tables t
     JOIN pg_class c ON c.oid = t.table_name::oid
     JOIN pg_namespace n ON n.oid = c.relnamespace
ORDER BY t.table_name::text;

-- name: snapshot_resolve
-- A table as an operator names it (quoted or not, schema-qualified or by the search_path).
SELECT to_regclass(%(name)s)::oid AS relation_oid;

-- name: snapshot_row_security
-- Whether row level security applies to this role on the table (it would hide rows).
SELECT row_security_active(%(relation_oid)s::oid) AS active;

-- name: snapshot_create
INSERT INTO sync.snapshots (consumer, requested_by, delete_missing)
VALUES (%(consumer)s, %(requested_by)s, %(delete_missing)s)
RETURNING id;

-- name: snapshot_add_table
INSERT INTO sync.snapshot_tables
    (snapshot_id, position, relation, entity_type, key_column, both_ways, rows_total)
VALUES (%(snapshot)s, %(position)s, %(relation_oid)s::oid::regclass, %(entity_type)s,
        %(key_column)s, %(both_ways)s, %(rows_total)s);

-- name: snapshot_list
-- Snapshots, newest first: the running ones only, or every one, or one by id.
SELECT s.id, s.consumer, s.requested_by, s.delete_missing, s.state, s.begin_seq, s.created_at,
       s.updated_at, s.finished_at
FROM sync.snapshots s
WHERE (NOT %(running_only)s OR s.state = 'running')
  AND (%(id)s::bigint IS NULL OR s.id = %(id)s::bigint)
ORDER BY s.id DESC
LIMIT %(limit)s;

-- name: snapshot_tables
SELECT t.snapshot_id, t.position, t.relation::text AS relation, t.entity_type, t.key_column,
       t.both_ways, t.last_key, t.rows_total, t.rows_sent, t.done
FROM sync.snapshot_tables t
WHERE t.snapshot_id = ANY (%(ids)s::bigint[])
ORDER BY t.snapshot_id, t.position;

-- name: snapshot_try_lock
-- Held by the session writing a snapshot: one writer per snapshot.
SELECT pg_try_advisory_lock(hashtext('serversync.snapshot'), (%(id)s::bigint %% 2147483648)::int)
       AS locked;

-- name: snapshot_unlock
SELECT pg_advisory_unlock(hashtext('serversync.snapshot'), (%(id)s::bigint %% 2147483648)::int)
       AS unlocked;

-- name: snapshot_next_seq
-- The seq a snapshot begins at: every row it writes comes after it.
SELECT nextval(pg_get_serial_sequence('sync.events_outbox', 'seq')) AS seq;

-- name: snapshot_xmax
-- Taken after snapshot_next_seq: every transaction that could still write a lower seq has an
-- xid below it.
SELECT pg_snapshot_xmax(pg_current_snapshot())::text AS xmax;

-- name: snapshot_ready
-- Whether every transaction with an xid below `xmax` has ended (in any database of the cluster,
-- prepared ones included): then the snapshot may begin.
SELECT pg_snapshot_xmin(pg_current_snapshot()) >= %(xmax)s::xid8 AS ready;

-- name: snapshot_begin
UPDATE sync.snapshots SET begin_seq = %(seq)s, updated_at = now()
WHERE id = %(id)s AND begin_seq IS NULL AND state = 'running';

-- name: snapshot_chunk
-- One chunk, its own transaction. It gives up on a row lock held longer than the lock timeout
-- (a producer's edit in progress wins the wait), and the chunk is tried again.
SELECT rows_written, table_done
FROM sync.snapshot_chunk(%(id)s, %(position)s, %(chunk_size)s, %(lock_timeout)s);

-- name: snapshot_finish
SELECT sync.snapshot_finish(%(id)s);

-- name: snapshot_cancel
UPDATE sync.snapshots SET state = 'cancelled', updated_at = now(), finished_at = now()
WHERE id = %(id)s AND state = 'running'
RETURNING id;

-- name: outbox_history
SELECT complete, reason, since FROM sync.outbox_history;

-- name: outbox_history_incomplete
-- The outbox no longer holds every change since the start (kept as the first reason given).
UPDATE sync.outbox_history
SET complete = false, reason = %(reason)s, since = now()
WHERE complete;

-- == A consumer registered for the first time (consumer/store/new_consumers.py) ==================

-- name: consumer_registered
SELECT EXISTS (SELECT FROM sync.consumer_offsets WHERE consumer = %(consumer)s) AS registered;

-- == Where a JetStream consumer's message ids come from (consumer/app/jetstream_kind.py) ========

-- name: jetstream_source
-- This database's node name, its cluster's system identifier and its oid (pg_control_system()
-- and pg_database are readable by every role).
SELECT sync.node_name() AS node,
       (SELECT system_identifier FROM pg_control_system())::text AS system_identifier,
       (SELECT oid FROM pg_database WHERE datname = current_database())::text AS oid;
