"""ONNX Runtime backend: the exported graphs (:mod:`specdraft.export.onnx`) behind the engine's interfaces.

:class:`OnnxDrafter` implements the :class:`~specdraft.runtime.drafter.Drafter` protocol with the ``drafter_ingest``
and ``drafter_draft`` sessions; :class:`OnnxTarget` is called like :class:`~specdraft.runtime.models.target.TargetLM`
with the ``target_verify`` session. Both keep their caches as torch tensors (``[L, B, H_kv, S, Dh]``, one per K and
V) and append the K/V each graph returns, so :func:`~specdraft.runtime.decode.generate` runs unchanged: the CPU
provider here, the CUDA provider where ``onnxruntime-gpu`` is installed.

:func:`load_manifest` checks an export before any session is built: format, graph files and their hashes, and
(when given) the drafter and target it must have been exported from; a mismatch is one clear line.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import onnxruntime as ort
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdraft.errors import SpecdraftError
from specdraft.runtime.kv_cache import KVCache
from specdraft.runtime.models.target import TargetOutput

MANIFEST = "manifest.json"
FORMAT = "specdraft-onnx"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_manifest(export_dir: str | Path, drafter_sha256: str | None = None, target_sha256: str | None = None,
                  target_fingerprint: str | None = None, check_files: bool = True) -> dict:
    """Read and check an export's manifest; raises :class:`SpecdraftError` with one line naming the problem."""
    d = Path(export_dir)
    path = d / MANIFEST
    if not path.is_file():
        raise SpecdraftError(f"{d} is not an ONNX export: no {MANIFEST} (run specdraft export CONFIG --to onnx)")
    try:
        m = json.loads(path.read_text())
    except ValueError as e:
        raise SpecdraftError(f"{path} is corrupt: {e}") from None
    if m.get("format") != FORMAT:
        raise SpecdraftError(f"{path}: format {m.get('format')!r} is not {FORMAT!r}")
    if check_files:
        for kind, g in m["graphs"].items():
            f = d / g["file"]
            if not f.is_file():
                raise SpecdraftError(f"{d}: graph {kind} ({g['file']}) is missing")
            if sha256_file(f) != g["sha256"]:
                raise SpecdraftError(f"{f} does not match its manifest hash: the file was changed after export")
    if drafter_sha256 is not None and m["drafter"]["weights_sha256"] != drafter_sha256:
        raise SpecdraftError(f"{d} was exported from another drafter (weights sha256 "
                             f"{m['drafter']['weights_sha256'][:12]}, this drafter {drafter_sha256[:12]}): re-export")
    if target_sha256 is not None and m["target"]["weights_sha256"] != target_sha256:
        raise SpecdraftError(f"{d} was exported for another target (weights sha256 "
                             f"{m['target']['weights_sha256'][:12]}, this target {target_sha256[:12]}): re-export")
    if target_fingerprint and m["target"].get("fingerprint") and m["target"]["fingerprint"] != target_fingerprint:
        raise SpecdraftError(f"{d} was exported for another target checkpoint (fingerprint "
                             f"{m['target']['fingerprint']}, configured {target_fingerprint}): re-export")
    return m


