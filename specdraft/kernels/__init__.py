"""Fused kernels for speculative decoding, each as a pure-PyTorch reference, a Triton kernel and a launcher that picks
one (Liger's layout). This package imports only torch and (guarded) triton; the runtime calls launchers only."""
