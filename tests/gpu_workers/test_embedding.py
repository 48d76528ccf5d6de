from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tokenizers

from gpu_workers.embedding import EmbeddingEngine, EmbeddingError
from gpu_workers.models import LoadedModel

SENTENCES = [
    "A man is playing a guitar on stage.",
    "Someone performs music with a guitar.",
    "The stock market fell sharply today.",
    "Shares dropped steeply on the exchange this afternoon, after the central bank spoke.",
    "Hi",
]


@pytest.fixture(scope="module")
def ids(minilm: LoadedModel) -> list[list[int]]:
    edge = tokenizers.Tokenizer.from_file(str(Path(minilm.path) / "tokenizer.json"))
    edge.no_padding()
    edge.no_truncation()
    return [enc.ids for enc in edge.encode_batch(SENTENCES)]


def test_batch_equals_items_and_vectors_are_unit(minilm: LoadedModel, ids: list[list[int]]) -> None:
    engine = EmbeddingEngine(minilm.model)
    batch = engine.embed(ids)
    assert batch.shape == (len(SENTENCES), minilm.manifest.embedding_dim)
    assert batch.dtype == np.float32
    singles = np.stack([engine.embed([item])[0] for item in ids])
    np.testing.assert_allclose(batch, singles, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)


def test_similar_sentences_are_closer(minilm: LoadedModel, ids: list[list[int]]) -> None:
    vectors = EmbeddingEngine(minilm.model).embed(ids)
    cosine = vectors @ vectors.T
    assert cosine[0, 1] > cosine[0, 2] + 0.3
    assert cosine[2, 3] > cosine[2, 0] + 0.3
    assert cosine[0, 1] > cosine[1, 3]


def test_rejects_bad_batches(minilm: LoadedModel) -> None:
    engine = EmbeddingEngine(minilm.model)
    assert engine.embed([]).shape == (0, engine.dim)
    with pytest.raises(EmbeddingError, match="empty"):
        engine.embed([[101, 102], []])
    with pytest.raises(EmbeddingError, match="exceed"):
        engine.embed([[101] * (engine.max_length + 1)])
    with pytest.raises(EmbeddingError, match="vocabulary"):
        engine.embed([[101, 10**6]])
