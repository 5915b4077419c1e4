"""Host memory on a CPU: freed blocks stay in the heap for the next round (glibc), so rounds stop page-faulting."""

import platform
import subprocess
import sys

import pytest

from specdraft.runtime.host_memory import keep_freed_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# In a fresh process (``keep``: after keep_freed_memory): bytes glibc serves from fresh mmap for a 16 MiB tensor, free
# bytes its heap keeps after the tensor is freed, and the minor page faults of 20 rounds that allocate 32 MiB in 4 MiB
# blocks and free them (a round's activations and features), after 5 rounds of warm-up.
PROBE = """
import ctypes, resource, sys, torch
from specdraft.runtime.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                 "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
before = libc.mallinfo2().hblkhd
x = torch.ones(4 << 20)
mapped = libc.mallinfo2().hblkhd - before
del x
kept = libc.mallinfo2().fordblks
def rnd():
    blocks = [torch.ones(1 << 20) for _ in range(8)]
    del blocks
for _ in range(5):
    rnd()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    rnd()
print(mapped, kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


def _probe(mode: str) -> tuple[int, int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    mapped, kept, faults = map(int, out.stdout.split()[-3:])
    return mapped, kept, faults


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's; other C libraries keep their own allocator")
def test_rounds_reuse_freed_memory_instead_of_faulting_it_in():
    mapped, kept, faults = _probe("keep")
    assert mapped == 0, f"a 16 MiB block came from {mapped} bytes of fresh mmap, not the heap"
    assert kept >= 16 << 20, f"only {kept} free bytes stayed in the heap after a 16 MiB block was freed"
    assert faults < 1000, f"{faults} minor faults in 20 rounds with freed memory kept"
    mapped, kept, _ = _probe("default")  # what glibc does unset: the same block is mapped and given back
    assert mapped >= 16 << 20 and kept < 16 << 20, (mapped, kept)


def test_setting_is_applied_once_and_reports_whether_it_holds():
    first = keep_freed_memory()
    assert keep_freed_memory() is first
    assert first == GLIBC
