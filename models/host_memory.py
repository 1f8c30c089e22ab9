"""Host memory for weights on a CPU: arrays on transparent huge pages (huge_page_empty,
on_huge_pages), and whether an array views a file (file_backed). models.convert places every
weight of a huge page or more there; the CPU kernel's layouts (models.precision.for_cpu_kernel)
are written there directly, so a load touches each weight's memory once.

Fresh memory costs its first touch: on this project's 2-core VMs about 3 s per GB the first time
a process maps pages the machine has not backed yet (0.2 s per GB for pages it reuses), the most
of a warm server's start (issue 52). A layout built in one buffer and copied into another paid it
twice."""

import ctypes
import math
import mmap

import numpy as np

HUGE_PAGE = 2 << 20  # an x86-64 transparent huge page


class _HugePages(mmap.mmap):
    """Private anonymous memory advised for transparent huge pages (huge_page_empty's)."""


def huge_page_empty(shape, dtype) -> np.ndarray:
    """An uninitialised array in private anonymous memory advised for transparent huge pages
    (Linux MADV_HUGEPAGE, its start 2 MB-aligned), or np.empty where it is under HUGE_PAGE bytes
    or the OS has no such advice. A decode step streams every weight from memory once: on 4 KB
    pages (a file's memory map, or malloc's) that is a TLB miss every 4 KB, on 2 MB pages one
    every 2 MB (the decode step ~10% faster on this project's 2-core Zen 4 EPYC, 1-2% on its Zen 5;
    docs/benchmarks.md).
    Where the kernel finds no free huge page it falls back to 4 KB pages: the same values either
    way. The array is an ordinary writable numpy array over the mapping, which it keeps alive."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype)
    buf = _HugePages(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)  # before anything touches a page: each fault then maps 2 MB
    start = -ctypes.addressof(ctypes.c_char.from_buffer(buf)) % HUGE_PAGE
    return np.frombuffer(buf, dtype, math.prod(shape), start).reshape(shape)


def on_huge_pages(a: np.ndarray) -> np.ndarray:
    """`a` on transparent huge pages: `a` itself where it is there already (huge_page_empty's
    memory, or a view of it), under HUGE_PAGE bytes, or the OS has no such advice; else a copy
    in huge_page_empty's memory."""
    if isinstance(bases(a)[-1], _HugePages) or a.nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return a
    out = huge_page_empty(a.shape, a.dtype)
    np.copyto(out, a)
    return out


def bases(a) -> list:
    """a, then what it views, down to the memory that owns the bytes (a memoryview's object)."""
    chain = [a]
    while True:
        nxt = chain[-1].base if isinstance(chain[-1], np.ndarray) else getattr(chain[-1], "obj", None)
        if nxt is None:
            return chain
        chain.append(nxt)


def file_backed(a: np.ndarray) -> bool:
    """Whether `a` views a memory map of a file (np.memmap, as _leaf_blocks' `mmap` reads)."""
    return any(isinstance(x, np.memmap) for x in bases(a))
