"""Resolve an Apache Kafka broker runtime from Maven Central into a cache outside the repository."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from infra.errors import InfraError

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
    return (home / ".complete").is_file()


def fetch_kafka(cache_dir: str | Path, version: str, progress: Callable[[str], None] | None = None) -> Path:
    """Return the folder of jars for ``version``, downloading it with Maven the first time.

    ``progress`` is called with the name of each artifact as Maven downloads it.
    """
    home = kafka_home(cache_dir, version)
    if is_fetched(home):
        return home
    if shutil.which("mvn") is None:
        raise KafkaFetchError("Maven (mvn) is not on PATH; it is needed once to fetch Kafka jars")
    staging = home.with_name(home.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
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
    if proc.returncode != 0 or not any((staging / "libs").glob("kafka_2.13-*.jar")):
        errors = [ln for ln in lines if "ERROR" in ln][:5] or lines[-5:]
        raise KafkaFetchError(f"could not resolve Kafka {version} from Maven:\n" + "\n".join(errors))
    shutil.rmtree(home, ignore_errors=True)
    staging.rename(home)
    (home / ".complete").write_text(version)
    return home
