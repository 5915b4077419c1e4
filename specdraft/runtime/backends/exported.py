"""Engine backends' shared half: an exported target and drafter behind the engine's interfaces, whatever runs the
graphs (ONNX Runtime in :mod:`.onnx`, TensorRT in :mod:`.tensorrt`).

:class:`ExportedDrafter` implements the :class:`~specdraft.runtime.drafter.Drafter` protocol with the
``drafter_ingest`` and ``drafter_draft`` graphs; :class:`ExportedTarget` is called like
:class:`~specdraft.runtime.models.target.TargetLM` with the ``target_verify`` graph. Both keep their caches as torch
tensors (``[L, B, H_kv, S, Dh]``, one per K and V) and append the K/V each graph returns, so
:func:`~specdraft.runtime.decode.generate` runs unchanged. A graph is any callable ``(**inputs) -> {output: tensor}``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from specdraft.runtime.kv_cache import KVCache
from specdraft.runtime.models.registry import HF_ARCHITECTURES
from specdraft.runtime.models.retrace import N_SCALARS, Prior, build_prior, verify_stats
from specdraft.runtime.models.target import TargetOutput

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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

    def check_room(self, new_tokens: int) -> None:
        need = int(self.lengths.max()) + new_tokens if self.batch_size else 0
        if need > self.max_len:
            raise ValueError(f"KV cache overflow: need {need} slots, have {self.max_len}")

    def reserve(self, rows: int) -> None:
        """Nothing to do: the stacked buffers are reallocated on admission (:meth:`cat_rows`)."""

    def cat_rows(self, other: "StackedKVCache") -> None:
        """Append ``other``'s rows (requests admitted by continuous batching; either may hold fewer slots, e.g. one
        for rows whose drafter ingest an adaptive policy deferred: the shorter is padded with empty slots)."""
        S = max(self.K.shape[3], other.K.shape[3])

        def slots(x: torch.Tensor) -> torch.Tensor:  # [L, B, H_kv, S, Dh]
            return x if x.shape[3] == S else torch.nn.functional.pad(x, (0, 0, 0, S - x.shape[3]))
        self.K = torch.cat([slots(self.K), slots(other.K)], 1)
        self.V = torch.cat([slots(self.V), slots(other.V)], 1)
        self.lengths = torch.cat([self.lengths, other.lengths])
        self.max_len = S


class ExportedTarget:
    """The target as an exported ``target_verify`` graph (called like ``TargetLM``; the feature layers are the
    export's). ``open_graph(kind)`` returns a callable ``(**inputs) -> {output: tensor}`` for a graph of the export."""

    def __init__(self, manifest: dict, open_graph, device: torch.device | str = "cpu"):
        self.manifest = m = manifest
        t = m["target"]
        self.dtype = DTYPES[m["dtype"]]
        self.device = torch.device(device)
        self.verify = open_graph("target_verify")
        self.feature_layers = tuple(m["drafter"]["target_layer_ids"])
        self.args = SimpleNamespace(vocab_size=t["vocab_size"], hidden_size=t["hidden_size"],
                                    num_hidden_layers=t["num_layers"], num_key_value_heads=t["num_kv_heads"],
                                    head_dim=t["head_dim"], model_type=t["model_type"], max_position_embeddings=None)
        self.lm_head = SimpleNamespace(weight=torch.empty(0, dtype=self.dtype, device=self.device))  # engine device

    def new_cache(self, batch_size: int, max_len: int) -> StackedKVCache:
        a = self.args
        return StackedKVCache(a.num_hidden_layers, batch_size, a.num_key_value_heads, max_len, a.head_dim, self.dtype,
                              self.device)

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
        steps = torch.arange(T, device=self.device)
        positions = offsets[:, None] + steps if positions is None else positions
        if new_mask is None:
            new_mask = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
        new_mask = new_mask.expand(B, T, T) if new_mask.dim() == 2 else new_mask
        cache_k, cache_v = cache.used()
        out = self.verify(tokens=tokens, positions=positions, new_mask=new_mask, cache_k=cache_k, cache_v=cache_v,
                          lengths=offsets)
        cache.append(out["k"], out["v"], offsets[:, None] + steps)
        logits = out["logits"]  # [B, T, V]
        if logits_at is not None:
            logits = logits.gather(1, logits_at[..., None].expand(-1, -1, logits.shape[-1]))
        return TargetOutput(logits=logits, features=out["features"] if feature_layers else None)


class ExportedDrafter:
    """A block drafter as exported ``drafter_ingest`` and ``drafter_draft`` graphs (the Drafter protocol);
    ``embed_weight`` is the target's input embedding the export saved. A ReTrace export carries its cross-round
    state (the prior) into ``drafter_draft`` and builds the next one here, from the draft and verify outputs, with
    the same functions as the torch drafter (:func:`~specdraft.runtime.models.retrace.build_prior`)."""

    def __init__(self, manifest: dict, open_graph, embed_weight: torch.Tensor, device: torch.device | str = "cpu"):
        self.manifest = m = manifest
        self.arch_name = HF_ARCHITECTURES.get(m["drafter"]["arch"], m["drafter"]["arch"])  # as a torch drafter's
        self.dtype = DTYPES[m["dtype"]]
        self.device = torch.device(device)
        self.ingest_graph = open_graph("drafter_ingest")
        self.draft_graph = open_graph("drafter_draft")
        self.embed_weight = embed_weight.to(self.device, self.dtype)
        self.retrace = m["drafter"].get("retrace")
        self.wants_verify_context = self.retrace is not None  # the prior reads the verify pass's fused context
        self._prior: Prior | None = None
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
        return StackedKVCache(c.num_hidden_layers, batch_size, c.num_key_value_heads, max_len, c.head_dim, self.dtype,
                              self.device)

    def ingest(self, cache: StackedKVCache, ctx_features: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        B, T, _ = ctx_features.shape
        cache.check_room(T)
        T_kv = T if self.wants_verify_context else min(T, int(counts.max()))  # rows past counts land in scratch
        slots = cache.lengths[:, None] + torch.arange(T_kv, device=self.device)  # [B, T_kv]
        out = self.ingest_graph(features=ctx_features[:, :T_kv], positions=slots)
        cache.append(out["k"], out["v"], slots)
        cache.lengths = cache.lengths + counts
        return out["fused"]

    def block_embeds(self, block_tokens: torch.Tensor, state=None) -> torch.Tensor:
        """Embeddings ``[b, Bk, D]``; a ReTrace prior is fused inside ``drafter_draft`` (kept for that call)."""
        self._prior = state
        return F.embedding(block_tokens, self.embed_weight)

    def _prior_inputs(self, B: int, Q: int) -> dict[str, torch.Tensor]:
        if self.retrace is None:
            return {}
        p = self._prior
        if p is None:  # no retained suffix: nothing lands, the fusion adds nothing
            D = self.config.hidden_size
            Hd = 2 * D if self.retrace["embed_drafted"] else D
            z = torch.zeros(B, Q, device=self.device)
            p = Prior(z[..., None].expand(B, Q, Hd), z[..., None].expand(B, Q, 2 * D + N_SCALARS), z.bool(),
                      torch.ones(B, dtype=torch.long, device=self.device))
        if p.valid.shape != (B, Q):
            raise ValueError(f"a ReTrace prior of {tuple(p.valid.shape)} slots does not fit a block of {(B, Q)}")
        return {"prior_hidden": p.hidden, "prior_signals": p.signals, "prior_valid": p.valid, "prior_shift": p.shift}

    def _draft(self, cache: StackedKVCache, embeds: torch.Tensor, positions: torch.Tensor,
               new_mask: torch.Tensor) -> torch.Tensor:
        cache_k, cache_v = cache.used()
        out = self.draft_graph(block_embeds=embeds, positions=positions, new_mask=new_mask, cache_k=cache_k,
                               cache_v=cache_v, lengths=cache.lengths, **self._prior_inputs(*embeds.shape[:2]))
        self._last = (out["hidden"], out["logits"])
        return out["hidden"]

    def draft_hidden(self, cache: StackedKVCache, block_embeds: torch.Tensor) -> torch.Tensor:
        B, Bk, _ = block_embeds.shape
        positions = cache.lengths[:, None] + torch.arange(Bk, device=self.device)
        return self._draft(cache, block_embeds, positions, torch.ones(B, Bk, Bk, dtype=torch.bool, device=self.device))

    def draft_branches(self, cache: StackedKVCache, block_embeds: torch.Tensor) -> torch.Tensor:
        b, J, Bk, D = block_embeds.shape
        positions = (cache.lengths[:, None] + torch.arange(Bk, device=self.device)).repeat(1, J)  # [b, J * Bk]
        block_id = torch.arange(J, device=self.device).repeat_interleave(Bk)
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
        if self.retrace is None:
            return None
        stats = verify_stats(target_logits.to(self.device), draft_tokens)
        return build_prior(hidden, draft_tokens, num_accepted, stats, target_context,
                           lambda t: F.embedding(t, self.embed_weight), self.retrace["embed_drafted"])
