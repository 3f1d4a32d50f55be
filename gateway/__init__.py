"""The gateway: OpenAI-compatible HTTP API that writes prompts to Kafka and streams replies."""
