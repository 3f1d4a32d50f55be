"""Text to vectors with vLLM's pooling runner (``runner="pooling"``): a model made for
embeddings, or a causal one converted (``convert="embed"``: its last token's hidden state,
normalised). One engine per process; its calls take turns, each one a batch, and a
recall's (``urgent``) goes before any that is not, waiting only for the batch running."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from memory.settings import MemorySettings

log = logging.getLogger(__name__)
Vector = list[float]


class Turns:
    """One thread at a time holds what this guards: at once if it is free, else when the
    holder lets go; a thread that is not urgent waits while an urgent one is waiting."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._urgent = 0  # urgent threads waiting or holding
        self.waiting = 0  # threads waiting

    @contextlib.contextmanager
    def hold(self, urgent: bool = False) -> Iterator[None]:
        with self._cond:
            self._urgent += urgent
            self.waiting += 1
            try:
                self._cond.wait_for(lambda: not self._busy and (urgent or not self._urgent))
            except BaseException:
                self._urgent -= urgent
                raise
            finally:
                self.waiting -= 1
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._urgent -= urgent
                self._cond.notify_all()


class Embedder:
    def __init__(self, model: str, name: str, settings: MemorySettings) -> None:
        """``model``: a directory or a Hugging Face name; ``name``, what the memories
        record they were embedded with (a recall compares only those)."""
        # The engine in this process, stepped by the embedding call's own thread. In
        # processes of its own (vLLM's default), the model's process busy-waits on their
        # shared-memory queue for a second after every call: a second of a core taken,
        # on a small CPU host, from the chat worker's engine after each recall.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM  # heavy: only the memory service loads it

        self.name = name
        self._engine = Turns()
        options: dict[str, Any] = {
            "dtype": settings.dtype, "max_model_len": settings.max_model_len,
            "kv_cache_memory_bytes": settings.kv_cache_memory_bytes, "enforce_eager": True,
            "distributed_executor_backend": "uni"}
        self._llm: Any = LLM(model=model, runner="pooling", convert="embed", **options)

    def embed_sync(self, texts: Sequence[str], urgent: bool = False) -> list[Vector]:
        if not texts:
            return []
        with self._engine.hold(urgent):
            # A text longer than the model's context is cut to it (its start is kept).
            outputs = self._llm.embed(list(texts), use_tqdm=False, tokenization_kwargs={
                "truncate_prompt_tokens": -1, "truncation_side": "right"})
        return [list(o.outputs.embedding) for o in outputs]

    async def embed(self, texts: Sequence[str], urgent: bool = False) -> list[Vector]:
        return await asyncio.to_thread(self.embed_sync, texts, urgent)

    def close(self) -> None:
        with self._engine.hold(urgent=True):
            engine = getattr(self._llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
