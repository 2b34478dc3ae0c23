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
-- cannot hide a transaction of this database: the activity is read after the snapshot (the
-- transaction's cached copy is cleared first), so a backend that took a slot after the read began
-- took its xid after the snapshot too, and such an xid is never among the snapshot's running
-- ones (pg_snapshot_xip lists only xids below the snapshot's xmax).
--
-- It costs nothing while no transaction runs (xmin = xmax), and one read of the server's
-- backend list (tens of microseconds) otherwise. No SECURITY DEFINER: it reads only what
-- every role may read.
CREATE OR REPLACE FUNCTION sync.read_horizon(snapshot pg_snapshot) RETURNS xid8
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF pg_snapshot_xmin(snapshot) = pg_snapshot_xmax(snapshot) THEN
        RETURN pg_snapshot_xmin(snapshot);
    END IF;
    PERFORM pg_stat_clear_snapshot();
    RETURN coalesce(
        (SELECT min(x)
         FROM pg_snapshot_xip(snapshot) AS x
         WHERE x::xid NOT IN (
             SELECT a.backend_xid
             FROM pg_stat_activity a
             WHERE a.backend_xid IS NOT NULL
               AND a.datid <> (SELECT d.oid FROM pg_database d
                               WHERE d.datname = current_database()))),
        pg_snapshot_xmax(snapshot));
END;
$$;
