"""The one place a conversation becomes token ids: the tokenizer's chat template.

Training data (the prompt part of every conversation) and decode requests are encoded by this same function, so the
drafter trains on byte-identical prompts to the ones it serves (DFlash conditions on the target's features of
exactly those tokens).
"""

from __future__ import annotations


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_plain(tokenizer, text: str) -> list[int]:
    """Token ids of a plain-text prompt, for a tokenizer without a chat template (a base model)."""
    return list(tokenizer(text)["input_ids"])


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                enable_thinking: bool = False) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template (``enable_thinking`` reaches templates
    that read it, e.g. Qwen3's)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        enable_thinking=enable_thinking)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
