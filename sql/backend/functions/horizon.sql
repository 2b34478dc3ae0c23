-- sync.read_horizon: how far a consumer may read the outbox, given its statement's snapshot.
--
-- A function file: `serversync migrate` applies it after the versioned migrations and again
-- whenever its text changes; every statement may run again on a database that has it.
--
-- An event may be read once every transaction that could still commit a row before it has
-- ended: the transactions running when the snapshot was taken hold the horizon back, since they
-- may commit later with a txid below events already read. The snapshot's xmin is the oldest of
-- them in the whole cluster, but a transaction of another database of the same server cannot
-- write this database's outbox. Taking xmin would let a report or a migration running in another
-- database hold every consumer here back for as long as it runs, and make each event wait for
-- whatever else the server is doing (a receiver database on the same server, applying the batch
-- before it). So the horizon is the oldest running transaction that is not known to be another
-- database's, or the snapshot's xmax when there is none; rows with a txid below it are final.
--
-- Which database a transaction belongs to is read from pg_stat_activity (backend_xid and datid,
-- both shown to every role). A running transaction it does not show counts as this database's
-- and holds the horizon as before: a prepared transaction (it has no backend), or one whose
-- backend has moved on since the snapshot.
--
-- pg_stat_activity reads a backend's database and its xid at two moments, so a backend slot
-- taken over in between could pair the old backend's database with the new backend's xid. That
-- cannot hide a transaction of this database: a backend clears its activity entry before it gives
-- up its slot (PostgreSQL runs its exit hooks in that order), so an entry that shows the old
-- backend was read while the old backend still held the slot; the activity is read after the
-- snapshot (the transaction's cached copy is cleared first), so a backend that took the slot
-- after that took its xid after the snapshot too, and such an xid is never among the snapshot's
-- running ones (pg_snapshot_xip lists only xids below the snapshot's xmax).
--
-- The caller's own xid, when it has one, is below the snapshot's xmin but not in its running
-- list: the horizon stays below it, so that a caller's own uncommitted rows are never read as
-- final. On a hot standby the running list is empty (every running xid is in the snapshot's
-- sub-transaction list, which pg_snapshot_xip does not show): there the horizon is xmin.
--
-- It costs nothing while no transaction runs (xmin = xmax), and one copy of the server's
-- backend list otherwise (tens of microseconds at a hundred connections; it grows with
-- max_connections and track_activity_query_size). No SECURITY DEFINER: it reads only what every
-- role may read. VOLATILE, and to be evaluated once per statement (a MATERIALIZED CTE): it reads
-- live state, so two calls in one statement may disagree, and rows tested against different
-- horizons could be read out of order.
CREATE OR REPLACE FUNCTION sync.read_horizon(snapshot pg_snapshot) RETURNS xid8
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    horizon xid8;
BEGIN
    IF pg_snapshot_xmin(snapshot) = pg_snapshot_xmax(snapshot) OR pg_is_in_recovery() THEN
        RETURN pg_snapshot_xmin(snapshot);
    END IF;
    PERFORM pg_stat_clear_snapshot();
    horizon := coalesce(
        (SELECT min(x)
         FROM pg_snapshot_xip(snapshot) AS x
         WHERE x::xid NOT IN (
             SELECT a.backend_xid
             FROM pg_stat_activity a
             WHERE a.backend_xid IS NOT NULL
               AND a.datid <> (SELECT d.oid FROM pg_database d
                               WHERE d.datname = current_database()))),
        pg_snapshot_xmax(snapshot));
    RETURN least(horizon, pg_current_xact_id_if_assigned());
END;
$$;
