"""A real headless Chromium for tests, driven over the Chrome DevTools Protocol with aiohttp's websocket.

:func:`render` opens a URL, waits until a JS expression is true, evaluates what the test wants to know,
writes a full-page PNG screenshot, and always kills the browser (its whole process group) at the end::

    page = await render(url, tmp_path / "page.png", evaluate={"charts": "document.querySelectorAll('.js-plotly-plot').length"})
    assert page.console_errors == []
    assert page.values["charts"] == 6

Console errors are ``console.error``/``console.assert`` calls, uncaught exceptions and rejected promises,
and browser log entries of level error (failed loads, Content Security Policy refusals …). The Debian
``chromium`` package must be installed (``source scripts/system-deps.sh``); without it the test fails.
:class:`Chromium` and :class:`Page` are the pieces, for a test that needs more than one look.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import pytest

DEFAULT_WAIT = "document.body.dataset.rendered === '1'"
_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")
_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--remote-debugging-port=0",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-sync",
    "--disable-features=Translate,MediaRouter,OptimizationHints",
    "--hide-scrollbars",
    "--mute-audio",
)

Json = dict[str, Any]


class CdpError(RuntimeError):
    """The browser answered a command with an error, or the connection to it ended."""


class RenderTimeout(TimeoutError):
    """The page did not reach the expected state in time (the message says what it saw)."""


@dataclass(frozen=True)
class Rendered:
    url: str
    screenshot: Path
    console_errors: list[str]
    console: list[str]
    """Every console message and browser log entry, as ``level: text``."""
    requests: list[str]
    """Every URL the page requested, in order."""
    values: dict[str, Any] = field(default_factory=dict)
    """The results of ``render(evaluate=...)``'s expressions, by name, after the wait."""


def chromium_executable() -> str:
    found = shutil.which("chromium")
    if found is None:
        pytest.fail(
            "chromium is not installed, so no page can be rendered: install the Debian package "
            "with `source scripts/system-deps.sh` (apt-get install chromium)",
            pytrace=False,
        )
    return found


class _Connection:
    """One CDP websocket: numbered commands answered by futures, events passed to listeners.

    When the connection ends, every pending command fails (nothing waits forever)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Json]] = {}
        self.listeners: list[Callable[[Json], None]] = []
        self._reader = asyncio.create_task(self._read())

    async def send(
        self, method: str, params: Json | None = None, *, session: str | None = None, timeout_s: float = 30
    ) -> Json:
        if self._reader.done():
            raise CdpError(f"{method}: the browser connection is closed")
        message: Json = {"id": next(self._ids), "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        future: asyncio.Future[Json] = asyncio.get_running_loop().create_future()
        self._pending[message["id"]] = future
        try:
            await self._ws.send_str(json.dumps(message))
            async with asyncio.timeout(timeout_s):
                return await future
        finally:
            self._pending.pop(message["id"], None)

    async def _read(self) -> None:
        try:
            async for msg in self._ws:
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    continue
                data = json.loads(msg.data)
                if "id" in data:
                    future = self._pending.pop(data["id"], None)
                    if future is None or future.done():
                        continue
                    if "error" in data:
                        future.set_exception(CdpError(f"{data['error'].get('message')}: {data['error']}"))
                    else:
                        future.set_result(data.get("result", {}))
                else:
                    for listener in list(self.listeners):
                        listener(data)
        finally:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(CdpError("the browser connection closed"))
            self._pending.clear()

    async def close(self) -> None:
        await self._ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


class Page:
    """One tab: what it logged and requested, and commands on it."""

    def __init__(self, connection: _Connection, session: str) -> None:
        self._cdp = connection
        self._session = session
        self.console_errors: list[str] = []
        self.console: list[str] = []
        self.requests: list[str] = []
        connection.listeners.append(self._on_event)

    async def _send(self, method: str, params: Json | None = None, *, timeout_s: float = 30) -> Json:
        return await self._cdp.send(method, params, session=self._session, timeout_s=timeout_s)

    def _on_event(self, event: Json) -> None:
        if event.get("sessionId") != self._session:
            return
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(_describe(arg) for arg in params.get("args", []))
            self.console.append(f"{params.get('type')}: {text}")
            if params.get("type") in ("error", "assert"):
                self.console_errors.append(f"console.{params.get('type')}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            exception = details.get("exception", {})
            text = exception.get("description") or details.get("text", "exception")
            where = (
                f" ({details.get('url', '')}:{details.get('lineNumber', '?')})" if details.get("url") else ""
            )
            self.console.append(f"exception: {text}{where}")
            self.console_errors.append(f"uncaught: {text}{where}")
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            url = f" ({entry['url']})" if entry.get("url") else ""
            line = f"{entry.get('source', 'log')}: {entry.get('text', '')}{url}"
            self.console.append(f"{entry.get('level')}: {line}")
            if entry.get("level") == "error":
                self.console_errors.append(line)
        elif method == "Network.requestWillBeSent":
            self.requests.append(str(params.get("request", {}).get("url", "")))

    async def enable(self, width: int, height: int) -> None:
        for domain in ("Page", "Runtime", "Log", "Network"):
            await self._send(f"{domain}.enable")
        await self._send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )

    async def navigate(self, url: str) -> None:
        result = await self._send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise CdpError(f"cannot load {url}: {result['errorText']}")

    async def evaluate(self, expression: str, *, timeout_s: float = 30) -> Any:
        """The expression's value (JSON-like; promises are awaited); a thrown error raises CdpError."""
        result = await self._send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            timeout_s=timeout_s,
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise CdpError(f"{expression!r} threw: {text}")
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, *, timeout_s: float) -> None:
        """Poll until ``expression`` is truthy (an expression that throws counts as not yet)."""
        probe = f"(() => {{ try {{ return Boolean({expression}); }} catch (e) {{ return false; }} }})()"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise RenderTimeout(
                    f"{expression!r} was still false after {timeout_s} s; console errors: {self.console_errors}"
                )
            if await self.evaluate(probe, timeout_s=max(remaining, 1.0)):
                return
            await asyncio.sleep(min(0.1, max(remaining, 0)))

    async def screenshot(self, path: Path) -> Path:
        """The whole page (not only the viewport) as a PNG at ``path``."""
        metrics = await self._send("Page.getLayoutMetrics")
        size = metrics.get("cssContentSize") or metrics["contentSize"]
        shot = await self._send(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
            },
        )
        await asyncio.to_thread(_write, path, base64.b64decode(shot["data"]))
        return path


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _describe(arg: Json) -> str:
    if "value" in arg:
        return str(arg["value"])
    return str(arg.get("description") or arg.get("unserializableValue") or arg.get("type", ""))


