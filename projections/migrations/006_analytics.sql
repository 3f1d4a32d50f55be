-- Usage and quality figures per tenant, model and minute, kept by `pipeline analytics`
-- (projections/analytics.py) from chat.prompts and chat.generations.
--
-- Exactness: a turn's facts land in analytics_turns, each one only where it is still
-- NULL, and a turn is added to the minute tables in the same transaction that first sets
-- the fact (started_at for `started`, counted for its end). Events delivered again, by
-- the at-least-once consumer after a crash or by a second consumer during a rebalance,
-- find the fact set and add nothing.
CREATE TABLE analytics_turns (
    request_id        text PRIMARY KEY,
    tenant            text,
    model             text,
    conversation_id   uuid,
    submitted_at      timestamptz,      -- PromptSubmitted (the gateway's clock)
    started_at        timestamptz,      -- the first GenerationStarted
    first_token_at    timestamptz,      -- TokenDelta seq 0 (the worker's clock)
    ended_at          timestamptz,      -- the first terminal event
    outcome           text CHECK (outcome IN ('finished', 'cancelled', 'failed')),
    code              text,             -- GenerationFailed's code
    prompt_tokens     integer,
    completion_tokens integer,
    decode_ms         double precision, -- after the first token, on the worker
    counted           boolean NOT NULL DEFAULT false
);

CREATE TABLE analytics_minutes (
    minute            timestamptz NOT NULL,
    tenant            text        NOT NULL,
    model             text        NOT NULL,
    started           bigint      NOT NULL DEFAULT 0,
    finished          bigint      NOT NULL DEFAULT 0,
    cancelled         bigint      NOT NULL DEFAULT 0,
    failed            bigint      NOT NULL DEFAULT 0,
    prompt_tokens     bigint      NOT NULL DEFAULT 0,
    completion_tokens bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, minute, model)
);

CREATE TABLE analytics_failures (
    minute  timestamptz NOT NULL,
    tenant  text        NOT NULL,
    model   text        NOT NULL,
    code    text        NOT NULL,
    turns   bigint      NOT NULL,
    PRIMARY KEY (tenant, minute, model, code)
);

-- Latency sketches: a DDSketch (1% relative accuracy) stored as bins, so minutes merge
-- into hours and days by adding counts (pipeline/sketch.py).
CREATE TABLE analytics_latency (
    minute  timestamptz NOT NULL,
    tenant  text        NOT NULL,
    model   text        NOT NULL,
    metric  text        NOT NULL CHECK (metric IN ('ttft', 'itl')),
    bin     integer     NOT NULL,
    turns   bigint      NOT NULL,
    PRIMARY KEY (tenant, minute, model, metric, bin)
);

-- Sessions (conversations) with a turn started in the minute: distinct over any range.
CREATE TABLE analytics_sessions (
    minute          timestamptz NOT NULL,
    tenant          text        NOT NULL,
    model           text        NOT NULL,
    conversation_id uuid        NOT NULL,
    PRIMARY KEY (tenant, minute, model, conversation_id)
);
