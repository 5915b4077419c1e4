"""LightningModules, DataModules and pure loss functions (imports runtime, never export)."""
