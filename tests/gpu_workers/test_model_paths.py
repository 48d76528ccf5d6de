"""Directories served from SLUICE_MODEL_PATHS: how their task is told, and what is checked before they are
served (a review, 2026-12-03: a sentence-transformers model whose config names an MLM head could not be
served at all, and broken directories were refused only by the edge or the worker, some not as a
``ModelError``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gpu_workers.model_store import sha256_file
from gpu_workers.models import (
    ModelError,
    load_embedding_model,
    load_generation_model,
    prepare_hf_dir,
    prepare_models,
)
from gpu_workers.settings import WeightsDtype, WorkerSettings
from schemas.manifest import MANIFEST_FILE, SamplingDefaults, read_manifest
from schemas.settings import PlatformSettings, model_path_entry


def copy_source(prepared: Path, target: Path) -> Path:
    """A plain Hugging Face directory with the files of a prepared one (links followed, no manifest)."""
    shutil.copytree(prepared, target, symlinks=False, ignore=shutil.ignore_patterns(MANIFEST_FILE))
    return target


def set_config(source: Path, **values: object) -> None:
    config = json.loads((source / "config.json").read_text())
    config.update(values)
    (source / "config.json").write_text(json.dumps(config))


def test_a_sentence_transformers_dir_is_an_embedding_model_whatever_head_its_config_names(
    minilm_source: Path, tmp_path: Path
) -> None:
    source = copy_source(minilm_source, tmp_path / "st-mlm")
    set_config(source, architectures=["BertForMaskedLM"])  # kept from the MLM checkpoint it was tuned from
    settings = PlatformSettings(models=(), model_paths=(f"st-mlm={source}",), cache_dir=str(tmp_path))
    prepared = prepare_models(settings)
    assert read_manifest(prepared["st-mlm"]).task == "embedding"


def test_a_model_paths_entry_can_name_the_task(minilm_source: Path, tmp_path: Path) -> None:
    source = copy_source(minilm_source, tmp_path / "plain")
    (source / "modules.json").unlink()
    (source / "sentence_bert_config.json").unlink()
    set_config(source, architectures=["BertForPreTraining"])
    with pytest.raises(ModelError, match=r"id:embedding=/path"):
        prepare_models(PlatformSettings(models=(), model_paths=(f"plain={source}",), cache_dir=str(tmp_path)))
    settings = PlatformSettings(
        models=(), model_paths=(f"plain:embedding={source}",), cache_dir=str(tmp_path)
    )
    assert settings.served_models() == ("plain",)
    assert read_manifest(prepare_models(settings)["plain"]).task == "embedding"


def test_a_model_paths_entry_is_parsed_without_mistaking_a_colon_in_its_path() -> None:
    assert model_path_entry("m=/data/run:3/model:embedding") == ("m", "/data/run:3/model:embedding", None)
    assert model_path_entry(" m:generation = /x ") == ("m", "/x", "generation")
    with pytest.raises(ValueError, match="not one of generation, embedding"):
        model_path_entry("m:chat=/x")
    with pytest.raises(ValueError, match="SLUICE_MODEL_PATHS"):
        PlatformSettings(models=(), model_paths=("m:chat=/x",))


def test_a_dir_without_tokenizer_json_is_refused_when_prepared(demo_gpt_dir: Path, tmp_path: Path) -> None:
    source = copy_source(demo_gpt_dir, tmp_path / "no-tokenizer")
    (source / "tokenizer.json").unlink()  # e.g. a repo with a sentencepiece tokenizer.model only
    with pytest.raises(ModelError, match=r"no tokenizer\.json"):
        prepare_hf_dir("no-tokenizer", source, tmp_path / "models")


def test_a_dir_with_truncated_weights_is_refused_when_prepared(demo_gpt_dir: Path, tmp_path: Path) -> None:
    source = copy_source(demo_gpt_dir, tmp_path / "truncated")
    weights = source / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ModelError, match="truncated"):
        prepare_hf_dir("truncated", source, tmp_path / "models")


def test_a_dir_that_needs_its_own_code_is_refused_when_prepared(demo_gpt_dir: Path, tmp_path: Path) -> None:
    source = copy_source(demo_gpt_dir, tmp_path / "remote-code")
    set_config(source, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    with pytest.raises(ModelError, match="trust_remote_code"):
        prepare_hf_dir("remote-code", source, tmp_path / "models")


def test_weights_that_fail_to_load_are_a_model_error(demo_gpt_dir: Path, tmp_path: Path) -> None:
    """Weights spoilt after prepare (the manifest's hashes updated to match) reach safetensors, whose
    SafetensorError is no OSError: it must still be a ModelError, so the worker reports the model as
    unloadable on the control topic."""
    source = copy_source(demo_gpt_dir, tmp_path / "spoilt")
    prepared = prepare_hf_dir("spoilt", source, tmp_path / "models")
    weights = source / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    manifest = json.loads((prepared / MANIFEST_FILE).read_text())
    manifest["files"]["model.safetensors"] = sha256_file(weights)
    (prepared / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(ModelError, match="does not load"):
        load_generation_model(prepared, "cpu")


@pytest.mark.parametrize(("dtype", "expected"), [("auto", torch.float32), ("bfloat16", torch.bfloat16)])
def test_the_weights_load_in_the_configured_dtype(
    demo_gpt_dir: Path, minilm_source: Path, tmp_path: Path, dtype: WeightsDtype, expected: torch.dtype
) -> None:
    """``auto`` keeps float32 on a CPU (the checkpoint's dtype on a GPU); a named dtype is used anywhere
    (every checkpoint was loaded as float32, twice a bf16 model's memory on a GPU: a review, 2026-12-03)."""
    generation = load_generation_model(demo_gpt_dir, "cpu", dtype)
    assert next(generation.model.parameters()).dtype == expected
    embedding = load_embedding_model(
        prepare_hf_dir("minilm", minilm_source, tmp_path / "models"), "cpu", dtype
    )
    assert next(embedding.model.parameters()).dtype == expected
    assert WorkerSettings().worker_dtype == "auto"


def test_a_linked_model_answers_up_to_its_context_with_its_own_sampling_defaults(
    demo_gpt_dir: Path, tmp_path: Path
) -> None:
    """Not demo-gpt's 64 tokens by default and 256 at most (a review, 2026-12-03); generation_config.json's
    sampling defaults as vLLM takes them, a value the manifest cannot hold left out."""
    source = copy_source(demo_gpt_dir, tmp_path / "linked")
    plain = read_manifest(prepare_hf_dir("plain", source, tmp_path / "models"))
    assert plain.max_output_tokens == plain.max_context
    assert plain.sampling == SamplingDefaults(temperature=1.0, top_p=1.0, top_k=0, max_tokens=None)
    (source / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0, "top_k": 20, "max_new_tokens": 100})
    )
    tuned = read_manifest(prepare_hf_dir("tuned", source, tmp_path / "models"))
    assert tuned.sampling == SamplingDefaults(temperature=0.6, top_p=1.0, top_k=20, max_tokens=100)
