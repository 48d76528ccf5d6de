"""Incremental detokenisation and the decode it runs on: streamed deltas add up to the whole text, and the
fast path through the Rust tokenizer gives the same text as transformers' ``decode``."""

from __future__ import annotations

import copy

import pytest

from gpu_workers.detok import IncrementalDetokenizer, decoder_for
from gpu_workers.models import LoadedModel

TEXT = "The sluice gate opens at dawn; über café 東京 — the water 🌊 runs over the stone wall.\n\n  Twice."


def test_the_fast_decode_is_transformers_decode_for_every_prefix(demo_gpt: LoadedModel) -> None:
    tokenizer = demo_gpt.tokenizer
    assert tokenizer.clean_up_tokenization_spaces is False
    fast = decoder_for(tokenizer)
    assert fast.__class__.__name__ == "partial", "demo-gpt's tokenizer takes the fast path"
    ids = list(tokenizer(TEXT)["input_ids"])
    eos = demo_gpt.manifest.eos_token_id
    assert eos is not None
    with_special = [eos, *ids[:5], eos, *ids[5:]]
    for end in range(1, len(with_special) + 1):  # prefixes end mid-character too (the emoji, the CJK)
        window = with_special[:end]
        assert fast(window) == tokenizer.decode(window, skip_special_tokens=True)


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode(minilm: LoadedModel) -> None:
    tokenizer = copy.deepcopy(minilm.tokenizer)  # a WordPiece tokenizer; the session's model stays as is
    ids = list(tokenizer("hello , world ! it ' s fine")["input_ids"])
    assert decoder_for(tokenizer)(ids) == tokenizer.decode(ids, skip_special_tokens=True)
    tokenizer.clean_up_tokenization_spaces = True
    cleaned = tokenizer.decode(ids, skip_special_tokens=True)
    assert cleaned != tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=True), "clean-up changes it"
    assert decoder_for(tokenizer)(ids) == cleaned


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "transformers"])
def test_streamed_deltas_add_up_to_the_whole_text(demo_gpt: LoadedModel, fast: bool) -> None:
    tokenizer = demo_gpt.tokenizer
    decode = (
        decoder_for(tokenizer) if fast else (lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)))
    )
    ids = list(tokenizer(TEXT)["input_ids"])
    detok = IncrementalDetokenizer(decode)
    deltas = [detok.push(token) for token in ids]
    assert "\ufffd" not in "".join(deltas), "an incomplete character is held back, never streamed"
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=True) == detok.text
    assert detok.text == TEXT


def test_a_stream_cut_inside_a_character_flushes_what_was_held_back(demo_gpt: LoadedModel) -> None:
    tokenizer = demo_gpt.tokenizer
    ids = list(tokenizer("water 🌊")["input_ids"])
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    for cut in range(1, len(ids)):
        detok = IncrementalDetokenizer(decoder_for(tokenizer))
        streamed = "".join(detok.push(token) for token in ids[:cut])
        assert streamed + detok.flush() == tokenizer.decode(ids[:cut], skip_special_tokens=True)
    assert whole == "water 🌊"
