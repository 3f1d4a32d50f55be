"""Shared plumbing: topics, codec, settings, the Kafka adapter, runners, metrics, CLI."""
