"""A stub block drafter with the DFlash interface whose drafts are the target's own greedy continuation, corrupted
at chosen slots. It pins accept-all (no corruption), accept-none (slot 1 corrupted) and partial acceptance, and
tracks the committed text through the engine's calls exactly as a real drafter's context cache would."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch


class _StubCache:
    def __init__(self, batch: int):
        self.history: list[list[int]] = [[] for _ in range(batch)]
        self.pending: list[list[int]] = [[] for _ in range(batch)]  # anchor + drafts of the last round
        self.first = True

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        self.history = [self.history[i] for i in keep]
        self.pending = [self.pending[i] for i in keep]


class OracleStubDrafter:
    """``corrupt(round_idx, row) -> slot or None``: which draft slot (1-based) to replace with a wrong token."""

    def __init__(self, target, prompts, block_size: int, corrupt, vocab: int):
        self.target, self.prompts, self.block_size = target, prompts, block_size
        self.corrupt, self.vocab = corrupt, vocab
        self.config = SimpleNamespace(mask_token_id=vocab - 1)
        self.target_layer_ids = (0,)
        self.round = 0
        self.rows: list[int] = list(range(len(prompts)))

    def new_cache(self, batch, max_len):
        self.rows = list(range(batch))
        cache = _StubCache(batch)
        for i, p in enumerate(self.prompts):
            cache.history[i] = list(p)
        self._cache = cache
        return cache

    def ingest(self, cache, ctx_features, counts):
        if cache.first:  # prefill: the prompt is already in history
            cache.first = False
            return
        for i, c in enumerate(counts.tolist()):
            cache.history[i].extend(cache.pending[i][:c])

    def embed(self, block):
        self._anchors = block[:, 0].tolist()
        return torch.zeros(block.shape[0], block.shape[1], 1)

    def block_embeds(self, block, state):
        return self.embed(block)

    def next_round_state(self, *args):
        return None

    @torch.no_grad()
    def draft_hidden(self, cache, block_embeds):
        K = self.block_size - 1
        drafts = []
        for i, anchor in enumerate(self._anchors):
            ctx = cache.history[i] + [anchor]
            cont = []
            for _ in range(K):  # the target's greedy continuation (recomputed from scratch: slow but obviously right)
                logits = self.target(torch.tensor([ctx + cont])).logits[0, -1]
                cont.append(int(logits.argmax()))
            slot = self.corrupt(self.round, i)
            if slot is not None:
                cont[slot - 1] = (cont[slot - 1] + 1) % (self.vocab - 1)
            drafts.append(cont)
            cache.pending[i] = [anchor] + cont
        self.round += 1
        return torch.tensor([[a] + d for a, d in zip(self._anchors, drafts)])  # [b, Bk] "hidden" = tokens

    def logits(self, drafts):
        return torch.nn.functional.one_hot(drafts, self.target.args.vocab_size).float() * 30.0


def random_corruption(seed: int, p_clean: float = 0.3):
    rng = random.Random(seed)

    def corrupt(round_idx, row):
        return None if rng.random() < p_clean else rng.randint(1, 3)

    return corrupt
