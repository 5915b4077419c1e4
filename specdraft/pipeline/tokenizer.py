"""Byte-level BPE tokenizer for the embedded world, saved as a transformers tokenizer with a chat template.

Special tokens: ``<|endoftext|>`` (pad / document end), ``<|im_start|>``, ``<|im_end|>`` (end of turn, the stop
token) and ``<|MASK|>`` (the drafters' mask token, never produced by the corpora).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import jinja2
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]

# Qwen-style ChatML. ``enable_thinking`` is accepted (and ignored: the tiny world has no reasoning traces).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


_TEMPLATE = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 mask_token="<|MASK|>", additional_special_tokens=["<|im_start|>"])
    hf.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    return hf


def format_chat(prompt: str, response: str | None = None) -> str:
    """The text :data:`CHAT_TEMPLATE` renders for one user turn (plus the assistant turn when given), rendered by
    jinja2 as transformers renders chat templates (the world's corpus is written before its tokenizer exists)."""
    messages = [{"role": "user", "content": prompt}]
    if response is not None:
        messages.append({"role": "assistant", "content": response})
    return _TEMPLATE.render(messages=messages, add_generation_prompt=response is None)


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """End-of-turn and end-of-text ids that end a generation."""
    ids = {tokenizer.eos_token_id}
    for t in ("<|im_end|>", "<|endoftext|>"):
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and i != tokenizer.unk_token_id:
            ids.add(i)
    return tuple(sorted(i for i in ids if i is not None))
