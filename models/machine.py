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
    """The CPU's model name with its family and model numbers ("AMD EPYC (family 26, model 2)"),
    else platform.processor() (may be ""). The numbers tell generations apart where a cloud VM's
    name does not: this project's "AMD EPYC" has been a Zen 4 (family 25) and a Zen 5 (family 26),
    whose 512-bit instructions differ in cost, so timings and cached costs must not mix them."""
    info = cpuinfo() or {}
    name = info.get("model name") or platform.processor()
    if name and "cpu family" in info and "model" in info:
        return f"{name} (family {info['cpu family']}, model {info['model']})"
    return name


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags ("avx2", "avx512f", ...): empty where /proc/cpuinfo lists none,
    None where it cannot be read."""
    info = cpuinfo()
    return None if info is None else frozenset(info.get("flags", "").split())
