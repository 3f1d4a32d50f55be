-- API keys: the id, the tenant, the limits, a salt and sha256(salt || secret); never
-- the secret itself.
CREATE TABLE api_keys (
    id          text PRIMARY KEY,
    tenant      text        NOT NULL,
    name        text,
    salt        bytea       NOT NULL,
    hash        bytea       NOT NULL,
    rpm         integer     CHECK (rpm > 0),
    tpm         integer     CHECK (tpm > 0),
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);

-- Per-key token buckets, shared by every gateway process.
CREATE TABLE rate_buckets (
    key_id      text PRIMARY KEY REFERENCES api_keys (id),
    requests    double precision NOT NULL,
    tokens      double precision NOT NULL,
    updated_at  timestamptz      NOT NULL
);

-- Refill both buckets of a key for the time since it was last charged (each holds a
-- minute's worth at most), then take the request's cost from both or from neither.
-- One call, one row lock: limits hold across gateways without races.
CREATE FUNCTION take_from_buckets(p_key text, p_rpm double precision,
                                  p_tpm double precision, p_requests double precision,
                                  p_tokens double precision)
RETURNS TABLE (granted boolean, requests_left double precision,
               tokens_left double precision, wait_s double precision)
LANGUAGE plpgsql AS $$
DECLARE
    t timestamptz := clock_timestamp();
    r double precision;
    k double precision;
BEGIN
    INSERT INTO rate_buckets (key_id, requests, tokens, updated_at)
    VALUES (p_key, p_rpm, p_tpm, t) ON CONFLICT (key_id) DO NOTHING;
    SELECT LEAST(p_rpm, b.requests + EXTRACT(EPOCH FROM t - b.updated_at) * p_rpm / 60),
           LEAST(p_tpm, b.tokens + EXTRACT(EPOCH FROM t - b.updated_at) * p_tpm / 60)
      INTO r, k FROM rate_buckets b WHERE b.key_id = p_key FOR UPDATE;
    granted := r >= p_requests AND k >= p_tokens;
    IF granted THEN
        r := r - p_requests;
        k := k - p_tokens;
    END IF;
    UPDATE rate_buckets SET requests = r, tokens = k, updated_at = t WHERE key_id = p_key;
    requests_left := r;
    tokens_left := k;
    wait_s := GREATEST(CASE WHEN r < p_requests THEN (p_requests - r) * 60 / p_rpm ELSE 0 END,
                       CASE WHEN k < p_tokens THEN (p_tokens - k) * 60 / p_tpm ELSE 0 END);
    RETURN NEXT;
END
$$;
