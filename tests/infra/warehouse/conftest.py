from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.warehouse import open_warehouse
from infra.warehouse.client import Client
from schemas.settings import PlatformSettings


@pytest.fixture
def settings(tmp_path: Path) -> PlatformSettings:
    return PlatformSettings(data_dir=str(tmp_path / "data"))


@pytest.fixture
def warehouse(settings: PlatformSettings) -> Iterator[Client]:
    """This process's chDB engine on a fresh directory; closed after the test so the next can open another."""
    client = open_warehouse(settings)
    try:
        yield client
    finally:
        client.close()
