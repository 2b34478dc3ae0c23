-- The voicebot backend's tables, tracked by the relay: the example schema of the demo and the
-- tests. Applied only on request (`serversync migrate --with-examples`), after serversync's own
-- schema, and again every time it is asked for.
--
-- Not a versioned migration: a real voicebot database has these tables already, with its own
-- data and maybe columns of its own. So a table is created only where none of that name exists,
-- with its index, and a table that exists is left exactly as it is (no column, index or
-- constraint added). A table not tracked yet is tracked; one tracked already keeps its entity
-- type and key column. Running this twice changes nothing the second time.
--
-- It replaces the versioned migration voicebot/0001_voicebot_tables (applied by `serversync
-- migrate` by default until --with-examples existed); a database that recorded it keeps the
-- record, and these statements find its tables in place.

DO $example$
BEGIN
    IF to_regclass('public.call_logs') IS NULL THEN
        CREATE TABLE public.call_logs (
            id            uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
            caller_number text        NOT NULL,
            callee_number text        NOT NULL,
            direction     text        NOT NULL DEFAULT 'inbound'
                                      CHECK (direction IN ('inbound', 'outbound')),
            status        text        NOT NULL DEFAULT 'in_progress',
            started_at    timestamptz NOT NULL DEFAULT now(),
            ended_at      timestamptz,
            duration_sec  integer,
            summary       text,
            updated_at    timestamptz NOT NULL DEFAULT now()
        );
    END IF;

    IF to_regclass('public.recordings') IS NULL THEN
        CREATE TABLE public.recordings (
            id            uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
            call_log_id   uuid        NOT NULL REFERENCES public.call_logs (id) ON DELETE CASCADE,
            -- The audio relative to $RECORDINGS_DIR: <callId>/mixed.wav (a call may have several
            -- recordings in its folder, sharing its meta.json).
            file_path     text        NOT NULL,
            duration_sec  integer,
            -- 'failed': recording-upload parked its upload in the dead-letter queue.
            upload_status text        NOT NULL DEFAULT 'pending'
                                      CHECK (upload_status IN ('pending', 'uploaded', 'failed')),
            s3_url        text,
            created_at    timestamptz NOT NULL DEFAULT now(),
            updated_at    timestamptz NOT NULL DEFAULT now()
        );
        CREATE INDEX recordings_call_log_id_idx ON public.recordings (call_log_id);
    END IF;

    IF to_regclass('public.registered_numbers') IS NULL THEN
        CREATE TABLE public.registered_numbers (
            id           uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
            phone_number text        NOT NULL UNIQUE,
            label        text,
            category     text        NOT NULL DEFAULT 'general',
            created_at   timestamptz NOT NULL DEFAULT now(),
            updated_at   timestamptz NOT NULL DEFAULT now()
        );
    END IF;

    IF to_regclass('public.routing_rules') IS NULL THEN
        CREATE TABLE public.routing_rules (
            id          uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
            priority    integer     NOT NULL DEFAULT 100,
            match_type  text        NOT NULL,
            match_value text        NOT NULL,
            action      text        NOT NULL,
            ivr_flow_id uuid,
            enabled     boolean     NOT NULL DEFAULT true,
            updated_at  timestamptz NOT NULL DEFAULT now()
        );
    END IF;

    IF to_regclass('public.ivr_flows') IS NULL THEN
        CREATE TABLE public.ivr_flows (
            id         uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
            name       text        NOT NULL,
            definition jsonb       NOT NULL DEFAULT '{}'::jsonb,
            enabled    boolean     NOT NULL DEFAULT true,
            updated_at timestamptz NOT NULL DEFAULT now()
        );
    END IF;

    IF to_regclass('public.schedules') IS NULL THEN
        CREATE TABLE public.schedules (
            id          uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
            name        text        NOT NULL,
            timezone    text        NOT NULL DEFAULT 'Asia/Tokyo',
            rules       jsonb       NOT NULL DEFAULT '[]'::jsonb,
            updated_at  timestamptz NOT NULL DEFAULT now()
        );
    END IF;

    IF to_regclass('public.announcements') IS NULL THEN
        CREATE TABLE public.announcements (
            id         uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
            name       text        NOT NULL,
            text       text,
            audio_path text,
            updated_at timestamptz NOT NULL DEFAULT now()
        );
    END IF;
END
$example$;

SELECT sync.track(t.name::regclass, t.entity_type)
  FROM (VALUES ('public.call_logs', 'call_log'),
               ('public.recordings', 'recording'),
               ('public.registered_numbers', 'registered_number'),
               ('public.routing_rules', 'routing_rule'),
               ('public.ivr_flows', 'ivr_flow'),
               ('public.schedules', 'schedule'),
               ('public.announcements', 'announcement')) AS t (name, entity_type)
 WHERE NOT EXISTS (SELECT 1 FROM sync.tracked_tables AS k WHERE k.table_name = t.name::regclass)
   -- A table of the user's keyed by another column is left untracked rather than failing here:
   -- `SELECT sync.track('public.recordings', 'recording', 'its_key')` names its key.
   AND EXISTS (SELECT 1 FROM pg_attribute AS a
                WHERE a.attrelid = t.name::regclass AND a.attname = 'id' AND NOT a.attisdropped);
