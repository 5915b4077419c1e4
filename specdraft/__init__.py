"""specdraft: train, export and run lossless block-diffusion speculative-decoding drafters.

Packages (imports point one way: runtime <- {lit_modules, export} <- pipeline):
  runtime/      torch-only: target forward, drafters, KV cache, verification, decode engine, batch jobs
  lit_modules/  LightningModules, DataModules and pure loss functions
  export/       HF-format drafter checkpoints (z-lab DFlash layout)
  pipeline/     typed config, CLI, stages (target, data, train, bench), MLflow tracking
"""

__version__ = "0.1.0"
