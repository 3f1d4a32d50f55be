-- What each turn was charged against its API key's tokens per minute when it was
-- accepted (PromptSubmitted.charge). When the turn ends, the projector trues the key's
-- bucket up to what the turn really used and clears charge_tokens, in the transaction
-- that stores the end, so a turn is trued up once: a turn sent without max_tokens is
-- charged a default on acceptance, and its real usage once it ends.
ALTER TABLE generations ADD COLUMN charge_key text, ADD COLUMN charge_tokens bigint;

-- Refill the key's token bucket for the time since it was last charged (a minute's
-- worth at most), then take p_tokens from it (a negative amount gives back). The bucket
-- may go below zero: the key's next turns wait until it has refilled past their cost.
CREATE FUNCTION true_up_bucket(p_key text, p_tokens double precision)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    t timestamptz := clock_timestamp();
    limit_tpm double precision;
BEGIN
    SELECT k.tpm INTO limit_tpm FROM api_keys k WHERE k.id = p_key;
    IF limit_tpm IS NULL THEN
        RETURN;  -- the key has no token limit (any more)
    END IF;
    UPDATE rate_buckets b
       SET tokens = LEAST(limit_tpm, LEAST(limit_tpm, b.tokens + EXTRACT(EPOCH FROM t - b.updated_at)
                                                      * limit_tpm / 60) - p_tokens),
           updated_at = t
     WHERE b.key_id = p_key;
END
$$;
