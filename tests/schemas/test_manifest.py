"""An embedding model's context as its manifest is read: at most sentence-transformers' ``max_seq_length``."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.manifest import (
    MANIFEST_FILE,
    SENTENCE_TRANSFORMERS_CONFIG,
    ChatFormat,
    ModelManifest,
    embedding_context,
    read_manifest,
    write_manifest,
)


@pytest.mark.parametrize(
    ("config", "context"),
    [
        ('{"max_seq_length": 256, "do_lower_case": false}', 256),
        ('{"max_seq_length": 1024}', 512),  # never past what the manifest allows
        ('{"do_lower_case": true}', 512),
        ('{"max_seq_length": null}', 512),
        ('{"max_seq_length": 0}', 512),
        ('{"max_seq_length": "256"}', 512),
        ("[256]", 512),
        ("{not json", 512),
        (None, 512),  # no such file
    ],
)
def test_an_embedding_models_context_is_cut_only_by_a_readable_max_seq_length(
    tmp_path: Path, config: str | None, context: int
) -> None:
    """A config that cannot be read leaves the manifest's context as it is: loading never breaks on it."""
    if config is not None:
        (tmp_path / SENTENCE_TRANSFORMERS_CONFIG).write_text(config)
    assert embedding_context(tmp_path, 512) == context
    write_manifest(tmp_path, ModelManifest(model_id="e", task="embedding", version="v", max_context=512))
    assert read_manifest(tmp_path).max_context == context


def test_a_generation_models_context_is_its_manifests(tmp_path: Path) -> None:
    (tmp_path / SENTENCE_TRANSFORMERS_CONFIG).write_text('{"max_seq_length": 16}')
    write_manifest(tmp_path, ModelManifest(model_id="g", task="generation", version="v", max_context=512))
    assert read_manifest(tmp_path).max_context == 512


def test_a_manifest_that_names_one_end_token_is_read_as_a_set_of_it(tmp_path: Path) -> None:
    """Manifests written before ``eos_token_ids`` name ``eos_token_id`` alone (or null); they still read,
    and a model stops at that token."""
    old = b'{"model_id": "g", "task": "generation", "version": "v", "max_context": 512, "eos_token_id": 0}'
    (tmp_path / MANIFEST_FILE).write_bytes(old)
    manifest = read_manifest(tmp_path)
    assert (manifest.eos_token_ids, manifest.chat.end_of_turn_ids) == (None, None)
    assert manifest.end_token_ids == manifest.chat_end_token_ids == {0}
    (tmp_path / MANIFEST_FILE).write_bytes(old.replace(b"0}", b"null}"))
    assert read_manifest(tmp_path).end_token_ids == frozenset()


def test_a_manifest_keeps_every_end_token_and_the_chat_formats_end_of_turn(tmp_path: Path) -> None:
    manifest = ModelManifest(
        model_id="g",
        task="generation",
        version="v",
        max_context=512,
        eos_token_id=128001,
        eos_token_ids=(128001, 128008, 128009),
        chat=ChatFormat(end_of_turn_ids=(1, 2)),
    )
    write_manifest(tmp_path, manifest)
    read = read_manifest(tmp_path)
    assert read == manifest
    assert read.end_token_ids == {128001, 128008, 128009}
    assert read.chat_end_token_ids == {128001, 128008, 128009, 1, 2}
