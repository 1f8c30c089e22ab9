"""The one reader of the machine's description (models.machine): /proc/cpuinfo's first
processor, and no other module reading the file itself."""

import ast
import pathlib

from models import machine

ROOT = pathlib.Path(__file__).resolve().parent.parent

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 85
model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz
flags\t\t: fpu avx2 fma avx512f

processor\t: 1
model name\t: another one
flags\t\t: fpu
"""


def test_cpuinfo_reads_the_first_processors_fields_and_none_when_unreadable(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    info = machine.cpuinfo(str(path))
    assert info["model name"] == "Intel(R) Xeon(R) CPU @ 2.20GHz"
    assert set(info["flags"].split()) == {"fpu", "avx2", "fma", "avx512f"}
    assert machine.cpuinfo(str(tmp_path / "missing")) is None


def test_cpu_model_and_flags_read_this_machine_through_the_one_reader():
    info = machine.cpuinfo()
    if info is None:  # not Linux: the fallbacks
        assert machine.cpu_flags() is None and isinstance(machine.cpu_model(), str)
    else:
        assert machine.cpu_flags() == frozenset(info.get("flags", "").split())
        name = info.get("model name") or machine.platform.processor()
        assert machine.cpu_model().startswith(name)
        if "cpu family" in info:
            assert f"family {info['cpu family']}, model {info['model']}" in machine.cpu_model()


def test_cpu_model_names_the_family_and_model_so_that_generations_do_not_mix(tmp_path, monkeypatch):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    read = machine.cpuinfo.__wrapped__  # uncached: the file changes below
    monkeypatch.setattr(machine, "cpuinfo", lambda: read(str(path)))
    assert machine.cpu_model() == "Intel(R) Xeon(R) CPU @ 2.20GHz (family 6, model 85)"
    path.write_text(CPUINFO.replace("cpu family\t: 6\n", ""))  # no family: the name alone
    assert machine.cpu_model() == "Intel(R) Xeon(R) CPU @ 2.20GHz"


def test_no_module_but_models_machine_opens_proc_cpuinfo():
    found = []
    for package in ("models", "spec_jax", "training", "experiments", "launch", "scripts"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "models" / "machine.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value == "/proc/cpuinfo":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"read the CPU's description with models.machine: {found}"
