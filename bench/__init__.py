"""Benchmarks: programs that print and save figures (``pipeline bench``), never timed
assertions in the test suite. They may import any part of the project; nothing imports
them but the ``pipeline`` command.

* ``run``: the parts in sequence, each writing ``<part>.json`` and ``<part>.md``;
* ``serving``: the engine, a worker, ``vllm serve`` and the pipeline, in pairs;
* ``capacity``: the pipeline with the SIMULATED engine (latency, throughput, streams);
* ``projection``: the projector's and a replay's events/s;
* ``loadgen``: the aiohttp load generator they share.
"""
