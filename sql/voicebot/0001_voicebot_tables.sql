-- The voicebot backend's tables (seed 000), tracked by the relay. This is the default schema of
-- the demo and the tests; a user with tables of their own skips it (serversync migrate --core-only)
-- and calls sync.track() on their tables instead.

CREATE TABLE public.call_logs (
    id            uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    caller_number text        NOT NULL,
    callee_number text        NOT NULL,
    direction     text        NOT NULL DEFAULT 'inbound' CHECK (direction IN ('inbound', 'outbound')),
    status        text        NOT NULL DEFAULT 'in_progress',
    started_at    timestamptz NOT NULL DEFAULT now(),
    ended_at      timestamptz,
    duration_sec  integer,
    summary       text,
    updated_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE public.recordings (
    id            uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    call_log_id   uuid        NOT NULL REFERENCES public.call_logs (id) ON DELETE CASCADE,
    -- mixed.wav relative to $RECORDINGS_DIR: <callId>/mixed.wav
    file_path     text        NOT NULL,
    duration_sec  integer,
    upload_status text        NOT NULL DEFAULT 'pending'
                              CHECK (upload_status IN ('pending', 'uploaded', 'failed')),
    s3_url        text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX recordings_call_log_id_idx ON public.recordings (call_log_id);

CREATE TABLE public.registered_numbers (
    id           uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    phone_number text        NOT NULL UNIQUE,
    label        text,
    category     text        NOT NULL DEFAULT 'general',
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);

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

CREATE TABLE public.ivr_flows (
    id         uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    name       text        NOT NULL,
    definition jsonb       NOT NULL DEFAULT '{}'::jsonb,
    enabled    boolean     NOT NULL DEFAULT true,
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE public.schedules (
    id          uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    name        text        NOT NULL,
    timezone    text        NOT NULL DEFAULT 'Asia/Tokyo',
    rules       jsonb       NOT NULL DEFAULT '[]'::jsonb,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE public.announcements (
    id         uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    name       text        NOT NULL,
    text       text,
    audio_path text,
    updated_at timestamptz NOT NULL DEFAULT now()
);

SELECT sync.track('public.call_logs', 'call_log');
SELECT sync.track('public.recordings', 'recording');
SELECT sync.track('public.registered_numbers', 'registered_number');
SELECT sync.track('public.routing_rules', 'routing_rule');
SELECT sync.track('public.ivr_flows', 'ivr_flow');
SELECT sync.track('public.schedules', 'schedule');
SELECT sync.track('public.announcements', 'announcement');
