"""Export trained drafters: HF-format directories in z-lab's DFlash layout (loadable by our runtime, vLLM, SGLang)."""
