"""Text to vectors with vLLM's pooling runner (``runner="pooling"``): a model made for
embeddings, or a causal one converted (``convert="embed"``: its last token's hidden state,
normalised). One engine per process; its calls take turns on one thread, each one a
batch."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any

from memory.settings import MemorySettings

log = logging.getLogger(__name__)
Vector = list[float]


class Embedder:
    def __init__(self, model: str, name: str, settings: MemorySettings) -> None:
        """``model``: a directory or a Hugging Face name; ``name``, what the memories
        record they were embedded with (a recall compares only those)."""
        from vllm import LLM  # heavy: only the memory service loads it

        self.name = name
        self._lock = threading.Lock()
        options: dict[str, Any] = {
            "dtype": settings.dtype, "max_model_len": settings.max_model_len,
            "kv_cache_memory_bytes": settings.kv_cache_memory_bytes, "enforce_eager": True}
        self._llm: Any = LLM(model=model, runner="pooling", convert="embed", **options)

    def embed_sync(self, texts: Sequence[str]) -> list[Vector]:
        if not texts:
            return []
        with self._lock:
            # A text longer than the model's context is cut to it (its start is kept).
            outputs = self._llm.embed(list(texts), use_tqdm=False, tokenization_kwargs={
                "truncate_prompt_tokens": -1, "truncation_side": "right"})
        return [list(o.outputs.embedding) for o in outputs]

    async def embed(self, texts: Sequence[str]) -> list[Vector]:
        return await asyncio.to_thread(self.embed_sync, texts)

    def close(self) -> None:
        with self._lock:
            engine = getattr(self._llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
