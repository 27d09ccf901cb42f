"""How the benchmarks' vLLM engine processes allocate memory.

vLLM's CPU platform preloads tcmalloc into its engine processes when its wheel bundles one; the
CPU build installed here does not, so the workers run on glibc's malloc. glibc hands memory above
its (moving) mmap threshold back to the kernel on every free, and the next forward's activations
fault it in again page by page: on the 12 x 768 workload of ``vllm_overhead.py`` a worker took
0.3 to 2.9 million minor page faults per round (about 0.8 us each), varying from round to round
and run to run for every variant alike, plain included. :func:`steady_malloc` fixes the threshold
and keeps freed memory in the heap (the worker's memory stays at its high-water mark, as it does
under tcmalloc), so that a round measures the forward and the taps rather than the page faults.
Set before the engine starts: its processes inherit the environment.
"""

from __future__ import annotations

import os

STEADY = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),  # fixed: allocations below it come from the heap
    "MALLOC_TRIM_THRESHOLD_": str(16 << 30),  # freed heap memory stays mapped
    "MALLOC_TOP_PAD_": str(256 << 20),
}


def steady_malloc(enabled: bool = True) -> str:
    """Set :data:`STEADY` for the engine processes started after this call (unless tcmalloc is
    preloaded or a ``MALLOC_`` setting is already given); says what the workers allocate with."""
    if "libtcmalloc" in os.environ.get("LD_PRELOAD", ""):
        return "tcmalloc (preloaded)"
    if any(key.startswith("MALLOC_") for key in os.environ):
        return "glibc malloc, as the environment sets it"
    if not enabled:
        return "glibc malloc, its defaults"
    os.environ.update(STEADY)
    return "glibc malloc, threshold fixed and frees kept (bench/_workers.py)"
