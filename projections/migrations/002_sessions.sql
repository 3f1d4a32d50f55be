-- Idempotency keys find a retried request's original turn; `background` turns keep
-- running when their clients go away.
ALTER TABLE generations ADD COLUMN idempotency_key text;
ALTER TABLE generations ADD COLUMN background boolean NOT NULL DEFAULT false;
CREATE INDEX generations_by_idempotency_key ON generations (tenant, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
