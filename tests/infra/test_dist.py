"""Fetching the Kafka jars into the cache every clone and CI run shares. Found by a review: two fetches of
one version at once (two CI runs after a version bump, two `sluice kafka fetch`, two pytest workers) shared
one staging folder, deleted each other's jars, and marked a partial set complete, which every later start
trusted and failed on. ``mvn`` here is a stand-in that copies jars one at a time, as
``dependency:copy-dependencies`` does."""

from __future__ import annotations

import os
import stat
import sys
import threading
from pathlib import Path

import pytest

from infra.kafka.dist import KafkaFetchError, fetch_kafka, is_fetched, kafka_home

JARS = [f"dep-{i:02d}.jar" for i in range(12)] + ["kafka_2.13-4.3.1.jar"]

_FAKE_MVN = """#!{python}
import os, sys, time
out = [a.split("=", 1)[1] for a in sys.argv if a.startswith("-DoutputDirectory=")][0]
with open(os.environ["FAKE_MVN_RUNS"], "a") as runs:
    runs.write("run\\n")
if os.environ.get("FAKE_MVN_FAILS"):
    print("[ERROR] Failed to execute goal: could not resolve")
    sys.exit(1)
for jar in {jars!r}:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, jar), "w") as f:
        f.write("jar")
    time.sleep(0.05)
"""


@pytest.fixture
def mvn_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake ``mvn`` first on PATH; the file it adds a line to on every run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mvn = bin_dir / "mvn"
    mvn.write_text(_FAKE_MVN.format(python=sys.executable, jars=JARS))
    mvn.chmod(mvn.stat().st_mode | stat.S_IEXEC)
    runs = tmp_path / "mvn-runs"
    runs.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MVN_RUNS", str(runs))
    return runs


def _jars(home: Path) -> list[str]:
    return sorted(p.name for p in (home / "libs").glob("*.jar"))


def test_two_fetches_at_once_leave_the_whole_jar_set_and_run_maven_once(
    tmp_path: Path, mvn_runs: Path
) -> None:
    cache = tmp_path / "cache"
    errors: list[BaseException] = []
    homes: list[Path] = []

    def fetch() -> None:
        try:
            homes.append(fetch_kafka(cache, "4.3.1"))
        except BaseException as exc:
            errors.append(exc)

    first = threading.Thread(target=fetch)
    first.start()
    threading.Event().wait(0.3)  # the first is copying jars
    second = threading.Thread(target=fetch)
    second.start()
    first.join(30)
    second.join(30)
    home = kafka_home(cache, "4.3.1")
    assert errors == [], f"a fetch failed: {errors!r}"
    assert homes == [home, home]
    assert _jars(home) == sorted(JARS), f"the cache is marked complete with {len(_jars(home))} of {len(JARS)}"
    assert is_fetched(home)
    assert mvn_runs.read_text().count("run") == 1, "the second fetch did not wait for the first"
    assert sorted(p.name for p in home.parent.iterdir()) == [home.name, f"{home.name}.lock"]


def test_a_cache_missing_one_of_its_jars_is_fetched_again(tmp_path: Path, mvn_runs: Path) -> None:
    home = fetch_kafka(tmp_path / "cache", "4.3.1")
    (home / "libs" / "dep-03.jar").unlink()  # a cache cleaner, a disk error
    assert not is_fetched(home)
    assert fetch_kafka(tmp_path / "cache", "4.3.1") == home
    assert _jars(home) == sorted(JARS)
    assert mvn_runs.read_text().count("run") == 2


def test_a_cache_marked_complete_before_jars_were_listed_is_still_trusted(
    tmp_path: Path, mvn_runs: Path
) -> None:
    home = kafka_home(tmp_path / "cache", "4.3.1")
    (home / "libs").mkdir(parents=True)
    (home / ".complete").write_text("4.3.1")  # as fetches before the jar list wrote it
    assert fetch_kafka(tmp_path / "cache", "4.3.1") == home
    assert mvn_runs.read_text() == ""


def test_a_failed_fetch_leaves_nothing_behind(
    tmp_path: Path, mvn_runs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MVN_FAILS", "1")
    with pytest.raises(KafkaFetchError, match="could not resolve"):
        fetch_kafka(tmp_path / "cache", "4.3.1")
    home = kafka_home(tmp_path / "cache", "4.3.1")
    assert sorted(p.name for p in home.parent.iterdir()) == [f"{home.name}.lock"]
