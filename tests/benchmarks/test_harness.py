"""What every benchmark records about the machine it ran on."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # scripts, not a package

from harness import cpu_model  # type: ignore[import-not-found]

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: something else
"""


def test_the_cpu_is_named_with_its_family_and_model(tmp_path: Path) -> None:
    # the same "AMD EPYC" name covers parts a generation apart: the family and model tell them apart
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO)
    assert cpu_model(cpuinfo) == "AMD EPYC (family 25, model 17)"


def test_a_cpu_without_family_or_model_is_its_name(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some ARM core\n")
    assert cpu_model(cpuinfo) == "Some ARM core"


def test_without_cpuinfo_the_processor_is_named(tmp_path: Path) -> None:
    assert cpu_model(tmp_path / "missing")  # platform.processor() or the architecture, never empty
