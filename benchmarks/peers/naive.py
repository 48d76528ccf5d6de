"""The naive peer: a minimal aiohttp server that calls the model once per request, no batching.

    python benchmarks/peers/naive.py --port 8100

``POST /v1/embeddings`` and ``POST /v1/completions`` (OpenAI bodies, non-streaming), ``GET /readyz``.
Both models live in this process; every model call runs on one dedicated thread (a single-worker
executor, warmed up in that thread), so requests queue for it one at a time. That is the server most
people write first, and the baseline ``benchmarks/online.py`` puts beside the platform. Listens on
127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web
from peer_models import Body, PeerModels

MODELS = web.AppKey("models", PeerModels)
THREAD = web.AppKey("thread", ThreadPoolExecutor)


async def _call(request: web.Request, method: str) -> web.Response:
    body: Body = await request.json()
    models, thread = request.app[MODELS], request.app[THREAD]
    run = getattr(models, method)
    [answer] = await asyncio.get_running_loop().run_in_executor(thread, run, [body])
    return web.json_response(answer)


async def embeddings(request: web.Request) -> web.Response:
    return await _call(request, "embed_many")


async def completions(request: web.Request) -> web.Response:
    body: Body = await request.json()
    if body.get("stream"):
        raise web.HTTPBadRequest(text="the naive peer does not stream")
    return await _call(request, "complete_many")


async def readyz(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


def make_app() -> web.Application:
    thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
    models = thread.submit(PeerModels).result()  # loaded, configured and warmed in the model thread
    thread.submit(models.warm_up).result()
    app = web.Application(client_max_size=8 * 2**20)
    app[MODELS], app[THREAD] = models, thread
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/readyz", readyz)

    async def close(_app: web.Application) -> None:
        thread.shutdown(wait=True)

    app.on_cleanup.append(close)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args()
    web.run_app(make_app(), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
