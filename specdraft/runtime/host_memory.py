"""Host memory for decoding on a CPU: freed tensors stay in the process for the next round to reuse.

A decode round allocates and frees the same few hundred kilobytes to megabytes of activations, logits and target
features every round. glibc's malloc serves blocks above its (dynamic) ``mmap`` threshold with fresh ``mmap`` pages
and returns freed heap tops to the kernel, so rounds keep page-faulting memory in again
(docs/experiments/2026-12-02-host-memory.md measures what that costs). Fixing the threshold at 32 MiB and keeping
freed memory (what PyTorch's CPU tuning guide gets from jemalloc or tcmalloc) serves rounds from memory already
mapped; the peak footprint is the same, it is only not returned until the process ends. GPU decoding is
untouched (device memory has its own caching allocator).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc <malloc.h>
MMAP_THRESHOLD = 32 << 20
"""Blocks up to this size come from the heap (glibc's largest fixed threshold on 64-bit)."""
TRIM_THRESHOLD = 1 << 30
"""Free memory at the top of the heap kept before any is returned to the kernel."""
TOP_PAD = 64 << 20
"""Extra memory mapped whenever the heap grows, so growing does not happen every round."""

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory for reuse (once per process); True when it is set, False where the C
    library is not glibc (macOS, musl: their allocators are left as they are)."""
    global _done
    if _done is None:
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
        except OSError:
            libc = None
        _done = libc is not None and hasattr(libc, "gnu_get_libc_version")  # glibc's own symbol
        if _done:
            libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _done = all(libc.mallopt(option, value) == 1 for option, value in (
                (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    return _done
