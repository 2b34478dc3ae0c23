-- The dead-letter queue (seed 004): events a consumer gave up on, parked so that the consumer
-- moves on, kept for an operator to inspect, retry or delete.
CREATE TABLE sync.dlq_messages (
    id            uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    -- The consumer that parked it (seed 004's original_topic).
    consumer      text        NOT NULL,
    seq           bigint      NOT NULL,
    entity_type   text        NOT NULL,
    entity_id     text        NOT NULL,
    op            text        NOT NULL CHECK (op IN ('upsert', 'delete')),
    payload       jsonb       NOT NULL,
    event_created_at timestamptz,
    error_code    text        NOT NULL,
    error_message text        NOT NULL,
    retry_count   integer     NOT NULL DEFAULT 0,
    max_retries   integer     NOT NULL DEFAULT 3 CHECK (max_retries >= 0),
    status        text        NOT NULL DEFAULT 'PENDING'
                              CHECK (status IN ('PENDING', 'RETRYING', 'RESOLVED', 'DEAD')),
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    last_retry_at timestamptz,
    -- A batch replayed after a crash parks the same event again: once is enough.
    UNIQUE (consumer, seq)
);
CREATE INDEX idx_dlq_messages_consumer ON sync.dlq_messages (consumer, created_at DESC);
CREATE INDEX idx_dlq_messages_status ON sync.dlq_messages (status);
CREATE INDEX idx_dlq_messages_created_at ON sync.dlq_messages (created_at);

CREATE FUNCTION sync.touch_updated_at() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.updated_at := now();
    RETURN NEW;
END;
$$;

CREATE TRIGGER dlq_messages_updated_at BEFORE UPDATE ON sync.dlq_messages
FOR EACH ROW EXECUTE FUNCTION sync.touch_updated_at();
