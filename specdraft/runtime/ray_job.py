"""``specdraft decode`` on a Ray cluster with Ray Data (the optional extra: ``pip install 'specdraft[ray]'``).

The driver does what a local job does before and after decoding: it reads the input (bad lines reported by line),
skips ids already in the output (resume), refuses requests that cannot be decoded (reported by id), and appends
each result row to the output as it streams back (the same JSONL contract). Decoding runs in a pool of
:class:`DecodeActor` s (``Dataset.map_batches`` with a callable class): each actor builds the job's
:class:`~specdraft.runtime.batch_job.Decoding` once, as the local job does (any method, backend, policy, engine and
batching), and decodes the request batches it is handed. Follow-up turns run as later passes, each turn once the one
before has its row. A killed job resumes from the rows written so far; nothing is written twice.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from specdraft.errors import SpecdraftError
from specdraft.runtime.batch_job import (
    Decoding,
    Request,
    ResultWriter,
    length_reasons,
    pending_requests,
    request_caps,
    result_row,
    run_turns,
    warn_stderr,
)
from specdraft.runtime.decode import RowResult


@dataclass
class ActorSpec:
    """What every actor needs to build its decoding (it travels to the workers: a picklable callable and data)."""

    build: Callable[[str], Decoding]
    """``device -> Decoding``: the job's models, engine, policy and batching, as the local job builds them."""
    device: str = "auto"
    """``auto``: a GPU per actor when the cluster has GPUs."""
    seed: int = 0
    with_verified: bool = False
    """Rows record the drafts verified per round (an adaptive policy's choices)."""


class DecodeActor:
    """One per Ray worker: the job's decoding, built once, decoding each request batch it is handed."""

    def __init__(self, spec: ActorSpec):
        self.spec = spec
        self.decoding = spec.build(spec.device)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        prompts = [list(map(int, ids)) for ids in batch["prompt_ids"]]
        self.decoding.generator.manual_seed(self.spec.seed + int(batch["index"][0]))  # whichever actor gets it
        results = self.decoding.decode(prompts, [int(c) for c in batch["max_new_tokens"]])
        return {"index": batch["index"],
                "tokens": _ragged([r.tokens for r in results]),
                "accept_lengths": _ragged([r.accept_lengths for r in results]),
                "verified": _ragged([r.verified for r in results]),
                "finish_reason": np.array([r.finish_reason for r in results]),
                "time_s": np.array([r.time_s for r in results])}


def _ragged(lists: list[list[int]]) -> np.ndarray:
    """A 1-D object array of lists (``np.array`` would make a 2-D array of equal-length lists)."""
    out = np.empty(len(lists), dtype=object)
    for i, x in enumerate(lists):
        out[i] = x
    return out


def run_ray_job(requests: list[Request], output: Path, tokenizer, spec: ActorSpec, actors: int,
                requests_per_task: int, max_new_tokens: int, context: int | None = None, enable_thinking: bool = False,
                address: str = "", progress=None, warn: Callable[[str], None] = warn_stderr) -> dict:
    """Decode ``requests`` on ``actors`` Ray actors (``address``: a running cluster, ``""`` starts a local one with
    a CPU per actor) in tasks of ``requests_per_task`` requests, appending each result row to ``output``;
    ``max_new_tokens`` caps requests that carry no cap of their own. Follow-up ``turns`` decode as a local job's do:
    each turn once the one before has its row, with the target's answers in its conversation."""
    try:
        import ray  # noqa: PLC0415
        import ray.data  # noqa: F401, PLC0415
    except ImportError:
        raise SpecdraftError("decode.runner=ray needs Ray Data: pip install 'specdraft[ray]'") from None
    cluster: dict = {}  # started on the first pass with work to do: its spec, and whether this job started it

    def ready() -> ActorSpec:
        if not cluster:
            cluster["started"] = not ray.is_initialized()
            if cluster["started"]:
                # "local": a new cluster on this machine, even where RAY_ADDRESS or `ray start` names another
                ray.init(address=address or "local", num_cpus=None if address else actors, include_dashboard=False,
                         log_to_driver=False, configure_logging=False)
            s = spec
            if s.device == "auto":
                s = dataclasses.replace(s, device="cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu")
            if s.device.startswith("cuda"):  # Ray gives each actor its own GPU as device 0
                s = dataclasses.replace(s, device="cuda")
            cluster["spec"] = s
        return cluster["spec"]

    job = (output, tokenizer, ready, actors, requests_per_task, max_new_tokens, context, enable_thinking, progress,
           warn, ray)
    try:
        return run_turns(requests, output, lambda todo: _ray_pass(todo, *job))
    finally:
        if cluster.get("started"):
            ray.shutdown()


def _ray_pass(requests, output, tokenizer, ready, actors, requests_per_task, max_new_tokens, context,
              enable_thinking, progress, warn, ray) -> dict:
    """One pass of :func:`run_ray_job` over ``requests`` (one turn of each): their stats, ``seconds`` set."""
    encoded, stats = pending_requests(requests, output, tokenizer, context, enable_thinking, warn)
    start = time.perf_counter()
    if not encoded:
        stats["seconds"] = 0.0
        return stats
    spec = ready()
    caps = request_caps(encoded, max_new_tokens, context)
    why = length_reasons(encoded, caps, max_new_tokens)
    writer = ResultWriter(output, requests_per_task)
    try:
        items = [{"index": i, "prompt_ids": ids, "max_new_tokens": cap} for i, ((_, ids), cap) in
                 enumerate(zip(encoded, caps))]
        gpu = spec.device.startswith("cuda")
        ds = ray.data.from_items(items).map_batches(
            DecodeActor, fn_constructor_kwargs={"spec": spec}, batch_size=requests_per_task,
            concurrency=min(actors, -(-len(items) // requests_per_task)),  # no actor loads models for nothing
            num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0, batch_format="numpy")
        for out in ds.iter_batches(batch_size=None, batch_format="numpy"):
            rows = []
            for i, toks, acc, verified, reason, secs in zip(out["index"], out["tokens"], out["accept_lengths"],
                                                            out["verified"], out["finish_reason"], out["time_s"]):
                res = RowResult(list(map(int, toks)), list(map(int, acc)), str(reason), float(secs),
                                verified=list(map(int, verified)))
                rows.append(result_row(encoded[int(i)][0], res, tokenizer, stats, spec.with_verified, why[int(i)]))
            writer.write(rows)
            if progress is not None:
                progress(len(rows), 0.0)
    finally:
        writer.close()
    stats["seconds"] = time.perf_counter() - start
    return stats