class Chromium:
    """A headless Chromium process and its DevTools connection: ``async with Chromium() as browser``.

    Leaving the block closes the browser and kills its process group, whatever happened inside."""

    def __init__(self, *, start_timeout_s: float = 30) -> None:
        self._start_timeout_s = start_timeout_s
        self._process: asyncio.subprocess.Process | None = None
        self._profile: tempfile.TemporaryDirectory[str] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._cdp: _Connection | None = None
        self._stderr_task: asyncio.Task[None] | None = None
        self.stderr: list[str] = []
        """The browser's stderr lines (the last 200), for diagnosing a failed start."""

    async def __aenter__(self) -> Chromium:
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _start(self) -> None:
        executable = chromium_executable()
        self._profile = tempfile.TemporaryDirectory(prefix="sluice-chromium-")
        self._process = await asyncio.create_subprocess_exec(
            executable,
            *_FLAGS,
            f"--user-data-dir={self._profile.name}",
            "about:blank",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group, so close() can kill the renderers too
        )
        ws_url = await self._devtools_url(self._process)
        self._stderr_task = asyncio.create_task(self._drain(self._process))
        self._http = aiohttp.ClientSession()
        ws = await self._http.ws_connect(ws_url, max_msg_size=0)
        self._cdp = _Connection(ws)

    async def _devtools_url(self, process: asyncio.subprocess.Process) -> str:
        stream = process.stderr
        if stream is None:
            raise RuntimeError("chromium's stderr is not a pipe")
        try:
            async with asyncio.timeout(self._start_timeout_s):
                while line := (await stream.readline()).decode(errors="replace"):
                    self._keep(line)
                    if found := _LISTENING.search(line):
                        return found.group(1)
        except TimeoutError:
            pass
        stderr = "".join(self.stderr[-20:])
        pytest.fail(f"chromium did not announce its DevTools websocket:\n{stderr}", pytrace=False)

    def _keep(self, line: str) -> None:
        self.stderr.append(line)
        del self.stderr[:-200]

    async def _drain(self, process: asyncio.subprocess.Process) -> None:
        if process.stderr is not None:
            while line := await process.stderr.readline():
                self._keep(line.decode(errors="replace"))

    async def open(self, url: str, *, width: int = 1400, height: int = 1000) -> Page:
        """A new tab on ``url`` (returns once navigation started; wait for the page with ``wait_for``)."""
        if self._cdp is None:
            raise RuntimeError("the browser is not started")
        target = await self._cdp.send("Target.createTarget", {"url": "about:blank"})
        attached = await self._cdp.send(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
        )
        page = Page(self._cdp, attached["sessionId"])
        await page.enable(width, height)
        await page.navigate(url)
        return page

    async def close(self) -> None:
        if self._cdp is not None:
            with contextlib.suppress(CdpError, TimeoutError, aiohttp.ClientError):
                await self._cdp.send("Browser.close", timeout_s=2)
            await self._cdp.close()
            self._cdp = None
        if self._http is not None:
            await self._http.close()
            self._http = None
        process = self._process
        if process is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(3):
                    await process.wait()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the group chromium leads: renderers, zygote, gpu
            await process.wait()
            self._process = None
        if self._stderr_task is not None:
            self._stderr_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stderr_task
            self._stderr_task = None
        if self._profile is not None:
            self._profile.cleanup()
            self._profile = None


async def render(
    url: str,
    screenshot: Path,
    *,
    wait_for_js: str = DEFAULT_WAIT,
    timeout_s: float = 30,
    evaluate: Mapping[str, str] | None = None,
    width: int = 1400,
    height: int = 1000,
) -> Rendered:
    """Open ``url`` in a fresh headless Chromium, wait until ``wait_for_js`` is true, evaluate
    ``evaluate``'s expressions, and write a full-page screenshot to ``screenshot``.

    If the page never gets there, the screenshot is still written (to see why) and :class:`RenderTimeout`
    says what the console said."""
    async with Chromium() as browser:
        page = await browser.open(url, width=width, height=height)
        try:
            await page.wait_for(wait_for_js, timeout_s=timeout_s)
        except RenderTimeout:
            with contextlib.suppress(CdpError, TimeoutError):
                await page.screenshot(screenshot)
            raise
        values = {name: await page.evaluate(expression) for name, expression in (evaluate or {}).items()}
        await page.screenshot(screenshot)
        return Rendered(
            url=url,
            screenshot=screenshot,
            console_errors=list(page.console_errors),
            console=list(page.console),
            requests=list(page.requests),
            values=values,
        )
