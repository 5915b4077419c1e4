"""``specdraft target``: the embedded world (corpora -> tokenizer -> tiny Qwen3 target), cached by config hash.

With ``target.path`` set, the stage only checks that the checkpoint loads and has a tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L
import torch
from transformers import AutoTokenizer

from specdraft.errors import SpecdraftError
from specdraft.lit_modules.lm import CausalLMModule
from specdraft.pipeline.config import RunConfig, TinyTargetConfig
from specdraft.pipeline.corpora import DOMAINS, Doc, build_corpus
from specdraft.pipeline.jsonl import write_jsonl
from specdraft.pipeline.lightning_utils import TrackerCallback, quiet_lightning, resolve_precision
from specdraft.pipeline.tokenizer import format_chat, stop_token_ids, train_tokenizer
from specdraft.pipeline.tracking import Tracker
from specdraft.runtime.chat import encode_chat
from specdraft.runtime.decode import GenerationConfig, generate
from specdraft.runtime.load import load_target, read_target_args

WORLD_VERSION = 2  # 2: fp32 where bf16 is not native (bf16 autocast everywhere before)


@dataclass
class World:
    target_dir: Path
    """HF checkpoint + tokenizer of the target."""
    heldin_prompts: Path | None
    """JSONL of the prompts the target was trained on (source of drafter training prompts)."""
    bench_dir: Path | None
    """Held-out ``decode`` JSONL files, one per domain (``<domain>.jsonl``)."""
    report: dict


def world_hash(cfg: RunConfig) -> str:
    d = cfg.data
    tiny = asdict(cfg.target.tiny)
    precision = resolve_precision(tiny.pop("precision"))
    key = {"v": WORLD_VERSION, "tiny": tiny, "math": d.math_problems, "code": d.code_files,
           "dialogue": d.dialogue, "holdout": d.holdout_prompts}
    if precision != "32-true":  # a world trained in bf16 is another world
        key["precision"] = precision
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def cache_root() -> Path:
    return Path(os.environ.get("SPECDRAFT_CACHE", Path.home() / ".cache" / "specdraft"))


def world_dir(cfg: RunConfig) -> Path:
    return cfg.work_path / f"world-{world_hash(cfg)}"


def cached_world(cfg: RunConfig) -> World | None:
    """The tiny world already built for this config, or None."""
    wdir = world_dir(cfg)
    report_file = wdir / "report.json"
    if not report_file.is_file():
        return None
    return World(wdir / "target", wdir / "heldin_prompts.jsonl", wdir / "bench", json.loads(report_file.read_text()))


def build_or_load_world(cfg: RunConfig, tracker: Tracker, log=print) -> World:
    if cfg.target.path:
        return external_world(cfg)
    world = cached_world(cfg)
    if world is not None:
        log(f"target: reusing cached tiny world {world_dir(cfg)}")
        return world
    return _build_world(cfg, world_dir(cfg), tracker, log)


def external_world(cfg: RunConfig) -> World:
    """Check a user's checkpoint without loading its weights: config readable, weights and tokenizer present. When
    ``target.path`` is the target of a world specdraft built, its held-in prompts and held-out suites come along."""
    path = Path(cfg.target.path)
    try:
        args = read_target_args(path)
    except SpecdraftError as e:
        raise SpecdraftError(f"config key 'target.path': {e}") from None
    if not any((path / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")):
        raise SpecdraftError(f"config key 'target.path': no safetensors weights in {path}")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise SpecdraftError(f"config key 'target.path': no tokenizer files in {path}")
    wdir = path.parent
    built = (wdir / "report.json").is_file() and (wdir / "bench").is_dir()
    return World(path, wdir / "heldin_prompts.jsonl" if built else None, wdir / "bench" if built else None,
                 {"target": str(path), "model_type": args.model_type, "layers": args.num_hidden_layers,
                  "vocab_size": args.vocab_size})


def _pack(tokenizer, docs: list[Doc], seq_len: int) -> torch.Tensor:
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    stream: list[int] = []
    for batch_start in range(0, len(docs), 512):
        texts = [format_chat(d.prompt, d.response) for d in docs[batch_start:batch_start + 512]]
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            stream.extend(ids + [eot])
    n = len(stream) // (seq_len + 1)
    if n == 0:
        raise SpecdraftError("corpus too small for one training sequence; raise data sizes or lower seq_len")
    return torch.tensor(stream[: n * (seq_len + 1)]).view(n, seq_len + 1)


def target_config(tiny: TinyTargetConfig, vocab: int, eos_token_id: int | None = None,
                  pad_token_id: int | None = None) -> dict:
    """The transformers ``Qwen3Config`` arguments of the embedded world's target of shape ``tiny``."""
    return dict(vocab_size=vocab, hidden_size=tiny.hidden_size, intermediate_size=tiny.intermediate_size,
                num_hidden_layers=tiny.num_layers, num_attention_heads=tiny.num_heads,
                num_key_value_heads=tiny.num_kv_heads, head_dim=tiny.hidden_size // tiny.num_heads,
                max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=10000.0,
                bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=pad_token_id)


