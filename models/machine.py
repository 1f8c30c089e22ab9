"""What this machine's CPU is: the one reader of /proc/cpuinfo (Linux), read once per process.

The kernel build chooses its instruction set from the flags, the llama.cpp peer keys its build
on them, and timings and results record the CPU's model name.
"""

import functools
import pathlib
import platform


@functools.cache
def cpuinfo(path: str = "/proc/cpuinfo") -> dict[str, str] | None:
    """The first processor's fields of /proc/cpuinfo ({"model name": "...", "flags": "fpu vme
    ...", ...}, values stripped), or None where the file cannot be read."""
    try:
        text = pathlib.Path(path).read_text()
    except OSError:
        return None
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the end of the first processor's block
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 7B13"), else platform.processor() (may be "")."""
    return (cpuinfo() or {}).get("model name") or platform.processor()


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags ("avx2", "avx512f", ...): empty where /proc/cpuinfo lists none,
    None where it cannot be read."""
    info = cpuinfo()
    return None if info is None else frozenset(info.get("flags", "").split())
