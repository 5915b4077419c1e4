"""Target features for drafter training: online (frozen target inside the step) or offline (precomputed shards).

Both run the SAME runtime forward (``TargetLM``), so training and serving features cannot drift apart. Offline
caches hold, per sequence, the concatenated outputs of the chosen layers (bf16) and the target's greedy next
tokens, in sharded safetensors files with a ``manifest.json`` naming the target and the layer set; a cache built
for another target or layer set is refused.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdraft.errors import SpecdraftError
from specdraft.runtime.load import target_fingerprint
from specdraft.runtime.models.target import TargetLM

SHARD_SIZE = 256


POSITION_CHUNK = 256


@torch.no_grad()
def online_features(target: TargetLM, input_ids: torch.Tensor, layer_ids: tuple[int, ...], cache=None):
    """``(features [B, S, F], final-normed hidden [B, S, D], greedy next tokens [B, S])``.

    The LM head runs in position chunks for the greedy tokens; logits are materialised later only at the positions
    a loss needs (see ``DrafterModule.target_view``). With a ``cache`` (a fresh :class:`KVCache`) the sequence's K/V
    are kept and committed, so verify passes can be replayed against it (ReTrace's exact correction signals).
    The target runs in its own dtype, outside a training step's autocast: the same features as the offline cache's.
    """
    with torch.autocast(input_ids.device.type, enabled=False):
        out = target(input_ids, cache=cache, feature_layers=layer_ids, return_logits=False)
        if cache is not None:
            cache.crop(torch.full_like(cache.lengths, input_ids.shape[1]))
        greedy = torch.cat([target.lm_head(out.hidden[:, i:i + POSITION_CHUNK]).argmax(-1)
                            for i in range(0, out.hidden.shape[1], POSITION_CHUNK)], dim=1)
    return out.features, out.hidden, greedy


def build_offline_cache(target: TargetLM, target_dir: str | Path, items: dict[str, list[dict]],
                        layer_ids: tuple[int, ...], out_dir: str | Path, batch_size: int = 8,
                        wait_s: float = 6 * 3600) -> Path:
    """Precompute features for every split's items (``{"train": [...], "val": [...]}``) into ``out_dir``.

    One cache for all data-parallel processes: only global rank 0 (``RANK``, as torchrun and Lightning set it)
    builds it; the other ranks wait up to ``wait_s`` for its manifest (written last) and then read the same files
    (``out_dir`` must be on a file system every node sees)."""
    out = Path(out_dir)
    manifest_file = out / "manifest.json"
    manifest = {"target": target_fingerprint(target_dir), "layer_ids": list(layer_ids),
                "splits": {k: len(v) for k, v in items.items()}, "shard_size": SHARD_SIZE, "dtype": "bfloat16",
                "last_layer": LAST_LAYER_CONVENTION if target.args.num_hidden_layers - 1 in layer_ids else None}
    rank = _global_rank()
    if rank != 0:
        deadline = time.monotonic() + wait_s
        while not manifest_file.is_file():
            if time.monotonic() > deadline:
                raise SpecdraftError(f"rank {rank}: no offline feature cache in {out} after {wait_s:.0f}s (rank 0 "
                                     f"builds it; is {out} on a shared file system?)")
            time.sleep(1.0)
    if manifest_file.is_file():
        check_manifest(json.loads(manifest_file.read_text()), manifest, out)
        return out
    out.mkdir(parents=True, exist_ok=True)
    dev = target.lm_head.weight.device
    for split, rows in items.items():
        for s0 in range(0, len(rows), SHARD_SIZE):
            shard = {}
            for b0 in range(s0, min(s0 + SHARD_SIZE, len(rows)), batch_size):
                batch = rows[b0:min(b0 + batch_size, s0 + SHARD_SIZE, len(rows))]
                L = max(len(r["input_ids"]) for r in batch)
                ids = torch.zeros(len(batch), L, dtype=torch.long)
                for i, r in enumerate(batch):
                    ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
                feats, _, greedy = online_features(target, ids.to(dev), layer_ids)
                for i, r in enumerate(batch):
                    n = len(r["input_ids"])
                    shard[f"{r['index']}.features"] = feats[i, :n].to(torch.bfloat16).cpu().contiguous()
                    shard[f"{r['index']}.greedy"] = greedy[i, :n].to(torch.int32).cpu().contiguous()
            save_file(shard, str(out / f"{split}-{s0 // SHARD_SIZE:05d}.safetensors"))
    tmp = manifest_file.with_name(manifest_file.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(manifest_file)  # atomic: a waiting rank never reads half a manifest
    return out


def _global_rank() -> int:
    """This process's global rank as torchrun, Lightning or SLURM set it (0 in one process)."""
    for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


LAST_LAYER_CONVENTION = "post_norm"
"""What a feature of the target's last layer holds (transformers' ``hidden_states[N]``), recorded when the layer ids
include it; caches built before the key existed held the raw layer output there and are refused."""


def check_manifest(found: dict, expected: dict, where: Path) -> None:
    for key in ("target", "layer_ids", "splits", "last_layer"):
        if found.get(key) != expected.get(key):
            raise SpecdraftError(f"offline feature cache {where} was built for {key}={found.get(key)!r}, not "
                                 f"{expected.get(key)!r}; delete it or point train.features at online")


class OfflineFeatures:
    """Reads precomputed features by (split, index); shards are loaded on first use and kept (random batches)."""

    def __init__(self, cache_dir: str | Path):
        self.dir = Path(cache_dir)
        self.manifest = json.loads((self.dir / "manifest.json").read_text())
        self._loaded: dict[tuple[str, int], dict] = {}

    def _shard(self, split: str, index: int) -> dict:
        key = (split, index // self.manifest["shard_size"])
        if key not in self._loaded:
            self._loaded[key] = load_file(str(self.dir / f"{split}-{key[1]:05d}.safetensors"))
        return self._loaded[key]

    def batch(self, split: str, indices: list[int], seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        feats, greedy = [], []
        for i in indices:
            shard = self._shard(split, i)
            f, g = shard[f"{i}.features"], shard[f"{i}.greedy"]
            pad = seq_len - f.shape[0]
            feats.append(torch.nn.functional.pad(f, (0, 0, 0, pad)))
            greedy.append(torch.nn.functional.pad(g, (0, pad)))
        return torch.stack(feats).to(device), torch.stack(greedy).long().to(device)
