"""Batch inference jobs over JSONL (the ``specdraft decode`` contract).

Input: one object per line with ``id``, either ``prompt`` (text) or ``messages`` (chat list), and optionally
``max_new_tokens`` and ``turns`` (follow-up user turns), or a file in one of the suite formats of
:mod:`specdraft.runtime.suites` (MT-Bench, Spec-Bench, HumanEval, GSM8K, MATH-500, Alpaca). Output: one object per
request and turn with ``id, completion, num_tokens, finish_reason, accept_lengths, tau, time_s`` (and ``turn`` for the
turns after the first: each is decoded after the one before, with the target's answers in its conversation).
Malformed lines are reported with their line numbers and skipped; valid ones are always processed. Results are
appended as whole lines (per request under continuous batching, per batch under static batching), so an interrupted
job resumes where it stopped (ids already in the output are skipped; no duplicates, no losses).
Under ``torchrun`` the input is sharded by rank and each rank writes ``<output>.rank<R>``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specdraft.errors import SpecdraftError
from specdraft.runtime import suites
from specdraft.runtime.chat import encode_chat, encode_plain, has_chat_template
from specdraft.runtime.decode import GenerationConfig, RowResult, generate


@dataclass
class Request:
    id: str
    messages: list[dict]
    line: int
    prompt: str | None = None
    """The plain text of a ``prompt`` request (None for ``messages``)."""
    max_new_tokens: int | None = None
    """The request's own token cap (None: the job's ``decode.max_new_tokens``)."""
    raw_id: str | int | None = None
    """The id as the input gave it (its row carries it back: 7, not "7"); ``id`` is its text, for matching."""
    turns: tuple[str, ...] = ()
    """Follow-up user turns (MT-Bench's second turn): each is decoded after the turn before it has its answer."""
    category: str | None = None
    """The record's category (MT-Bench's and Spec-Bench's), for a suite of one category."""
    turn: int = 1
    """Which turn of its conversation this request is (``id`` then carries it: ``<id>#turn<k>``)."""


def parse_request(obj: dict, line: int) -> Request:
    """Validate one input object; raises ``ValueError`` with a message naming the problem."""
    if "id" not in obj:
        raise ValueError("missing 'id'")
    if not isinstance(obj["id"], (str, int)) or isinstance(obj["id"], bool):
        raise ValueError("'id' must be a string or an integer")
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError("needs exactly one of 'prompt' or 'messages'")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise ValueError("'prompt' must be a non-empty string")
        messages = [{"role": "user", "content": obj["prompt"]}]
    else:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    cap = obj.get("max_new_tokens")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise ValueError("'max_new_tokens' must be a positive integer")
    turns = obj.get("turns") or []
    if not isinstance(turns, list) or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError("'turns' must be a list of non-empty strings")
    category = obj.get("category")
    return Request(str(obj["id"]), messages, line, obj.get("prompt"), cap, obj["id"], tuple(turns),
                   category if isinstance(category, str) else None)


def row_key(row: dict) -> str:
    """The matching key of an output row: its id's text, and ``#turn<k>`` for a later turn."""
    turn = row.get("turn", 1)
    return str(row["id"]) + (f"#turn{turn}" if turn != 1 else "")


def next_turn(req: Request, answer: str) -> Request | None:
    """The request of ``req``'s next turn, its conversation holding ``answer`` (None after the last turn)."""
    if req.turn > len(req.turns):
        return None
    base = req.id.split("#turn")[0] if req.turn > 1 else req.id
    messages = [*req.messages, {"role": "assistant", "content": answer},
                {"role": "user", "content": req.turns[req.turn - 1]}]
    return dataclasses.replace(req, id=f"{base}#turn{req.turn + 1}", messages=messages, prompt=None,
                               turn=req.turn + 1)


def conversation(req: Request, answers: dict[str, str]) -> list[dict]:
    """``req``'s conversation with the answers of its turns (by :func:`row_key`), up to the first turn without a
    non-empty answer."""
    messages = list(req.messages)
    while (answer := answers.get(req.id, "")).strip():
        messages.append({"role": "assistant", "content": answer})
        if (req := next_turn(req, answer)) is None:
            break
        messages.append(req.messages[-1])
    return messages if messages[-1]["role"] == "assistant" else messages[:-1]


def read_requests(path: str | Path, warn: Callable[[str], None], fmt: str = "auto") -> list[Request]:
    """Valid requests of an input file in format ``fmt`` (see :mod:`specdraft.runtime.suites`; ``auto``: detected
    from its first record); every bad line is reported through ``warn`` with its number."""
    path = Path(path)
    if not path.is_file():
        raise SpecdraftError(f"input file {path} not found")
    fmt = suites.format_name(fmt)
    requests, seen = [], set()
    try:
        for n, obj in suites.records(path):
            try:
                if not isinstance(obj, dict):
                    raise ValueError(obj if isinstance(obj, str) else "expected a JSON object")
                if fmt == "auto":
                    fmt = suites.detect(obj)
                req = parse_request(suites.to_request(obj, fmt, n), n)
            except ValueError as e:
                warn(f"{path}:{n}: skipped malformed line: {e}")
                continue
            if req.id in seen:
                warn(f"{path}:{n}: skipped duplicate id {req.id!r}")
                continue
            seen.add(req.id)
            requests.append(req)
    except (OSError, EOFError, ValueError) as e:  # an unreadable gzip stream, a .json that is not a list
        raise SpecdraftError(f"input file {path} cannot be read: {e}") from None
    if not requests:
        raise SpecdraftError(f"input file {path} has no valid requests")
    return requests


def done_ids(output: Path) -> set[str]:
    """Ids already written by an earlier (possibly interrupted) run; a torn last line is ignored."""
    ids = set()
    if output.is_file():
        for line in output.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                ids.add(row_key(json.loads(line)))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return ids


def _repair_torn_tail(output: Path) -> None:
    """Drop a partial last line left by a crash mid-write, so appends start on a fresh line."""
    if output.is_file() and output.stat().st_size:
        data = output.read_bytes()
        if not data.endswith(b"\n"):
            output.write_bytes(data[: data.rfind(b"\n") + 1])


@contextlib.contextmanager
def claim_output(output: Path, settings: dict, warn: Callable[[str], None] | None = None):
    """Hold ``output`` for one job. A lock (``<output>.lock``) refuses a second writer; the settings that shape its
    rows (``<output>.settings.json``) are recorded, and a resume with other settings is refused, naming the keys
    (its rows would mix two jobs' results under one file)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    lock = output.with_name(output.name + ".lock").open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise SpecdraftError(f"{output} is being written by another job ({holder}): wait for it to end, or choose "
                             "another --output") from None
    try:
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}")
        lock.flush()
        _check_settings(output, json.loads(json.dumps(settings)), warn or warn_stderr)
        yield
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


def _check_settings(output: Path, settings: dict, warn: Callable[[str], None]) -> None:
    record = output.with_name(output.name + ".settings.json")
    has_rows = output.is_file() and output.stat().st_size > 0
    if record.is_file() and has_rows:
        try:
            old = json.loads(record.read_text())
        except ValueError:
            raise SpecdraftError(f"{record} is not valid JSON: restore it, or choose another --output") from None
        changed = sorted(k for k in old.keys() | settings.keys() if old.get(k) != settings.get(k))
        if changed:
            raise SpecdraftError(f"{output} holds rows of a job with other settings ("
                                 + "; ".join(f"{k}: {old.get(k)!r} then, {settings.get(k)!r} now" for k in changed)
                                 + "): choose another --output, or delete it and its .settings.json to start over")
    elif has_rows:
        warn(f"{output}: no settings recorded beside it (an older job wrote it); resuming without checking them")
    record.write_text(json.dumps(settings, indent=2))


def shard_for_rank(requests: list[Request], output: Path) -> tuple[list[Request], Path]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return requests, output
    rank = int(os.environ.get("RANK", "0"))
    return requests[rank::world], output.with_name(output.name + f".rank{rank}")


def merge_shards(input_path: str | Path, output: str | Path, warn: Callable[[str], None]) -> dict:
    """Merge the per-rank outputs of a sharded job (``<output>.rank<r>``, see :func:`shard_for_rank`, and
    ``<output>`` itself if an unsharded run wrote some) into ``output``, one row per id in the input's order.

    A row whose id is not in the input is refused; two rows for one id must agree (a rerun of a shard writes nothing
    twice, so a disagreement means two jobs wrote one output); ids with no row (requests the job refused) are
    reported through ``warn``. Returns counts."""
    output = Path(output)
    order = [key for r in read_requests(input_path, lambda m: None)
             for key in (r.id, *(f"{r.id}#turn{k}" for k in range(2, len(r.turns) + 2)))]
    known = set(order)
    rows: dict[str, str] = {}
    shards = [p for p in output.parent.glob(output.name + ".rank*") if p.name[len(output.name) + 5:].isdigit()]
    sources = sorted(shards) + ([output] if output.is_file() else [])  # not their .lock and .settings.json
    if not sources:
        raise SpecdraftError(f"no shard outputs {output.name}.rank* next to {output}")
    for src in sources:
        for n, line in enumerate(src.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            try:
                row_id = row_key(json.loads(line))
            except (json.JSONDecodeError, KeyError, TypeError):
                warn(f"{src}:{n}: not a result row (a torn last line?); skipped")
                continue
            if row_id not in known:
                raise SpecdraftError(f"{src}:{n}: id {row_id!r} is not in {input_path}: the shards belong to another "
                                     "input")
            if row_id in rows and json.loads(rows[row_id]) != json.loads(line):
                raise SpecdraftError(f"{src}:{n}: id {row_id!r} has two different results: two jobs wrote these "
                                     "outputs")
            rows[row_id] = line
    missing = [i for i in order if i not in rows]
    if missing:
        warn(f"{len(missing)} request(s) have no result (refused by the job): {', '.join(missing[:10])}"
             + (" ..." if len(missing) > 10 else ""))
    tmp = output.with_name(output.name + ".merging")
    tmp.write_text("".join(rows[i] + "\n" for i in order if i in rows), encoding="utf-8")
    tmp.replace(output)
    return {"rows": len(rows), "missing": len(missing), "shards": len(sources)}


def warn_stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def encode_requests(requests: list[Request], tokenizer, context: int | None, enable_thinking: bool = False,
                    warn: Callable[[str], None] = warn_stderr) -> list[tuple[Request, list[int]]]:
    """Token ids of each request that can be decoded; every other one is reported through ``warn`` by id and line.

    Without a chat template (a base model) ``prompt`` requests are encoded as plain text and ``messages`` requests
    are refused; a prompt that does not fit the target's ``context`` is refused (nothing is truncated)."""
    templated = has_chat_template(tokenizer)
    if not templated:
        warn("the tokenizer has no chat template: 'prompt' requests are encoded as plain text")
    out = []
    for r in requests:
        if templated:
            ids = encode_chat(tokenizer, r.messages, enable_thinking=enable_thinking)
        elif r.prompt is not None:
            ids = encode_plain(tokenizer, r.prompt)
        else:
            warn(f"request {r.id!r} (line {r.line}): skipped: 'messages' needs a chat template and this tokenizer "
                 "has none; send the text as 'prompt'")
            continue
        if context is not None and len(ids) >= context:
            warn(f"request {r.id!r} (line {r.line}): skipped: its prompt is {len(ids)} tokens, the target's context "
                 f"is {context}")
            continue
        out.append((r, ids))
    return out


def result_row(req: Request, res: RowResult, tokenizer, stats: dict, with_verified: bool = False,
               length_reason: str = "length") -> dict:
    """The output row of one request (the JSONL contract), counting it into the job's ``stats``.
    ``finish_reason``: ``stop`` (a stop token), ``length`` (its token cap) or ``context`` (the target's context
    ended it first: ``length_reason``, see :func:`length_reasons`)."""
    stats["tokens"] += len(res.tokens)
    stats["rounds"] += len(res.accept_lengths)
    stats["committed"] += sum(res.accept_lengths)
    return {"id": req.id if req.raw_id is None else req.raw_id, **({"turn": req.turn} if req.turns or req.turn > 1
                                                                       else {}),
            "completion": tokenizer.decode(res.tokens, skip_special_tokens=True),
            "num_tokens": len(res.tokens), "finish_reason": length_reason if res.finish_reason == "length" else
            res.finish_reason, "accept_lengths": res.accept_lengths, "tau": round(res.tau, 4),
            "time_s": round(res.time_s, 4), **({"verified": res.verified} if with_verified else {})}


def pending_requests(requests: list[Request], output: Path, tokenizer, target_context: int | None,
                     enable_thinking: bool, warn: Callable[[str], None]) -> tuple[list, dict]:
    """What a (re)started job still has to decode: ``[(request, prompt ids)]`` of the requests with no row in
    ``output`` that can be decoded (the others reported through ``warn``), and the job's starting stats."""
    output.parent.mkdir(parents=True, exist_ok=True)
    _repair_torn_tail(output)
    finished = done_ids(output)
    todo = [r for r in requests if r.id not in finished]
    encoded = encode_requests(todo, tokenizer, target_context, enable_thinking, warn)
    stats = {"requests": len(encoded), "rejected": len(todo) - len(encoded), "skipped_done": len(requests) - len(todo),
             "tokens": 0, "rounds": 0, "committed": 0, "seconds": 0.0}
    return encoded, stats


def completions(output: Path) -> dict[str, str]:
    """The completion of each row in ``output``, by :func:`row_key` (a torn last line is ignored)."""
    out = {}
    if output.is_file():
        for line in output.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
                out[row_key(row)] = row["completion"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return out


def finish_stats(stats: dict, seconds: float) -> dict:
    stats["seconds"] = seconds
    stats["tau"] = stats.pop("committed") / max(stats["rounds"], 1)
    return stats


def length_reasons(encoded: list[tuple[Request, list[int]]], caps: list[int], default: int) -> list[str]:
    """Per request, why a row that ran to its cap ended: ``context`` where the target's context cut the cap short,
    else ``length``."""
    return ["context" if cap < (r.max_new_tokens or default) else "length" for (r, _), cap in zip(encoded, caps)]


def request_caps(encoded: list[tuple[Request, list[int]]], default: int, context: int | None) -> list[int]:
    """Each request's token cap: its own ``max_new_tokens`` or the job's, and never past the target's context."""
    caps = [r.max_new_tokens or default for r, _ in encoded]
    if context is not None:
        caps = [min(c, context - len(ids)) for c, (_, ids) in zip(caps, encoded)]
    return caps


class ResultWriter:
    """Appends result rows as whole lines: flushed per row, fsynced every ``sync_every`` rows and at the end."""

    def __init__(self, output: Path, sync_every: int):
        self.f = output.open("a", encoding="utf-8")
        self.sync_every, self.unsynced = max(sync_every, 1), 0

    def write(self, rows: list[dict]) -> None:
        self.f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        self.f.flush()
        self.unsynced += len(rows)
        if self.unsynced >= self.sync_every:
            self.sync()

    def sync(self) -> None:
        os.fsync(self.f.fileno())
        self.unsynced = 0

    def close(self) -> None:
        self.sync()
        self.f.close()


@dataclass
class Decoding:
    """How a job decodes its requests: the models and everything around them, built once per process (the local job,
    or each Ray actor) and used for every batch."""

    target: object
    gen: GenerationConfig
    """Sampling, stop tokens and the job's default ``max_new_tokens`` (one int: requests carry their own caps)."""
    batch_size: int
    drafter: object = None
    """None: the target alone."""
    generator: object = None
    """The ``torch.Generator`` sampling draws from."""
    tree: object = None
    """Tree rounds: a :class:`~specdraft.runtime.d2sd.TreeDrafting` (D²SD) or a
    :class:`~specdraft.runtime.one_pass.OnePassDrafting`."""
    engine: Callable | None = None
    """Decodes each static batch: :func:`~specdraft.runtime.decode.generate` (None), or a
    :class:`~specdraft.runtime.static_decode.StaticEngine`."""
    policy: object = None
    """An :class:`~specdraft.runtime.policy.AdaptivePolicy` choosing each round's drafts (every row then records
    them: ``verified``, drafts verified per round, 0 for a plain round)."""
    batching: str = "static"
    """``static``: batches of ``batch_size`` requests sorted by prompt length, each until its longest request ends;
    ``continuous``: ``batch_size`` requests decoding at once in input order, a finished one's slot refilled at once
    (:func:`~specdraft.runtime.decode.generate` with ``slots``), its prompt prefilled ``prefill_chunk`` tokens per
    round."""
    prefill_chunk: int | None = None

    def __post_init__(self):
        if self.batching not in ("static", "continuous") or self.batching == "continuous" and self.engine is not None:
            raise ValueError(f"batching {self.batching!r}: static, or continuous with the eager engine")
        if not isinstance(self.gen.max_new_tokens, int):
            raise ValueError("a job's default max_new_tokens is one int (requests carry their own)")

    def decode(self, prompts: list[list[int]], caps: list[int],
               on_results: Callable[[list[int], list[RowResult]], None] | None = None) -> list[RowResult]:
        """Decode ``prompts`` with their ``caps``; ``on_results(indices, results)`` is called as they end (a static
        batch at a time, or each request under continuous batching). Returns the results in ``prompts`` order."""
        out: list[RowResult | None] = [None] * len(prompts)
        extra = {"policy": self.policy} if self.policy is not None else {}
        models = {"drafter": self.drafter, "generator": self.generator, "tree": self.tree, **extra}

        def ended(idx: list[int], results: list[RowResult]) -> None:
            for i, r in zip(idx, results):
                out[i] = r
            if on_results is not None:
                on_results(idx, results)

        if self.batching == "continuous":
            if prompts:
                generate(self.target, prompts, dataclasses.replace(self.gen, max_new_tokens=list(caps)),
                         slots=self.batch_size, prefill_chunk=self.prefill_chunk,
                         on_result=lambda i, r: ended([i], [r]), **models)
            return out  # type: ignore[return-value]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths per batch
        for at in range(0, len(order), self.batch_size):
            idx = order[at:at + self.batch_size]
            ended(idx, (self.engine or generate)(self.target, [prompts[i] for i in idx], dataclasses.replace(
                self.gen, max_new_tokens=[caps[i] for i in idx]), **models))
        return out  # type: ignore[return-value]


def run_batch_job(requests: list[Request], output: Path, tokenizer, decoding: Decoding,
                  enable_thinking: bool = False, progress=None, warn: Callable[[str], None] = warn_stderr) -> dict:
    """Decode ``requests`` (skipping ids already in ``output``) with ``decoding`` and append results. Returns job
    stats.

    Rows are written as requests end: each static batch (then fsynced), or each request under continuous batching.
    A request that cannot be decoded (see :func:`encode_requests`) is reported and skipped; the others are written.
    Generation stops at the request's ``max_new_tokens`` (default ``gen.max_new_tokens``) and at the target's context
    (``max_position_embeddings``) for every row. A request with follow-up ``turns`` decodes them one after another:
    each turn once the one before has its row, with the target's answers in its conversation (a resumed job picks up
    at the turn it stopped in)."""
    return run_turns(requests, output, lambda todo: _run_turn(todo, output, tokenizer, decoding, enable_thinking,
                                                              progress, warn))


def run_turns(requests: list[Request], output: Path, one_pass: Callable[[list[Request]], dict]) -> dict:
    """``one_pass`` (decode a turn of some requests into ``output``, return its stats with ``seconds``) over
    ``requests``, then over the next turn of each that has its row, until no turn is left; the stats summed."""
    total, todo = one_pass(requests), requests
    while todo := [nxt for r, answers in _with_answers(todo, output) if (nxt := next_turn(r, answers)) is not None]:
        stats = one_pass(todo)
        total = {k: total[k] + stats[k] for k in total}
    return finish_stats(total, total["seconds"])


def _with_answers(requests: list[Request], output: Path) -> list[tuple[Request, str]]:
    """The requests of a turn that have their row in ``output``, each with its completion."""
    answers = completions(output)
    return [(r, answers[r.id]) for r in requests if r.id in answers]


def _run_turn(requests, output, tokenizer, decoding: Decoding, enable_thinking, progress, warn) -> dict:
    """One pass of :func:`run_batch_job` over ``requests``: their stats, ``committed`` kept and ``seconds`` set."""
    context = getattr(getattr(decoding.target, "args", None), "max_position_embeddings", None)
    encoded, stats = pending_requests(requests, output, tokenizer, context, enable_thinking, warn)
    caps = request_caps(encoded, decoding.gen.max_new_tokens, context)
    why = length_reasons(encoded, caps, decoding.gen.max_new_tokens)
    start = last = time.perf_counter()
    writer = ResultWriter(output, decoding.batch_size)

    def write(idx: list[int], results: list[RowResult]) -> None:
        nonlocal last
        writer.write([result_row(encoded[i][0], res, tokenizer, stats, decoding.policy is not None, why[i])
                      for i, res in zip(idx, results)])
        if decoding.batching == "static":
            writer.sync()  # a whole batch, then fsync
        if progress is not None:
            now = time.perf_counter()
            progress(len(idx), now - last)
            last = now

    try:
        decoding.decode([ids for _, ids in encoded], caps, write)
    finally:
        writer.close()
    stats["seconds"] = time.perf_counter() - start
    return stats
