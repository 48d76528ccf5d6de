"""A prepared model's manifest promises the context its engines serve, no more, so the edge refuses a longer
request with a 400 before publishing it; and a worker given one anyway (a manifest prepared before) ends it
as ``context_length_exceeded`` on its own, never failing others' requests."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from gpu_workers.embedding import EmbeddingEngine
from gpu_workers.engine import GenerationEngine
from gpu_workers.models import LoadedModel, load_embedding_model, load_generation_model, prepare_hf_dir
from ingest.errors import ContextLengthExceeded, from_finished
from ingest.models import ServedModel
from schemas.events import RequestFinished, SamplingParams
from schemas.manifest import read_manifest
from tests.gpu_workers.test_runners import embedding, embedding_runner, generation, generation_runner, run
from tests.gpu_workers.tiny_hf import decoder_dir, encoder_dir


def test_a_sliding_window_models_manifest_promises_the_window_the_engine_serves(tmp_path: Path) -> None:
    """Found by a review (2026-12-03): a sliding-window model (Mistral-7B-v0.1: 32,768 positions, a 4,096
    window) was recorded with all its positions; the engine serves only the window, so a prompt between the
    two passed the edge and came back a 500."""
    source = decoder_dir(tmp_path / "src", arch="mistral", sliding_window=64)  # 256 positions
    prepared = prepare_hf_dir("sw", source, tmp_path / "models")
    manifest = read_manifest(prepared)
    engine = GenerationEngine(
        load_generation_model(prepared, "cpu").model,
        max_batch_size=1,
        max_context=manifest.max_context,
        traced=False,
        cuda_graphs=False,
    )
    assert manifest.max_context == engine.max_context == 64
    served = ServedModel.load("sw", prepared)
    with pytest.raises(ContextLengthExceeded):
        served.check_context(65, "messages")


def test_a_window_the_config_turns_off_caps_nothing(tmp_path: Path) -> None:
    """Qwen2's config names a ``sliding_window`` it uses only with ``use_sliding_window``: read as
    transformers reads it, as the engine gets it."""
    source = decoder_dir(tmp_path / "src", arch="qwen2", sliding_window=64, use_sliding_window=False)
    # as the hub's Qwen2 configs have it (a window named, use_sliding_window false, no layer_types): the
    # transformers here saves a turned-off window as null, and with that file the test tested nothing
    config = json.loads((source / "config.json").read_text())
    config["sliding_window"] = 64
    config.pop("layer_types", None)
    (source / "config.json").write_text(json.dumps(config))
    assert read_manifest(prepare_hf_dir("qwen", source, tmp_path / "models")).max_context == 256


def refused_as_too_long(result: RequestFinished) -> ContextLengthExceeded:
    """``result`` failed ``context_length_exceeded``, which the edge answers with a 400 (its error, to check
    further)."""
    assert result.status == "failed"
    assert result.error is not None
    assert result.error.code == "context_length_exceeded"
    error = from_finished(result)
    assert isinstance(error, ContextLengthExceeded)
    assert error.status == 400
    return error


def test_a_worker_serving_less_context_than_its_manifest_ends_a_longer_prompt_as_a_400(
    tmp_path: Path,
) -> None:
    """A manifest prepared before the fix still names all 256 positions: the worker ends a prompt past the
    engine's 64 as ``context_length_exceeded``, which the edge answers 400, not 500 (the engine's own
    refusal was ``invalid_request``, a 500 server_error)."""
    source = decoder_dir(tmp_path / "src", arch="mistral", sliding_window=64)
    prepared = prepare_hf_dir("sw", source, tmp_path / "models")
    loaded = load_generation_model(prepared, "cpu")
    old = msgspec.structs.replace(loaded.manifest, max_context=256)  # what it said before
    loaded = LoadedModel(loaded.model, loaded.tokenizer, old, loaded.device, loaded.path)
    engine = GenerationEngine(
        loaded.model, max_batch_size=2, max_context=256, traced=False, cuda_graphs=False
    )
    runner = generation_runner(loaded, engine, max_running=2, max_waiting=4)
    long, short = (
        generation(SamplingParams(max_tokens=4, temperature=0.0), input_ids=[5] * n) for n in (100, 10)
    )
    done = run(runner, [long, short]).finished
    refused_as_too_long(done[long.request_id])
    assert done[short.request_id].status == "completed"


def test_a_roberta_encoder_is_served_the_positions_it_has(tmp_path: Path) -> None:
    """Found by a review (2026-12-03): a RoBERTa-family encoder's positions start after its padding token's,
    so ``max_position_embeddings`` 66 holds 64; 66 were admitted, and an input of 65-66 tokens raised
    ``IndexError`` in the forward. The engine caps itself there too, whatever it is asked."""
    source = encoder_dir(tmp_path / "src", arch="roberta", positions=66)  # a plain save_pretrained
    prepared = prepare_hf_dir("roberta", source, tmp_path / "models", task="embedding")
    served = ServedModel.load("roberta", prepared)
    assert served.manifest.max_context == 64
    with pytest.raises(ContextLengthExceeded):
        served.check_context(65, "input")
    model = load_embedding_model(prepared, "cpu").model
    engine = EmbeddingEngine(model, max_length=66, cuda_graphs=False, traced=False)
    assert engine.max_length == 64
    ids = served.encode([" ".join(["cats"] * 200)], "input")[0]
    assert engine.embed([ids[:63] + ids[-1:]]).shape == (1, 32)


def test_an_encoders_tokenizer_limit_is_its_context(tmp_path: Path) -> None:
    """Without ``sentence_bert_config.json``, sentence-transformers cuts an input at the tokenizer's
    ``model_max_length``; transformers' "no limit" placeholder (1e30) is not a limit."""
    limited = encoder_dir(tmp_path / "limited", model_max_length=32)
    assert read_manifest(prepare_hf_dir("a", limited, tmp_path / "m", task="embedding")).max_context == 32
    unlimited = encoder_dir(tmp_path / "unlimited", model_max_length=int(1e30))
    assert read_manifest(prepare_hf_dir("b", unlimited, tmp_path / "m", task="embedding")).max_context == 64


def test_one_overlong_input_fails_its_request_alone(tmp_path: Path) -> None:
    """A manifest prepared before the fix says 66 for the RoBERTa encoder: the worker refuses a 65-token
    input by itself (``context_length_exceeded``, which the edge answers with a 400 as its own refusal) and
    embeds the request batched with it; before, the batch failed whole with ``engine_error`` for every
    request in it, and three such batches stopped the worker."""
    source = encoder_dir(tmp_path / "src", arch="roberta", positions=66)
    prepared = prepare_hf_dir("roberta", source, tmp_path / "models", task="embedding")
    loaded = load_embedding_model(prepared, "cpu")
    old = msgspec.structs.replace(loaded.manifest, max_context=66)
    loaded = LoadedModel(loaded.model, loaded.tokenizer, old, loaded.device, loaded.path)
    engine = EmbeddingEngine(loaded.model, max_length=66, cuda_graphs=False, traced=False)
    runner = embedding_runner(loaded, engine)
    long, short = embedding(inputs=[[0] + [5] * 63 + [2]]), embedding(inputs=[[0, 5, 6, 2]])
    done = run(runner, [long, short]).finished
    refused_as_too_long(done[long.request_id])  # a 400, not a 500
    assert done[short.request_id].status == "completed"
