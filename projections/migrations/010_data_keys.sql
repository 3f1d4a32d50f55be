-- The conversations' data keys, as chat.keys holds them, less their secret: where each
-- lies (partition and offset: its reference), whose it is (its end user by keyed
-- digest, as the record names it), and when it was made. The projector keeps it (a
-- projection of chat.keys); a gateway finds a conversation's key here, `pipeline erase
-- --user` a user's conversations, and a deletion the keys to destroy. A destroyed key's
-- row is deleted with its tombstone.
CREATE TABLE data_keys (
    key_id text PRIMARY KEY,          -- the reference a sealed box names it by
    short_id text NOT NULL,           -- the id its record is keyed by, with its conversation
    conversation_id uuid NOT NULL,
    tenant text NOT NULL,
    user_digest text,
    created_at timestamptz NOT NULL
);
CREATE INDEX data_keys_conversation ON data_keys (conversation_id, created_at);
CREATE INDEX data_keys_user ON data_keys (tenant, user_digest) WHERE user_digest IS NOT NULL;

-- The end users each conversation's turns named (a request's `user`, a session's memory
-- user): `pipeline erase --user` finds every conversation of a user here, whichever turn
-- named them. Dropped with the conversation.
CREATE TABLE conversation_users (
    conversation_id uuid NOT NULL REFERENCES conversations (id),
    tenant text NOT NULL,
    "user" text NOT NULL,
    PRIMARY KEY (conversation_id, "user")
);
CREATE INDEX conversation_users_by_user ON conversation_users (tenant, "user");

-- When a turn's first attempt started, by its worker's clock (its first GenerationStarted):
-- its live records are stamped by the same clock, so a resume reads from shortly before
-- it, not from as long before as two hosts' clocks may differ.
ALTER TABLE generations ADD COLUMN started_at timestamptz;
