"""The Faust app's configuration, checked without a broker."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
from clickhouse_connect.driver.client import Client

from bus.producer import EventProducer
from schemas.settings import KafkaConnection, PlatformSettings
from streams.app import StreamsApp
from streams.pricing import PriceTable
from streams.settings import StreamsSettings


async def test_faust_keeps_its_directories_under_the_data_dir_not_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    data = tmp_path / "data {conf.name}"  # Faust formats the path: braces must stay literal
    streams = StreamsApp(
        PlatformSettings(kafka_bootstrap="127.0.0.1:1", topic_prefix="p", data_dir=str(data)),
        StreamsSettings(),
        cast(Client, None),  # never used unless the app runs
        PriceTable(),
        EventProducer(KafkaConnection("127.0.0.1:1"), "test"),
        request_topics=["p.requests.demo-gpt"],
    )
    try:
        conf = streams.app.conf
        assert conf.datadir == data / "faust" / "p-streams"
        assert conf.appdir.is_relative_to(data)
        assert conf.tabledir.is_relative_to(data)
    finally:
        await streams.stop()
    assert list(cwd.iterdir()) == []
