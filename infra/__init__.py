"""Local infrastructure: a real Kafka broker (KRaft) and a real PostgreSQL server."""
