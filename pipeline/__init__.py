"""The plumbing every app shares, and nothing of any one app's logic.

* Talking through Kafka: the adapter (``kafka``, the only importer of confluent_kafka),
  the topics and their settings (``topics``), records to events and back (``codec``),
  where a conversation lives (``partitioning``), dead letters (``deadletter``), and the
  event contract third parties read (``contract``: JSON Schema and AsyncAPI).
* The small protocols apps keep with each other over a topic: workers' heartbeats
  (``roster``), the rollout records gateways route by (``rollout``), and what a
  worker's committed offsets say waits (``waiting``).
* What every process needs: settings (``settings``), metrics, logs, traces, retries and
  the process's runtime (``runtime``).

The rules over events are in ``schemas``; the apps (``gateway``, ``workers``,
``projections``) build on both and never import each other.
"""
