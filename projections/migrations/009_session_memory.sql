-- A session created with memory on (SessionCreated.memory_user): its turns recall that
-- user's memories and are remembered for them, unless a turn says otherwise.
ALTER TABLE conversations ADD COLUMN memory_user text;
