-- Nothing looks turns up by idempotency key (the key determines the completion id),
-- and a btree row holds at most ~2.7 kB: an index on a client's string let one long key
-- stop the projection for every tenant. The key stays a plain column.
DROP INDEX IF EXISTS generations_by_idempotency_key;

-- A turn belongs to its conversation's tenant: an event that would put a turn into
-- another tenant's conversation is refused by the store (and dead-lettered). NOT VALID:
-- enforced from now on, without rechecking the rows already stored.
ALTER TABLE conversations ADD CONSTRAINT conversations_id_tenant UNIQUE (id, tenant);
ALTER TABLE generations ADD CONSTRAINT generations_conversation_tenant
    FOREIGN KEY (conversation_id, tenant) REFERENCES conversations (id, tenant) NOT VALID;
