"""Engine backends: the decode engine's target and drafter run as exported graphs (ONNX Runtime, TensorRT) behind
the same interfaces as the PyTorch modules (:class:`~specdraft.runtime.drafter.Drafter`, the target's call)."""
