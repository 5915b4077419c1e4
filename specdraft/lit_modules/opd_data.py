"""The opd stage's data: a stream of replay batches from rollouts of held-in prompts, refreshed with the current
drafter every ``train.opd.refresh_every`` optimizer steps (Draft-OPD, arXiv:2605.29343).

The prompt pool is the training conversations' prompts (their responses are not used: the rollout regenerates
them, target-assisted). Refresh cycle ``c`` rolls out the next ``buffer`` prompts of a per-seed shuffled stream, so an
offline run (``refresh_every=0``: one buffer rolled out by the starting drafter) sees exactly the prompts of the
on-policy run with the same step budget. A resumed run restarts at its cycle and rolls that cycle out again with the
weights it resumed (the only difference from an uninterrupted run).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch.utils.data import DataLoader, IterableDataset

from specdraft.lit_modules.data import ShareGPTDataModule
from specdraft.lit_modules.opd import OPDConfig, Rollout, collate_rollouts, rollout


def prompt_of(item: dict) -> list[int]:
    """A conversation's prompt: its tokens before the first supervised (assistant) token."""
    first = item["loss_mask"].index(1)
    return item["input_ids"][:first]


class RolloutStream(IterableDataset):
    """Replay batches (:func:`collate_rollouts`), ``batch_size`` rollouts each, for one data-parallel rank."""

    def __init__(self, prompts: list[list[int]], cfg: OPDConfig, batch_size: int, total_batches: int, seed: int,
                 rollout_fn: Callable[[list[list[int]], int], list[Rollout]], position_fn: Callable[[], int],
                 refresh_batches: int, max_rounds: int = 0, num_replicas: int = 1, rank: int = 0):
        self.prompts, self.cfg, self.batch_size, self.seed = prompts, cfg, batch_size, seed
        self.rollout_fn, self.position_fn = rollout_fn, position_fn
        self.refresh_batches = refresh_batches  # batches per refresh cycle (0 = offline)
        self.total_batches = total_batches
        self.max_rounds = max_rounds  # rounds replayed per rollout (0 = all)
        self.num_replicas, self.rank = num_replicas, rank

    @property
    def buffer(self) -> int:
        """Prompts this rank rolls out per cycle."""
        if self.refresh_batches == 0:
            return self.total_batches * self.batch_size
        return self.cfg.buffer_prompts or self.refresh_batches * self.batch_size

    def cycle_prompts(self, cycle: int) -> list[list[int]]:
        """This rank's prompts of refresh cycle ``cycle`` (the global buffer is dealt over the ranks)."""
        n, size = len(self.prompts), self.buffer * self.num_replicas
        perms: dict[int, list[int]] = {}
        out, start = [], cycle * size
        for i in range(start, start + size):
            epoch, j = divmod(i, n)
            if epoch not in perms:
                perms[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(
                    self.seed * 100_003 + epoch)).tolist()
            out.append(self.prompts[perms[epoch][j]])
        return out[self.rank::self.num_replicas]

    def __iter__(self):
        """Batches up to the run's last one (the loader's look-ahead must not start a rollout nobody trains on).
        Lightning fetches one batch ahead, so a refresh rolls out with the weights of one step before the cycle's
        first step; a resumed run rolls its current cycle out again (offline: the whole run) with the resumed
        weights."""
        if not self.prompts:
            raise ValueError("no rollout prompts: every training prompt leaves no room for the response")
        done = self.position_fn()
        per_cycle = self.refresh_batches or self.total_batches
        cycle, skip = divmod(done, per_cycle) if self.refresh_batches else (0, done)
        while cycle * per_cycle < self.total_batches:
            rollouts = self.rollout_fn(self.cycle_prompts(cycle), cycle)
            for i in range(skip, min(per_cycle, self.total_batches - cycle * per_cycle)):
                g = torch.Generator().manual_seed((self.seed * 1_000_003 + cycle) * 10_007 + i)
                yield collate_rollouts([rollouts[(i * self.batch_size + j) % len(rollouts)]
                                        for j in range(self.batch_size)], self.max_rounds, g)
            skip, cycle = 0, cycle + 1


def make_rollout_fn(module, cfg: OPDConfig, stop_token_ids: tuple[int, ...], seed: int):
    """``(prompts, cycle) -> rollouts`` with the module's current drafter (eval mode, no grad), recording
    ``module.opd_rollout_stats`` (the latest rollout's ``rollout_tau`` and cycle) and the time spent rolling out
    (:func:`rollout_share`); the opd step logs both as ``train/opd_*``."""
    spent = {"rollout_s": 0.0, "t0": None}
    module.opd_rollout_clock = spent

    def run(prompts: list[list[int]], cycle: int) -> list[Rollout]:
        if spent["t0"] is None:
            spent["t0"] = time.perf_counter()
        t0 = time.perf_counter()
        drafter = module.drafter
        was_training = drafter.training
        drafter.eval()
        dev = module.target.lm_head.weight.device
        g = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + cycle)
        try:
            rollouts, stats = rollout(module.target, drafter, prompts, cfg, stop_token_ids, g)
        finally:
            drafter.train(was_training)
        spent["rollout_s"] += time.perf_counter() - t0
        module.opd_rollout_stats = {"rollout_tau": stats["tau"], "rollout_cycle": float(cycle)}
        return rollouts

    return run


class RolloutDataModule(ShareGPTDataModule):
    """The ShareGPT data module whose training batches are replayed rollouts of its training prompts; validation is
    unchanged (held-in validation conversations). :meth:`attach` gives it the rollout function and the position."""

    def __init__(self, *args, opd: OPDConfig, total_steps: int, accumulate: int = 1, max_rounds: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.opd, self.total_steps, self.accumulate, self.max_rounds = opd, total_steps, accumulate, max_rounds
        self.rollout_fn = None
        self.batches_done: Callable[[], int] = lambda: 0
        self.too_long = 0

    def setup(self, stage: str | None = None) -> None:
        fresh = not self.train_items
        super().setup(stage)
        if fresh:
            room = self.max_seq_len - self.opd.max_new_tokens - 1
            self.prompts = [prompt_of(it) for it in self.train_items if len(prompt_of(it)) <= room]
            self.too_long = len(self.train_items) - len(self.prompts)

    def attach(self, rollout_fn, batches_done: Callable[[], int]) -> None:
        self.rollout_fn, self.batches_done = rollout_fn, batches_done

    def eval_prompts(self) -> list[list[int]]:
        """Held-in validation prompts for the rollout evaluation (``train.opd.eval_prompts`` of them)."""
        return [prompt_of(it) for it in self.val_items[: self.opd.eval_prompts]]

    def train_dataloader(self):
        ranks = self._ranks()
        stream = RolloutStream(self.prompts, self.opd, self.batch_size, self.total_steps * self.accumulate, self.seed,
                               self.rollout_fn, self.batches_done, self.opd.refresh_every * self.accumulate,
                               self.max_rounds, **ranks)
        return DataLoader(stream, batch_size=None)
