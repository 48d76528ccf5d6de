"""Resolve an Apache Kafka broker runtime from Maven Central into a cache outside the repository."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from infra.errors import InfraError
from infra.locks import exclusive

_DOWNLOADED = re.compile(r"Downloaded from \S+: (\S+)")


class KafkaFetchError(InfraError):
    """Maven could not resolve the Kafka runtime."""


def _pom() -> bytes:
    return resources.files("infra.kafka").joinpath("pom.xml").read_bytes()


def kafka_home(cache_dir: str | Path, version: str) -> Path:
    """Where the jars of ``version`` live; the pom's hash is part of the name so a pom change refetches."""
    digest = hashlib.sha256(_pom()).hexdigest()[:8]
    return Path(cache_dir).expanduser() / "kafka" / f"{version}-{digest}"


def is_fetched(home: Path) -> bool:
    """Whether ``home`` holds a whole fetch: its ``.complete`` marker (the version, then every jar Maven
    copied), and each of those jars. A marker of one line (written before the jars were listed) vouches
    for the folder alone."""
    try:
        _version, *jars = (home / ".complete").read_text().splitlines()
    except (OSError, ValueError):  # no marker (or an empty one)
        return False
    return all((home / "libs" / jar).is_file() for jar in jars)


def fetch_kafka(cache_dir: str | Path, version: str, progress: Callable[[str], None] | None = None) -> Path:
    """Return the folder of jars for ``version``, downloading it with Maven the first time.

    ``progress`` is called with the name of each artifact as Maven downloads it. The cache is shared by
    every clone and CI run, so fetches of one version take turns (a file lock beside the folder), each
    stages into a folder of its own, and the folder appears whole and marked complete in one rename. Two
    fetches at once shared one staging folder, deleted each other's jars and marked a partial set complete,
    which every later start then trusted (a review).
    """
    home = kafka_home(cache_dir, version)
    if is_fetched(home):
        return home
    if shutil.which("mvn") is None:
        raise KafkaFetchError("Maven (mvn) is not on PATH; it is needed once to fetch Kafka jars")
    with exclusive(home.with_name(home.name + ".lock")):
        if is_fetched(home):  # another fetch finished while this one waited
            return home
        for stale in home.parent.glob(f"{home.name}.*.partial"):  # left by a fetch that was killed
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{home.name}.", suffix=".partial", dir=home.parent))
        staging.chmod(0o755)  # as the folder was before (mkdtemp makes it private to its owner)
        try:
            _resolve(staging, version, progress)
            if home.exists():  # incomplete (no fetch holds it: every one takes the lock), so nothing uses it
                shutil.rmtree(home)
            os.rename(staging, home)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return home


def _resolve(staging: Path, version: str, progress: Callable[[str], None] | None) -> None:
    """Have Maven copy the runtime's jars into ``staging/libs``, then mark ``staging`` complete with their
    names (checked by :func:`is_fetched`)."""
    (staging / "pom.xml").write_bytes(_pom())
    cmd = [
        "mvn",
        "-B",
        "-U",
        "-f",
        str(staging / "pom.xml"),
        f"-Dkafka.version={version}",
        "dependency:copy-dependencies",
        f"-DoutputDirectory={staging / 'libs'}",
        "-DincludeScope=runtime",
    ]
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout or ():
            lines.append(line.rstrip())
            match = _DOWNLOADED.search(line)
            if match and progress is not None:
                progress(match.group(1).rsplit("/", 1)[-1])
    jars = sorted(path.name for path in (staging / "libs").glob("*.jar"))
    if proc.returncode != 0 or not any(jar.startswith("kafka_2.13-") for jar in jars):
        errors = [ln for ln in lines if "ERROR" in ln][:5] or lines[-5:]
        raise KafkaFetchError(f"could not resolve Kafka {version} from Maven:\n" + "\n".join(errors))
    (staging / ".complete").write_text("\n".join([version, *jars]) + "\n")
