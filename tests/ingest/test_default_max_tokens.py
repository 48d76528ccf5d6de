"""A request that names no ``max_tokens`` to a model whose manifest has no default (a linked Hugging Face
model) gets the room its prompt leaves in the context, within the model's output limit and the tenant's
token limits; one that names ``max_tokens`` keeps it while it fits (a review, 2026-12-03: every answer of a
linked model stopped at demo-gpt's 64 tokens, and any ``max_tokens`` above 256 was lowered to 256)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from ingest.auth import Tenant
from ingest.models import ModelCatalogue
from ingest.prepare import Preparer
from ingest.quota import Limits
from schemas.events import GenerationRequested, ReplyTo
from schemas.manifest import ModelManifest, SamplingDefaults
from tests.ingest.conftest import GEN, _bpe, _install, settings

LINKED = "linked-gpt"


@pytest.fixture(scope="module")
def preparer(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Preparer:
    cache = tmp_path_factory.mktemp("linked")
    linked = ModelManifest(
        model_id=LINKED,
        task="generation",
        version="00000000aaaa",
        max_context=64,
        max_output_tokens=64,
        eos_token_id=0,
        sampling=SamplingDefaults(max_tokens=None),
    )
    _install(cache, linked, _bpe)
    catalogue = ModelCatalogue.from_cache(cache, [LINKED])
    demo_like = ModelCatalogue.from_cache(model_cache, [GEN])
    both = ModelCatalogue([catalogue.get(LINKED), demo_like.get(GEN)])
    return Preparer(both, settings(), ReplyTo(topic="r", partition=0, edge_id="e"))


def max_tokens(preparer: Preparer, model: str, tenant: Tenant | None = None, **body: Any) -> tuple[int, int]:
    raw = msgspec.json.encode({"model": model, "prompt": "hello world the quick brown fox", **body})
    event = preparer.prepare_sync("completion", raw, tenant or Tenant(name="t"), None, None).event
    assert isinstance(event, GenerationRequested)
    return event.sampling.max_tokens, len(event.input_ids)


def test_no_max_tokens_is_the_room_left_in_the_context(preparer: Preparer) -> None:
    tokens, prompt = max_tokens(preparer, LINKED)
    assert tokens == 64 - prompt


def test_a_named_max_tokens_is_kept_while_it_fits(preparer: Preparer) -> None:
    assert max_tokens(preparer, LINKED, max_tokens=40)[0] == 40
    tokens, prompt = max_tokens(preparer, LINKED, max_tokens=1000)
    assert tokens == 64 - prompt


def test_no_max_tokens_stays_within_the_tenants_token_limits(preparer: Preparer) -> None:
    """A request reserves prompt + ``max_tokens``: a default past the tenant's token limit would be refused
    as ``tokens_exceed_limit`` though the client asked for nothing."""
    per_model = Tenant(name="t", model_limits={LINKED: Limits(tokens_per_min=20)})
    tokens, prompt = max_tokens(preparer, LINKED, per_model)
    assert tokens == 20 - prompt
    overall = Tenant(name="t", tokens_per_min=30)
    tokens, prompt = max_tokens(preparer, LINKED, overall)
    assert tokens == 30 - prompt


def test_a_manifest_default_is_kept(preparer: Preparer) -> None:
    assert max_tokens(preparer, GEN)[0] == 8  # demo-gpt's manifests name theirs (64)


def test_no_max_tokens_is_at_least_one_where_the_prompt_alone_takes_the_tenants_limit(
    preparer: Preparer,
) -> None:
    """A request event's ``max_tokens`` is at least 1 on the wire (``SamplingParams``): a default of 0
    would go out as an event no worker decodes (``Expected int >= 1``). At 1, the tenant's quota decides
    (prompt + 1 is past its limit: ``tokens_exceed_limit``)."""
    _, prompt = max_tokens(preparer, LINKED)
    for limit in (prompt, prompt - 1):
        tight = Tenant(name="t", model_limits={LINKED: Limits(tokens_per_min=limit)})
        tokens, _ = max_tokens(preparer, LINKED, tight)
        assert tokens == 1
