"""An embedding model is served with its own sentence-transformers pipeline: the pooling that
``modules.json`` and ``1_Pooling/config.json`` name, and a pipeline the platform does not implement is
refused when the directory is prepared."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest

from gpu_workers.embedding import EmbeddingEngine
from gpu_workers.model_store import ModelError
from gpu_workers.models import load_embedding_model, prepare_hf_dir
from ingest.models import ServedModel
from schemas.manifest import MANIFEST_FILE, read_manifest
from tests.gpu_workers.tiny_hf import encoder_dir

TEXTS = ["hello world, how are you today?", "the quick brown fox", "cats"]

FLAGS = {
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}


def cosines(ours: np.ndarray, reference: np.ndarray) -> list[float]:
    return [
        float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(ours, reference, strict=True)
    ]


@pytest.mark.parametrize("pooling", ["cls", "mean", "lasttoken"])
def test_vectors_are_the_models_own_as_sentence_transformers_encodes_them(
    pooling: str, tmp_path: Path
) -> None:
    """Found by a review (2026-12-03): every embedding model was mean-pooled, whatever its pipeline said,
    and a CLS- or last-token-pooled model's vectors had cosine 0.57-0.63 with its own. The texts are of
    different lengths, so the batch is padded and the last token is not the last column."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    source = encoder_dir(tmp_path / "src", modules=["Pooling", "Normalize"], pooling={FLAGS[pooling]: True})
    prepared = prepare_hf_dir("st", source, tmp_path / "models")
    assert read_manifest(prepared).pooling == pooling
    served = ServedModel.load("st", prepared)
    ids = served.encode(TEXTS, "input")
    model = load_embedding_model(prepared, "cpu").model
    reference = sentence_transformers.SentenceTransformer(str(source), device="cpu").encode(TEXTS)
    eager = EmbeddingEngine(model, cuda_graphs=False, traced=False)
    traced = EmbeddingEngine(model, cuda_graphs=False, traced=True)
    assert eager.pooling == traced.pooling == pooling
    for engine in (eager, traced):
        assert min(cosines(engine.embed(ids), reference)) > 0.9999
    assert traced.traced  # the traced graph pools as the model does too
    raw = eager.embed(ids, normalize=[False, True, False])  # a request's normalize: false still holds
    assert min(cosines(raw, reference)) > 0.9999
    assert abs(float(np.linalg.norm(raw[1])) - 1.0) < 1e-5


@pytest.mark.parametrize(
    ("modules", "pooling", "refusal"),
    [
        (["Pooling", "Dense", "Normalize"], None, "sentence_transformers.models.Dense"),
        (["Pooling"], {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
        (["Pooling"], {"pooling_mode_mean_sqrt_len_tokens": True}, "pooling_mode_mean_sqrt_len_tokens"),
        (["Pooling"], {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "exactly one"),
        (["Normalize"], None, "one Pooling module"),
        # a supported mode set too does not make an unsupported one served: max pooling is still asked for
        (["Pooling"], {"pooling_mode_cls_token": True, "pooling_mode_max_tokens": True}, "exactly one"),
        # the engine pools the transformer's own token vectors: a Normalize before the Pooling is not that
        (["Normalize", "Pooling"], None, "right after its Transformer"),
        # a second transformer would be run by no one: its vectors are not the model's
        (["Pooling", "Transformer"], None, "its one Transformer module"),
    ],
)
def test_a_pipeline_the_platform_does_not_implement_is_refused_when_prepared(
    modules: list[str], pooling: dict[str, bool] | None, refusal: str, tmp_path: Path
) -> None:
    """A module the engine does not run (a ``Dense`` projection, max pooling, ...) would be served as wrong
    vectors without a word: it is refused, naming what is missing."""
    source = encoder_dir(tmp_path / "src", modules=modules, pooling=pooling)
    with pytest.raises(ModelError, match=refusal):
        prepare_hf_dir("st", source, tmp_path / "models")


def test_a_model_without_a_pipeline_and_an_older_manifest_are_mean_pooled(tmp_path: Path) -> None:
    """sentence-transformers mean-pools a plain transformer; a manifest written before ``pooling`` existed
    (MiniLM's, mean-pooled) reads as ``mean`` and its engine pools so."""
    prepared = prepare_hf_dir("plain", encoder_dir(tmp_path / "src"), tmp_path / "models", task="embedding")
    assert read_manifest(prepared).pooling == "mean"
    written = json.loads((prepared / MANIFEST_FILE).read_text())
    del written["pooling"]
    (prepared / MANIFEST_FILE).write_bytes(msgspec.json.encode(written))
    assert read_manifest(prepared).pooling == "mean"
    engine = EmbeddingEngine(load_embedding_model(prepared, "cpu").model, cuda_graphs=False, traced=False)
    assert engine.pooling == "mean"
