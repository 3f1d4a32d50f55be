"""Make a tiny, randomly initialised Llama model that vLLM can serve on CPU.

No model can be downloaded on the machines this project is built on, so the
worker makes its own when none is configured: a byte-level BPE tokenizer
trained on a few paragraphs, with a chat template, and a two-layer Llama with
random weights (about 3 MB). Its text is noise, but every code path of the
engine is real. Point ``WORKER_MODEL`` at any Hugging Face model directory to
serve a real model instead.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = """\
The log is the system of record. Every fact about a conversation is an event.
Workers consume prompts and emit tokens; projections build the conversation store.
A request is accepted only once its event is durable in Kafka.
Streams survive the gateway: a client that reconnects continues where it stopped.
Hello! How can I help you today? I am a tiny model with random weights.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
"""

# The name it is served under when no model is configured.
TINY_MODEL_NAME = "tiny-random-llama"

SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]


def make_tiny_model(path: Path, *, vocab_size: int = 512, seed: int = 0) -> Path:
    """Create the tiny model under ``path`` unless it is already complete; return ``path``."""
    marker = path / ".complete"
    if marker.exists():
        return path
    # Heavy imports stay local: the gateway and projector never pay for them.
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,  # head size 64: the CPU attention kernels reject 16
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
        dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(path)
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id})
    )
    marker.write_text("tiny random Llama; its text is noise\n")
    return path
