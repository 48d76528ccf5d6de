"""The Ray Serve peer: one deployment per model, each batching with ``@serve.batch``, behind Ray's HTTP
proxy, driven by the benchmarks' own load generator (``benchmarks/loadgen.py``) from this process.

    python benchmarks/peers/ray_serve.py [--quick] [--gen-batch 32]          # start, measure, print JSON
    python benchmarks/peers/ray_serve.py --serve-only --port 8200             # just serve (Ctrl-C stops)

Ray is an optional extra (``pip install -e .[bench]``, best in a venv of its own: see
``benchmarks/online.py --help``); ``benchmarks/online.py`` runs this script with that venv's Python
inside a loopback-only network namespace (``unshare -rn``) where it can: Ray's start-up probes cloud
metadata addresses. Ray runs with its dashboard and usage statistics off and a private temp dir.

``/v1/embeddings`` batches up to 64 requests (5 ms wait) into one ``EmbeddingEngine.embed`` call;
``/v1/completions`` batches up to ``--gen-batch`` requests (10 ms wait) into one ``padded_generate`` call
(static batching: a batch runs to its longest ``max_tokens``), non-streaming. Both models are the
platform's, loaded and called as in ``peer_models.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # before Ray is imported

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: loadgen, harness

import loadgen
from peer_models import Body, PeerModels

try:
    import ray
    from ray import serve
    from starlette.responses import JSONResponse
except ModuleNotFoundError as missing:  # its --help too: the classes below are built with Ray's decorators
    sys.exit(
        f"{Path(__file__).name}: Ray Serve is an optional extra and {missing.name} is not installed here: "
        "pip install -e .[bench], best in a venv of its own (see benchmarks/online.py --help, which "
        "runs without it and says so)"
    )

HERE = Path(__file__).resolve().parent


class EmbeddingsPeer:
    def __init__(self) -> None:
        self.models = PeerModels(generation=False)
        self.models.warm_up()

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.005)  # type: ignore[untyped-decorator]
    async def run(self, bodies: list[Body]) -> list[Body]:
        return self.models.embed_many(bodies)  # on the replica's user-code thread, like Ray's examples

    async def __call__(self, request: Any) -> JSONResponse:
        return JSONResponse(await self.run(await request.json()))


class GenerationPeer:
    def __init__(self, max_batch: int) -> None:
        self.models = PeerModels(embeddings=False)
        self.models.warm_up()
        self.run.set_max_batch_size(max_batch)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)  # type: ignore[untyped-decorator]
    async def run(self, bodies: list[Body]) -> list[Body]:
        return self.models.complete_many(bodies)

    async def __call__(self, request: Any) -> JSONResponse:
        body = await request.json()
        if body.get("stream"):
            return JSONResponse({"error": "the Ray peer does not stream"}, status_code=400)
        return JSONResponse(await self.run(body))


def start(port: int, gen_batch: int) -> None:
    """A private single-node Ray (no dashboard), Serve on 127.0.0.1:``port``, both apps deployed and
    healthy (``serve.run`` waits for that)."""
    # Ray's worker processes inherit this environment: they import peer_models and the project from it.
    paths = [str(HERE), str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    ray.init(
        address="local",
        num_cpus=os.cpu_count(),
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=tempfile.mkdtemp(prefix="sluice-ray-"),
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # Replicas claim no CPU so both fit on any machine; torch threads are set by PeerModels, not Ray.
    # max_ongoing_requests (default 5) must let 64 clients' requests reach the batcher.
    options: dict[str, Any] = {"max_ongoing_requests": 256, "ray_actor_options": {"num_cpus": 0}}
    embeddings = serve.deployment(name="embeddings", **options)(EmbeddingsPeer)
    generation = serve.deployment(name="generation", **options)(GenerationPeer)
    serve.run(embeddings.bind(), name="embeddings", route_prefix="/v1/embeddings")
    serve.run(generation.bind(gen_batch), name="generation", route_prefix="/v1/completions")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def drive(url: str, quick: bool) -> dict[str, Any]:
    async with loadgen.client_session() as session:
        return await loadgen.profile_all(session, url, quick)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--gen-batch", type=int, default=32, help="@serve.batch max size for generation")
    parser.add_argument("--port", type=int, default=0, help="Serve's HTTP port (default: a free one)")
    parser.add_argument("--serve-only", action="store_true", help="serve until interrupted; no load")
    args = parser.parse_args()
    port = args.port or free_port()
    started = time.perf_counter()
    start(port, args.gen_batch)
    up_s = time.perf_counter() - started
    try:
        if args.serve_only:
            print(f"Ray Serve peer on http://127.0.0.1:{port} (up in {up_s:.0f} s)", file=sys.stderr)
            signal.signal(signal.SIGTERM, signal.default_int_handler)
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
            return
        profiles = asyncio.run(drive(f"http://127.0.0.1:{port}", args.quick))
    finally:
        serve.shutdown()
        ray.shutdown()
    print(json.dumps({"ray": ray.__version__, "startup_s": up_s, "profiles": profiles}))


if __name__ == "__main__":
    main()
