-- The conversation store: a projection of chat.prompts and chat.generations.
CREATE TABLE conversations (
    id          uuid PRIMARY KEY,
    tenant      text        NOT NULL,
    title       text,
    created_at  timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL,
    deleted     boolean     NOT NULL DEFAULT false
);
CREATE INDEX conversations_by_tenant ON conversations (tenant, updated_at DESC);

-- One row per message, user and assistant, at its position within the conversation.
CREATE TABLE messages (
    conversation_id uuid        NOT NULL REFERENCES conversations (id),
    seq             integer     NOT NULL CHECK (seq >= 0),
    role            text        NOT NULL,
    content         text        NOT NULL,
    request_id      text        NOT NULL,
    created_at      timestamptz NOT NULL,
    PRIMARY KEY (conversation_id, seq)
);

-- One row per turn (request): what was asked for and how it went.
CREATE TABLE generations (
    request_id        text PRIMARY KEY,
    conversation_id   uuid        NOT NULL REFERENCES conversations (id),
    tenant            text        NOT NULL,
    model             text,
    sampling          jsonb,
    status            text        NOT NULL
        CHECK (status IN ('pending', 'running', 'finished', 'failed', 'cancelled')),
    finish_reason     text,
    prompt_tokens     integer,
    completion_tokens integer,
    ttft_ms           double precision,
    duration_ms       double precision,
    attempt           integer     NOT NULL DEFAULT 0,
    worker            text,
    error_code        text,
    error_message     text,
    submitted_at      timestamptz,
    finished_at       timestamptz
);
CREATE INDEX generations_by_conversation ON generations (conversation_id, status);

-- The projector's consumed positions, written in the same transaction as the rows.
CREATE TABLE projector_positions (
    topic       text    NOT NULL,
    partition   integer NOT NULL,
    next_offset bigint  NOT NULL,
    PRIMARY KEY (topic, partition)
);
