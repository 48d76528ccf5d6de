"""Tiny models built into a temporary cache (a byte-level BPE generation model and a BERT-style WordPiece
embedding model), a fake gateway, and an edge served by aiohttp's test server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from ingest.app import Edge
from ingest.auth import DEMO_KEY, Tenant, TenantDirectory, hash_key
from ingest.batches import BatchRunner
from ingest.context import EdgeContext
from ingest.files import FileStore
from ingest.models import ModelCatalogue
from ingest.settings import EdgeSettings
from schemas.manifest import ModelManifest, SamplingDefaults, current_model_dir, write_manifest
from tests.ingest.fake_batch_log import FakeBatchLog
from tests.ingest.fake_gateway import FakeGateway

GEN = "tiny-gpt"
EMB = "tiny-embed"
OTHER_KEY = "sk-other-tenant"
AUTH = {"Authorization": f"Bearer {DEMO_KEY}"}
OTHER_AUTH = {"Authorization": f"Bearer {OTHER_KEY}"}
WORDS = [
    "hello",
    "world",
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "tell",
    "me",
    "a",
    "story",
    "about",
    "sluice",
    "gates",
]

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[tuple[Client, Edge]]]


def _bpe(path: Path) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        show_progress=False,
        special_tokens=["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    tok.save(str(path))


def _wordpiece(path: Path) -> None:
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    tok.enable_truncation(max_length=4)  # the edge must switch this off and reject instead
    tok.save(str(path))


def _install(cache: Path, manifest: ModelManifest, build: Callable[[Path], None]) -> None:
    version_dir = current_model_dir(cache, manifest.model_id).parent / manifest.version
    version_dir.mkdir(parents=True)
    build(version_dir / "tokenizer.json")
    write_manifest(version_dir, manifest)
    current_model_dir(cache, manifest.model_id).symlink_to(version_dir.name)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    gen = ModelManifest(
        model_id=GEN,
        task="generation",
        version="0123456789ab",
        max_context=64,
        max_output_tokens=16,
        eos_token_id=0,
        sampling=SamplingDefaults(max_tokens=8),
    )
    emb = ModelManifest(
        model_id=EMB, task="embedding", version="ba9876543210", max_context=8, embedding_dim=3
    )
    _install(cache, gen, _bpe)
    _install(cache, emb, _wordpiece)
    return cache


@pytest.fixture(scope="session")
def catalogue(model_cache: Path) -> ModelCatalogue:
    return ModelCatalogue.from_cache(model_cache, [GEN, EMB])


@pytest.fixture
def tenants() -> TenantDirectory:
    return TenantDirectory(
        {
            "demo": Tenant(key_sha256=[hash_key(DEMO_KEY)], allow_ignore_eos=True),
            "other": Tenant(key_sha256=[hash_key(OTHER_KEY)]),
        }
    )


@pytest.fixture
async def gateway() -> AsyncIterator[FakeGateway]:
    fake = FakeGateway()
    yield fake
    fake.release.set()
    await fake.close()


def settings(**overrides: Any) -> EdgeSettings:
    base: dict[str, Any] = {"edge_id": "edge-test", "edge_port": 0, "edge_shutdown_grace_s": 0.2}
    return msgspec.convert({**base, **overrides}, EdgeSettings)


@pytest.fixture
def batch_log() -> FakeBatchLog:
    return FakeBatchLog()


@pytest.fixture
async def make_client(
    catalogue: ModelCatalogue,
    gateway: FakeGateway,
    tenants: TenantDirectory,
    batch_log: FakeBatchLog,
    tmp_path: Path,
) -> AsyncIterator[MakeClient]:
    clients: list[tuple[Client, Edge]] = []

    async def make(**overrides: Any) -> tuple[Client, Edge]:
        edge_settings = settings(**overrides)

        def batches(ctx: EdgeContext) -> BatchRunner:
            store = FileStore(
                tmp_path / "files",
                max_bytes=edge_settings.edge_file_max_bytes,
                ttl_s=edge_settings.edge_file_ttl_s,
                max_tenant_bytes=edge_settings.edge_files_max_bytes_per_tenant,
                max_tenant_files=edge_settings.edge_files_max_per_tenant,
            )
            return BatchRunner(
                log=batch_log,
                settings=edge_settings,
                store=store,
                preparer=ctx.preparer,
                tenants=ctx.tenants,
                exhausted=ctx.gateway.budget_exhausted,
            )

        edge = Edge(edge_settings, gateway, catalogue, tenants, batches=batches)
        client: Client = TestClient(TestServer(edge.app))
        await client.start_server()
        clients.append((client, edge))
        return client, edge

    yield make
    for client, edge in clients:
        await edge.stop()
        await client.close()


@pytest.fixture
async def client(make_client: MakeClient) -> Client:
    made, _ = await make_client()
    return made


async def eventually(check: Callable[[], bool], *, within_s: float = 5.0) -> None:
    """Poll ``check`` until true, failing after ``within_s``."""
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


def parse_sse(text: str) -> list[tuple[str | None, str]]:
    """(id, data) of each SSE event."""
    events = []
    for block in text.strip().split("\n\n"):
        event_id, data = None, []
        for line in block.split("\n"):
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                data.append(line[6:])
        events.append((event_id, "\n".join(data)))
    return events


async def assert_healthy(client: Client, gateway: FakeGateway) -> None:
    """The edge still answers: health check and one small request."""
    before = len(gateway.submitted)
    assert (await client.get("/healthz")).status == 200
    body = {"model": GEN, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    response = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert response.status == 200, await response.text()
    assert len(gateway.submitted) == before + 1
