-- Delivery that runs unattended: any outbox row can be parked, and a failing streak is visible.
--
-- The outbox keeps payloads as json (the text the relay wrote), which accepts what jsonb refuses:
-- "\u0000" and lone surrogates such as "\ud800" in a user's json column. Parked events were
-- stored as jsonb, so parking such a row failed, the commit that moved the offset past it failed
-- with it, and the consumer read the same batch again forever. The dead-letter queue now keeps
-- the payload as the same json text the outbox held: whatever the outbox holds can be parked,
-- and is retried byte for byte.
ALTER TABLE sync.dlq_messages ALTER COLUMN payload TYPE json USING payload::json;

-- While deliveries of a consumer keep failing (the receiver down, or answering that it is the
-- wrong destination), the offset is held and the batch retried for as long as it takes. These
-- say since when and why, for `serversync status`, /readyz and the alert on a long streak; an
-- offset commit clears them.
ALTER TABLE sync.consumer_offsets
    ADD COLUMN failing_since  timestamptz,
    ADD COLUMN failing_reason text;
