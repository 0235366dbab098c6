"""Keep freed CPU memory in the process, so that a training step's big tensors reuse pages.

glibc serves every allocation above its mmap threshold (32 MiB at most, whatever mallopt is told)
with a fresh mmap and unmaps it on free. A training step allocates and frees the same big tensors
every step, so it pays the kernel's page faults on them every step: the dense gradient of
all-MiniLM-L6-v2's word embeddings (30522 x 384 fp32, 47 MB) took 33 ms to compute on one core, 28
of them faulting in fresh zeroed pages, against 5 ms into memory the process had already touched.
Under the TP-style plans every rank computes that gradient, so it is replicated work that no share
choice removes. Torch's DDP escapes it (its gradients are views of kept buckets); a Galaxy rank's
replicated embedding does not.

keep_freed_memory() turns glibc's mmap path off (M_MMAP_MAX 0: big blocks come from the heap like
small ones) and raises the heap's trim threshold (M_TRIM_THRESHOLD: freed memory at the heap's top
goes back to the OS only past 2 GiB), so freed blocks stay mapped and the next step reuses them.
The process then keeps its peak between steps instead of returning part of it, and the peak can
grow where a big block is freed and smaller allocations split it before the next big one. With
gradient accumulation a dense embedding lookup made such blocks: each micro-batch after the first
made a fresh 47 MB gradient to add into .grad, and where a forward ran between two such backwards
its activations split the freed block (a 1f1b pipeline's first stage peaked up to 3 gradients
higher at 12 micro-batches). The word embedding's rows now go into .grad in place
(galaxy.parallel.embedding_grad: no fresh block after the first); the blocks remain where the lookup
stays dense (a head tied to the table on the same stage, FSDP's sharded replicas), and the
planner's memory model counts them there (MemoryModel.kept_gradient_blocks). The setting is
process-wide and lasts as long as the process.

Config key cpu_allocator: "keep" (default) applies it to CPU runs, "system" leaves glibc's
defaults. Not glibc (musl, macOS, Windows): nothing to do, and nothing is done.
"""
from __future__ import annotations

import ctypes
import ctypes.util

from galaxy.config import choices

CPU_ALLOCATORS = choices("cpu_allocator")

# glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2 ** 31 - 1     # an int: the largest threshold mallopt takes

_kept = False


def _mallopt():
    """glibc's mallopt, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Make the C allocator keep freed memory mapped (process-wide; once is enough). True when
    glibc took both settings; False where there is no mallopt or it refused."""
    global _kept
    if _kept:
        return True
    mallopt = _mallopt()
    if mallopt is None:
        return False
    _kept = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _kept


def kept() -> bool:
    """Whether this process keeps freed memory (keep_freed_memory() took effect)."""
    return _kept


def apply(mode: str, device_type: str) -> bool:
    """The config key's effect for a run on `device_type`; whether memory is now kept."""
    if mode not in CPU_ALLOCATORS:
        raise ValueError(f"cpu_allocator must be one of {', '.join(CPU_ALLOCATORS)}, got {mode!r}")
    return keep_freed_memory() if mode == "keep" and device_type == "cpu" else _kept
