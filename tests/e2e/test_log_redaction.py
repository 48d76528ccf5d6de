"""Logs on the real online path: prompts, completions and API keys never reach them unless the tenant
enabled content logging (issue 5, "Logs")."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import pytest

from gpu_workers.service import WorkerService
from ingest.auth import DEMO_KEY, DEMO_TENANT
from monitoring.logs import REDACTED, make_formatter
from monitoring.settings import ObservabilitySettings
from tests.e2e.conftest import GPT, Platform

pytestmark = pytest.mark.integration
WRONG_KEY = "sk-live-SECRET0123456789abcdef"
KEYS = (DEMO_KEY, WRONG_KEY, "SECRET0123456789")


class Captured:
    """Every record that reaches the root logger, formatted by the platform's formatter."""

    def __init__(self, handler: logging.StreamHandler[io.StringIO]) -> None:
        self._handler = handler

    @property
    def text(self) -> str:
        self._handler.acquire()  # worker threads write concurrently
        try:
            return self._handler.stream.getvalue()
        finally:
            self._handler.release()

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.text.splitlines()]

    def of(self, request_id: str, message: str) -> list[dict[str, Any]]:
        return [x for x in self.lines() if x.get("request_id") == request_id and x["message"] == message]

    async def wait_for(self, request_id: str, message: str, within: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if found := self.of(request_id, message):
                return found[0]
            await asyncio.sleep(0.02)
        raise AssertionError(f"no {message!r} log line for {request_id} (is it logged at debug?)")


@contextmanager
def captured_logs(settings: ObservabilitySettings) -> Iterator[Captured]:
    root = logging.getLogger()
    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(make_formatter(settings, "e2e"))
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield Captured(handler)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


async def _exercise(platform: Platform, marker: str) -> tuple[str, str]:
    """A streamed chat completion and a completion carrying ``marker``, a request with a wrong key, and a
    careless log call; returns the two request ids once both requests have finished."""
    auth = {"Authorization": f"Bearer {DEMO_KEY}"}
    chat = {
        "model": GPT,
        "messages": [{"role": "user", "content": f"Remember {marker} for me."}],
        "stream": True,
        "max_tokens": 16,
        "temperature": 0,
    }
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{platform.base_url}/chat/completions", headers=auth, json=chat)
        assert response.status == 200
        lines = [line async for line in response.content]
        chat_id = next(x[4:].decode().strip() for x in lines if x.startswith(b"id: ")).split(":")[0]

        response = await session.post(
            f"{platform.base_url}/completions",
            headers=auth,
            json={"model": GPT, "prompt": f"{marker} is", "max_tokens": 12, "temperature": 0},
        )
        assert response.status == 200
        completion_id = (await response.json())["id"].removeprefix("cmpl-")

        refused = await session.post(
            f"{platform.base_url}/chat/completions",
            headers={"Authorization": f"Bearer {WRONG_KEY}"},
            json={**chat, "stream": False},
        )
        assert refused.status == 401

    logging.getLogger("ingest.auth").warning("key %s", WRONG_KEY)  # a code mistake the pipeline catches
    await platform.results.wait(lambda: all(platform.results.of(r) for r in (chat_id, completion_id)))
    return chat_id, completion_id


async def _assert_logged(logs: Captured, request_ids: tuple[str, ...]) -> list[dict[str, Any]]:
    """The request's accept and finish lines (so logging did happen), with tenant and model."""
    found = []
    for request_id in request_ids:
        for message in ("request accepted", "request finished"):
            line = await logs.wait_for(request_id, message)
            assert line["tenant"] == DEMO_TENANT
            assert line["model"] == GPT
            found.append(line)
    return found


def _assert_no_keys(text: str) -> None:
    for key in KEYS:
        assert key not in text
    assert f"key {REDACTED}" in text  # the careless call was logged, scrubbed


async def test_prompts_completions_and_keys_never_reach_the_logs(
    platform: Platform, workers: list[WorkerService]
) -> None:
    marker = "PURPLE-ELEPHANT-4417"
    with captured_logs(ObservabilitySettings()) as logs:
        request_ids = await _exercise(platform, marker)
        found = await _assert_logged(logs, request_ids)
    text = logs.text
    assert marker not in text
    _assert_no_keys(text)
    assert all("prompt_chars" in x for x in found if x["message"] == "request accepted")
    assert all("completion_chars" in x for x in found if x["message"] == "request finished")


async def test_a_tenant_that_enabled_content_logging_gets_its_prompts_logged(
    platform: Platform, workers: list[WorkerService]
) -> None:
    """The positive control: the same run, the demo tenant enabled, and the marker is there."""
    marker = "ORANGE-GIRAFFE-9021"
    with captured_logs(ObservabilitySettings(log_content_tenants=(DEMO_TENANT,))) as logs:
        request_ids = await _exercise(platform, marker)
        found = await _assert_logged(logs, request_ids)
    text = logs.text
    assert marker in text
    accepted = [x for x in found if x["message"] == "request accepted"]
    assert all(marker in x["prompt"] for x in accepted)
    assert all("completion" in x for x in found if x["message"] == "request finished")
    _assert_no_keys(text)
