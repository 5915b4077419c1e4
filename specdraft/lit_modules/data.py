"""DataModule over ShareGPT JSONL: the chat template applied exactly as at decode time, loss mask on assistant tokens.

Sequences longer than ``max_seq_len`` are truncated; ones with fewer than ``2 * block_size`` supervised tokens are
dropped (DFlash pitfall). Batches group similar lengths. The sampler is deterministic per (seed, epoch) and can skip
the batches an interrupted run already consumed, so a resumed run sees exactly the data it would have seen.
"""

from __future__ import annotations

import hashlib
import math

import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler

from specdraft.errors import SpecdraftError
from specdraft.runtime.chat import encode_chat, encode_plain, has_chat_template


def tokenize_conversation(tokenizer, messages: list[dict],
                          enable_thinking: bool = False) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)``; the prompt part is byte-identical to what ``decode`` feeds the target.

    Without a chat template (a base model) a single user/assistant turn is encoded as decode encodes a plain-text
    prompt, followed by the response and the end-of-sequence token; other conversations raise ``ValueError``."""
    if not has_chat_template(tokenizer):
        if [m["role"] for m in messages] != ["user", "assistant"]:
            raise ValueError("a tokenizer without a chat template can encode only one user turn and its response")
        prompt = encode_plain(tokenizer, messages[0]["content"])
        response = list(tokenizer(messages[1]["content"], add_special_tokens=False)["input_ids"])
        response += [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        return prompt + response, [0] * len(prompt) + [1] * len(response)

    def render(msgs, gen):
        return encode_chat(tokenizer, msgs, add_generation_prompt=gen, enable_thinking=enable_thinking)

    full = render(messages, False)
    mask = [0] * len(full)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(render(messages[:i], True))
        end = len(render(messages[: i + 1], False))
        for p in range(start, min(end, len(full))):
            mask[p] = 1
    return full, mask


def is_validation(conv_id: str, val_fraction: float) -> bool:
    h = int(hashlib.sha256(str(conv_id).encode()).hexdigest()[:8], 16)
    return (h % 10_000) < val_fraction * 10_000


class LengthGroupedSampler(Sampler[list[int]]):
    """Batches of similar lengths, shuffled per (seed, epoch), sharded over data-parallel ranks.

    The stream is one of GLOBAL batches of ``batch_size * num_replicas`` items, the same on every rank; rank ``r``
    takes items ``r, r + num_replicas, ...`` of each, so ``N`` processes at ``batch_size`` see exactly the batches one
    process sees at ``N * batch_size`` (a global batch too short to give every rank an item repeats its first items).

    ``position_fn(batches_per_epoch) -> (epoch, skip)``, read at every ``iter()``, places the stream: the trainer
    passes one derived from its optimizer step, so a resumed run continues exactly where the interrupted one stopped.
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int, shuffle: bool = True, position_fn=None,
                 num_replicas: int = 1, rank: int = 0):
        self.lengths, self.batch_size, self.seed, self.shuffle = lengths, batch_size, seed, shuffle
        self.position_fn = position_fn
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch, self.skip = 0, 0

    def _batches(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        n = len(self.lengths)
        size = self.batch_size * self.num_replicas  # the global batch
        order = torch.randperm(n, generator=g).tolist() if self.shuffle else list(range(n))
        mega = size * 16
        batches = []
        for i in range(0, len(order), mega):
            chunk = sorted(order[i:i + mega], key=lambda j: self.lengths[j])
            batches += [chunk[k:k + size] for k in range(0, len(chunk), size)]
        if self.shuffle:
            perm = torch.randperm(len(batches), generator=g).tolist()
            batches = [batches[p] for p in perm]
        if self.num_replicas == 1:
            return batches
        padded = [b + b[:self.num_replicas - len(b)] * self.num_replicas if len(b) < self.num_replicas else b
                  for b in batches]
        return [b[self.rank::self.num_replicas] for b in padded]

    def __iter__(self):
        if self.position_fn is not None:
            self.epoch, self.skip = self.position_fn(len(self))
        batches = self._batches()[self.skip:]
        self.skip = 0
        return iter(batches)

    def __len__(self) -> int:
        return math.ceil(len(self.lengths) / (self.batch_size * self.num_replicas))


def collate(items: list[dict]) -> dict:
    L_ = max(len(it["input_ids"]) for it in items)
    ids = torch.zeros(len(items), L_, dtype=torch.long)
    mask = torch.zeros(len(items), L_, dtype=torch.long)
    for i, it in enumerate(items):
        n = len(it["input_ids"])
        ids[i, :n] = torch.tensor(it["input_ids"])
        mask[i, :n] = torch.tensor(it["loss_mask"])
    return {"input_ids": ids, "loss_mask": mask, "lengths": torch.tensor([len(it["input_ids"]) for it in items]),
            "index": torch.tensor([it["index"] for it in items])}


class ShareGPTDataModule(L.LightningDataModule):
    def __init__(self, data_file: str, tokenizer, batch_size: int, max_seq_len: int, block_size: int, seed: int,
                 val_fraction: float = 0.05, enable_thinking: bool = False):
        super().__init__()
        self.data_file, self.tokenizer = data_file, tokenizer
        self.batch_size, self.max_seq_len, self.block_size = batch_size, max_seq_len, block_size
        self.seed, self.val_fraction, self.enable_thinking = seed, val_fraction, enable_thinking
        self.train_items: list[dict] = []
        self.val_items: list[dict] = []
        self.dropped = 0
        self.position_fn = None
        """Optional ``batches_per_epoch -> (epoch, skip)`` for the training sampler (set by the trainer glue)."""

    def setup(self, stage: str | None = None) -> None:
        if self.train_items:
            return
        from datasets import load_dataset  # noqa: PLC0415  (deferred: slow to import, and absent on the GPU image)

        ds = load_dataset("json", data_files=self.data_file, split="train")
        for row in ds:
            try:
                ids, mask = tokenize_conversation(self.tokenizer, row["conversations"], self.enable_thinking)
            except ValueError as e:
                raise SpecdraftError(f"conversation {row['id']!r} in {self.data_file}: {e}") from None
            ids, mask = ids[: self.max_seq_len], mask[: self.max_seq_len]
            if sum(mask) < 2 * self.block_size:
                self.dropped += 1
                continue
            item = {"input_ids": ids, "loss_mask": mask, "id": row["id"]}
            (self.val_items if is_validation(row["id"], self.val_fraction) else self.train_items).append(item)
        if not self.val_items and len(self.train_items) > 1:
            self.val_items.append(self.train_items.pop())
        for i, it in enumerate(self.train_items):
            it["index"] = i
        for i, it in enumerate(self.val_items):
            it["index"] = i
        if not self.train_items:
            raise SpecdraftError(f"no usable training conversations in {self.data_file} (need >= "
                                 f"{2 * self.block_size} assistant tokens each)")

    def _ranks(self) -> dict:
        """This process's share of the data (the trainer's world size and rank; one process without a trainer)."""
        trainer = getattr(self, "trainer", None)
        return {"num_replicas": trainer.world_size, "rank": trainer.global_rank} if trainer is not None else {}

    def train_dataloader(self):
        sampler = LengthGroupedSampler([len(it["input_ids"]) for it in self.train_items], self.batch_size, self.seed,
                                       position_fn=self.position_fn, **self._ranks())
        return DataLoader(self.train_items, batch_sampler=sampler, collate_fn=collate)

    def val_dataloader(self):
        sampler = LengthGroupedSampler([len(it["input_ids"]) for it in self.val_items], self.batch_size, self.seed,
                                       shuffle=False, **self._ranks())
        return DataLoader(self.val_items, batch_sampler=sampler, collate_fn=collate)
