"""``scripts/bootstrap.sh``: the venv it makes holds compiled bytecode for what it installed."""

from __future__ import annotations

import importlib.util
import subprocess
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


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "caller", ["", "set -e", "set -euo pipefail"], ids=["interactive", "errexit-only", "strict"]
)
def test_sourcing_the_bootstrap_leaves_the_callers_shell_options_as_they_were(
    tmp_path: Path, caller: str
) -> None:
    """Found by an audit: sourced from an interactive shell (as the README says), it left ``set -euo
    pipefail`` on, and the shell closed at its next failing command; scripts/test must keep its own. Run on
    the early return (a Python that is not 3.11), which restores them the way the end does."""
    fake = tmp_path / "python3.11"
    fake.write_text('#!/bin/sh\n[ "$1" = "--version" ] && echo "Python 3.10.0"\nexit 1\n')
    fake.chmod(0o755)
    script = (
        f'{caller}\nsource scripts/bootstrap.sh 2>/dev/null || true\necho "$-"\nshopt -o pipefail || true\n'
    )
    out = subprocess.run(
        ["bash", "-c", script],
        cwd=ROOT,
        env={"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.split()
    flags, pipefail = out[0], out[-1]  # a review: `set -e` alone exited at reading pipefail's state
    assert ("e" in flags, "u" in flags, pipefail == "on") == (
        "e" in caller,
        "u" in caller,
        "pipefail" in caller,
    )


def test_a_caller_with_errexit_alone_gets_past_reading_its_options(tmp_path: Path) -> None:
    """Found by a review: reading pipefail's state (`shopt -po pipefail`, status 1 when it is off) ended a
    caller that had `set -e` but not pipefail, silently, at bootstrap's first lines. This caller gets to the
    Python check (and its early return, which ends it under `set -e`)."""
    fake = tmp_path / "python3.11"
    fake.write_text('#!/bin/sh\n[ "$1" = "--version" ] && echo "Python 3.10.0"\nexit 1\n')
    fake.chmod(0o755)
    done = subprocess.run(
        ["bash", "-c", "set -e\nsource scripts/bootstrap.sh\n"],
        cwd=ROOT,
        env={"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "sluicegate needs Python 3.11" in done.stderr, done.stderr


# `uv`, already installed in the cache: makes a venv (its python the real one, its bytecode marked, after a
# second, as a real install takes minutes) and installs nothing; every call is logged.
FAKE_UV = """#!/bin/sh
echo "$1" >> "$FAKE_UV_LOG"
if [ "$1" = venv ]; then
  for dir; do :; done
  mkdir -p "$dir/bin" && ln -s "{python}" "$dir/bin/python" && touch "$dir/.bytecode"
  sleep 1
fi
"""


def test_two_first_bootstraps_at_once_make_the_venv_once(tmp_path: Path) -> None:
    """Found by a review: two first bootstraps of one lock file (two CI jobs, two clones) each found no
    venv, and each deleted and rebuilt it while the other installed into it. The second waits now, and
    reuses the venv the first made."""
    cache = tmp_path / "cache"
    uv = cache / "tools" / "uv-0.13.9" / "bin" / "uv"
    uv.parent.mkdir(parents=True)
    uv.write_text(FAKE_UV.format(python=sys.executable))
    uv.chmod(0o755)
    log = tmp_path / "uv.log"
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SLUICE_CACHE_DIR": str(cache),
        "SLUICEGATE_WHEEL_DIR": str(tmp_path / "no-wheels"),
        "FAKE_UV_LOG": str(log),
    }
    script = 'set -e\nsource scripts/bootstrap.sh\necho "$SLUICEGATE_VENV"\n'
    runs = [
        subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    venvs = {run.communicate(timeout=60)[0].strip() for run in runs}
    assert [run.returncode for run in runs] == [0, 0]
    (venv,) = venvs
    assert (Path(venv) / ".complete").is_file()
    assert log.read_text().split().count("venv") == 1, "both bootstraps made the venv"