def _build_world(cfg: RunConfig, wdir: Path, tracker: Tracker, log) -> World:
    t0 = time.perf_counter()
    tiny, data = cfg.target.tiny, cfg.data
    corpus = build_corpus(data.math_problems, data.code_files, data.dialogue, data.holdout_prompts, tiny.seed,
                          cache_root() / "corpora", log)
    log(f"target: corpus {len(corpus.train)} training documents; held-out "
        + ", ".join(f"{k} {len(v)}" for k, v in corpus.holdout.items()))
    wdir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer((d.prompt + "\n" + d.response for d in corpus.train), tiny.vocab_size,
                                wdir / "target")
    vocab = len(tokenizer)

    torch.manual_seed(tiny.seed)
    train = _pack(tokenizer, corpus.train, tiny.seq_len)
    val = {dom: _pack(tokenizer, docs, tiny.seq_len) for dom, docs in corpus.holdout.items()}
    hf_config = target_config(tiny, vocab, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    module = CausalLMModule(hf_config, tiny.lr, tiny.warmup_steps, tiny.max_steps)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(train), batch_size=tiny.batch_size,
                                         shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(tiny.seed))
    quiet_lightning()
    trainer = L.Trainer(max_steps=tiny.max_steps, max_time={"minutes": tiny.max_minutes} if tiny.max_minutes else None,
                        accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
                        gradient_clip_val=1.0, precision=resolve_precision(tiny.precision),
                        callbacks=[TrackerCallback(tracker, prefix="target/"),
                                   L.pytorch.callbacks.TQDMProgressBar(refresh_rate=10)], enable_model_summary=False,
                        log_every_n_steps=10)
    t_train = time.perf_counter()
    trainer.fit(module, loader)
    train_s = time.perf_counter() - t_train
    if trainer.global_step < tiny.max_steps:
        log(f"target: stopped at step {trainer.global_step}/{tiny.max_steps} (max_minutes={tiny.max_minutes})")

    model = module.model.float().eval()
    model.generation_config.eos_token_id = list(stop_token_ids(tokenizer))
    model.save_pretrained(str(wdir / "target"))
    heldout_loss = {}
    with torch.no_grad():
        for dom, seqs in val.items():
            heldout_loss[dom] = float(module._loss(seqs[:64]).item())

    # prompt files: held-in (training prompts, for drafter data) and held-out benchmark suites
    write_jsonl(wdir / "heldin_prompts.jsonl",
                [{"id": f"{d.domain}-{i}", "domain": d.domain, "prompt": d.prompt} for i, d in enumerate(corpus.train)])
    for dom in DOMAINS:
        if dom in corpus.holdout:
            rng = random.Random(tiny.seed)
            docs = list(corpus.holdout[dom])
            rng.shuffle(docs)
            write_jsonl(wdir / "bench" / f"{dom}.jsonl",
                        [{"id": f"{dom}-heldout-{i}", "prompt": d.prompt} for i, d in enumerate(docs)])

    samples = _samples(wdir / "target", corpus.holdout)
    report = {"vocab_size": vocab, "params": sum(p.numel() for p in model.parameters()), "steps": trainer.global_step,
              "train_s": round(train_s, 1), "total_s": round(time.perf_counter() - t0, 1),
              "heldout_loss": heldout_loss, "samples": samples}
    (wdir / "report.json").write_text(json.dumps(report, indent=2))
    tracker.log_metrics({"target/train_s": train_s, **{f"target/heldout_loss_{k}": v for k, v in heldout_loss.items()}})
    tracker.log_artifact(wdir / "report.json", "target")
    log(f"target: trained {report['params'] / 1e6:.2f}M params for {trainer.global_step} steps in {train_s:.0f}s; "
        "held-out loss " + ", ".join(f"{k} {v:.3f}" for k, v in heldout_loss.items()))
    return World(wdir / "target", wdir / "heldin_prompts.jsonl", wdir / "bench", report)


def _samples(target_dir: Path, holdout: dict[str, list[Doc]], max_new_tokens: int = 80) -> dict[str, dict]:
    """One greedy sample per domain from the runtime (shows the target follows each domain)."""

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target = load_target(target_dir, dtype="float32", device="cpu")
    out = {}
    for dom, docs in holdout.items():
        prompt = docs[0].prompt
        ids = encode_chat(tok, [{"role": "user", "content": prompt}])
        gen = GenerationConfig(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids(tok))
        res = generate(target, [ids], gen)
        out[dom] = {"prompt": prompt, "completion": tok.decode(res[0].tokens, skip_special_tokens=True)}
    return out