def sha256_file(path: Path) -> str:
    """The hash an export's manifest records for each file."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _session(path: Path, providers: list[str] | None):
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), opts, providers=providers or ["CPUExecutionProvider"])


class StackedKVCache(KVCache):
    """A :class:`KVCache` whose layers are views of one ``[L, B, H_kv, S, Dh]`` tensor per K and V, the layout the
    graphs take as input."""

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.K = torch.zeros(shape, dtype=dtype, device=device)
        self.V = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len
        self.fixed_shape = False

    @property
    def k(self) -> list[torch.Tensor]:
        return list(self.K.unbind(0))

    @property
    def v(self) -> list[torch.Tensor]:
        return list(self.V.unbind(0))

    def used(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots any row uses, ``[L, B, H_kv, max(lengths), Dh]`` each, contiguous (graph inputs)."""
        used = int(self.lengths.max()) if self.batch_size else 0
        return self.K[:, :, :, :used].contiguous(), self.V[:, :, :, :used].contiguous()

    def append(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write a graph's new K/V ``[L, B, H_kv, T, Dh]`` at per-row ``slots`` ``[B, T]`` of every layer."""
        rows = torch.arange(slots.shape[0], device=slots.device)[:, None]  # [B, 1]
        self.K[:, rows, :, slots] = k.permute(1, 3, 0, 2, 4).to(self.K.dtype)  # [B, T, L, H_kv, Dh]
        self.V[:, rows, :, slots] = v.permute(1, 3, 0, 2, 4).to(self.V.dtype)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.K, self.V = self.K.index_select(1, rows), self.V.index_select(1, rows)
        self.lengths = self.lengths.index_select(0, rows)


class _Graph:
    """One ORT session called with torch tensors (converted to the export's dtype) -> torch tensors."""

    def __init__(self, path: Path, providers, dtype: torch.dtype):
        self.session = _session(path, providers)
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.dtype = dtype

    def __call__(self, **feeds: torch.Tensor) -> dict[str, torch.Tensor]:
        arrays = {}
        for name in self.inputs:
            t = feeds[name].detach().cpu()
            if t.is_floating_point():
                t = t.to(self.dtype)
            arrays[name] = t.contiguous().numpy()
        return {n: torch.from_numpy(a) for n, a in zip(self.outputs, self.session.run(self.outputs, arrays))}


class OnnxTarget:
    """The target as the ``target_verify`` graph (called like ``TargetLM``; the feature layers are the export's)."""

    def __init__(self, export_dir: str | Path, providers: list[str] | None = None, manifest: dict | None = None):
        d = Path(export_dir)
        self.manifest = m = manifest or load_manifest(d)
        t = m["target"]
        self.dtype = _DTYPES[m["dtype"]]
        self.verify = _Graph(d / m["graphs"]["target_verify"]["file"], providers, self.dtype)
        self.feature_layers = tuple(m["drafter"]["target_layer_ids"])
        self.args = SimpleNamespace(vocab_size=t["vocab_size"], hidden_size=t["hidden_size"],
                                    num_hidden_layers=t["num_layers"], num_key_value_heads=t["num_kv_heads"],
                                    head_dim=t["head_dim"], model_type=t["model_type"], max_position_embeddings=None)
        self.lm_head = SimpleNamespace(weight=torch.empty(0, dtype=self.dtype))  # where the engine puts its tensors

    def new_cache(self, batch_size: int, max_len: int) -> StackedKVCache:
        a = self.args
        return StackedKVCache(a.num_hidden_layers, batch_size, a.num_key_value_heads, max_len, a.head_dim, self.dtype)

    def __call__(self, tokens: torch.Tensor, cache: StackedKVCache | None = None, positions: torch.Tensor | None = None,
                 new_mask: torch.Tensor | None = None, feature_layers: tuple[int, ...] = (),
                 logits_at: torch.Tensor | None = None, return_logits: bool = True,
                 visible_prefix: torch.Tensor | None = None) -> TargetOutput:
        if visible_prefix is not None or not return_logits:
            raise ValueError("the ONNX target serves decoding only (no visible_prefix, logits always)")
        if feature_layers and tuple(feature_layers) != self.feature_layers:
            raise ValueError(f"the export returns target layers {self.feature_layers}, not {tuple(feature_layers)}")
        B, T = tokens.shape
        cache = cache if cache is not None else self.new_cache(B, T)
        cache.check_room(T)
        offsets = cache.lengths
        positions = offsets[:, None] + torch.arange(T) if positions is None else positions
        if new_mask is None:
            new_mask = torch.ones(T, T, dtype=torch.bool).tril()
        new_mask = new_mask.expand(B, T, T) if new_mask.dim() == 2 else new_mask
        cache_k, cache_v = cache.used()
        out = self.verify(tokens=tokens, positions=positions, new_mask=new_mask, cache_k=cache_k, cache_v=cache_v,
                          lengths=offsets)
        cache.append(out["k"], out["v"], offsets[:, None] + torch.arange(T))
        logits = out["logits"]  # [B, T, V]
        if logits_at is not None:
            logits = logits.gather(1, logits_at[..., None].expand(-1, -1, logits.shape[-1]))
        return TargetOutput(logits=logits, features=out["features"] if feature_layers else None)


class OnnxDrafter:
    """A block drafter as the ``drafter_ingest`` and ``drafter_draft`` graphs (the Drafter protocol)."""

    wants_verify_context = False

    def __init__(self, export_dir: str | Path, providers: list[str] | None = None, manifest: dict | None = None):
        d = Path(export_dir)
        self.manifest = m = manifest or load_manifest(d)
        self.dtype = _DTYPES[m["dtype"]]
        self.ingest_graph = _Graph(d / m["graphs"]["drafter_ingest"]["file"], providers, self.dtype)
        self.draft_graph = _Graph(d / m["graphs"]["drafter_draft"]["file"], providers, self.dtype)
        self.embed_weight = load_file(str(d / "embed_tokens.safetensors"))["weight"].to(self.dtype)
        dm = m["drafter"]
        self.config = SimpleNamespace(mask_token_id=dm["mask_token_id"], block_size=dm["block_size"],
                                      num_hidden_layers=dm["num_layers"], num_key_value_heads=dm["num_kv_heads"],
                                      head_dim=dm["head_dim"], hidden_size=dm["hidden_size"],
                                      target_layer_ids=dm["target_layer_ids"])
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.config.target_layer_ids)

    def new_cache(self, batch_size: int, max_len: int) -> StackedKVCache:
        c = self.config
        return StackedKVCache(c.num_hidden_layers, batch_size, c.num_key_value_heads, max_len, c.head_dim, self.dtype)

    def ingest(self, cache: StackedKVCache, ctx_features: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        B, T, _ = ctx_features.shape
        cache.check_room(T)
        T_kv = min(T, int(counts.max()))
        slots = cache.lengths[:, None] + torch.arange(T_kv)  # [B, T_kv]
        out = self.ingest_graph(features=ctx_features[:, :T_kv], positions=slots)
        cache.append(out["k"], out["v"], slots)
        cache.lengths = cache.lengths + counts
        return out["fused"]

    def block_embeds(self, block_tokens: torch.Tensor, state=None) -> torch.Tensor:
        return F.embedding(block_tokens, self.embed_weight)  # [b, Bk, D]

    def _draft(self, cache: StackedKVCache, embeds: torch.Tensor, positions: torch.Tensor,
               new_mask: torch.Tensor) -> torch.Tensor:
        cache_k, cache_v = cache.used()
        out = self.draft_graph(block_embeds=embeds, positions=positions, new_mask=new_mask, cache_k=cache_k,
                               cache_v=cache_v, lengths=cache.lengths)
        self._last = (out["hidden"], out["logits"])
        return out["hidden"]

    def draft_hidden(self, cache: StackedKVCache, block_embeds: torch.Tensor) -> torch.Tensor:
        B, Bk, _ = block_embeds.shape
        positions = cache.lengths[:, None] + torch.arange(Bk)
        return self._draft(cache, block_embeds, positions, torch.ones(B, Bk, Bk, dtype=torch.bool))

    def draft_branches(self, cache: StackedKVCache, block_embeds: torch.Tensor) -> torch.Tensor:
        b, J, Bk, D = block_embeds.shape
        positions = (cache.lengths[:, None] + torch.arange(Bk)).repeat(1, J)  # [b, J * Bk]
        block_id = torch.arange(J).repeat_interleave(Bk)
        mask = (block_id[:, None] == block_id[None, :]).expand(b, J * Bk, J * Bk)
        hidden = self._draft(cache, block_embeds.reshape(b, J * Bk, D), positions, mask)
        self._last = (hidden.view(b, J, Bk, D), self._last[1].view(b, J, Bk, -1))
        return self._last[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft graph's logits for ``hidden``, a slice of the last draft pass's hidden states (the graph ran
        the LM head already; slices along the slot dimension are what the engine asks for)."""
        if self._last is None or hidden.untyped_storage().data_ptr() != self._last[0].untyped_storage().data_ptr():
            raise ValueError("the ONNX drafter returns logits of its last draft pass only")
        last_hidden, last_logits = self._last
        slot_stride = last_hidden.stride(-2)
        start = (hidden.storage_offset() - last_hidden.storage_offset()) // slot_stride
        if hidden.shape[:-2] != last_hidden.shape[:-2] or hidden.stride() != last_hidden.stride():
            raise ValueError("the ONNX drafter returns logits for slot ranges of its last draft pass only")
        return last_logits[..., start:start + hidden.shape[-2], :]

    def next_round_state(self, state, hidden, draft_tokens, num_accepted, target_logits, target_context):
        return None
