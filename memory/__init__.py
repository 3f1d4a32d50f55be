"""Long-term memory: what a user told the service in earlier sessions, recalled into a
new turn's input (retrieval-augmented generation).

``store`` keeps the memories in PostgreSQL with pgvector, a projection of the durable
record rebuilt by reading the log again; ``embedder`` turns text into vectors with
vLLM's pooling runner; ``service`` is the process (``pipeline memory``): a consumer in
group ``memory`` that keeps the store, and the HTTP API the gateways recall from.
"""
