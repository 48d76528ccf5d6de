"""``scripts/bootstrap.sh``: the venv it makes holds compiled bytecode for what it installed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

VENV = Path(sys.prefix)
HEAVY = ("torch", "transformers", "evidently", "sklearn", "clickhouse_connect")
"""What the workers and the streams worker import at start: seconds of compiling each time without it."""


@pytest.mark.skipif(
    not (VENV / ".complete").is_file(), reason=f"{VENV} is not a venv made by scripts/bootstrap.sh"
)
def test_the_bootstrapped_venv_has_bytecode_for_what_the_services_import() -> None:
    assert (VENV / ".bytecode").is_file(), "scripts/bootstrap.sh marks the venv once it is compiled"
    missing = []
    for name in HEAVY:
        spec = importlib.util.find_spec(name)
        assert spec is not None, name
        assert spec.origin is not None, name
        if not Path(importlib.util.cache_from_source(spec.origin)).is_file():
            missing.append(name)
    assert not missing, f"no bytecode for {missing}: every process would compile them as it starts"
