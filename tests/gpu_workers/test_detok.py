"""Incremental detokenisation and the decode it runs on: streamed deltas add up to the whole text, and the
fast path through the Rust tokenizer gives the same text as transformers' ``decode``."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from gpu_workers.detok import (
    Detokenizer,
    IncrementalDetokenizer,
    StreamDetokenizer,
    decoder_for,
    detokenizer_for,
)
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


KINDS = ["rust-stream", "window-fast", "window-transformers"]


def detokenizers(lm: LoadedModel, kind: str) -> Callable[[], Detokenizer]:
    """The runner's detokenizer (``rust-stream`` for demo-gpt), or the Python window over either decode."""
    tokenizer = lm.tokenizer
    if kind == "rust-stream":
        new = detokenizer_for(tokenizer)
        assert isinstance(new(), StreamDetokenizer), "demo-gpt's tokenizer streams in Rust"
        return new
    decode = (
        decoder_for(tokenizer)
        if kind == "window-fast"
        else (lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)))
    )
    return lambda: IncrementalDetokenizer(decode)


@pytest.mark.parametrize("kind", KINDS)
def test_streamed_deltas_add_up_to_the_whole_text(demo_gpt: LoadedModel, kind: str) -> None:
    tokenizer = demo_gpt.tokenizer
    ids = list(tokenizer(TEXT)["input_ids"])
    detok = detokenizers(demo_gpt, kind)()
    deltas = [detok.push(token) for token in ids]
    assert "\ufffd" not in "".join(deltas), "an incomplete character is held back, never streamed"
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=True) == detok.text
    assert detok.text == TEXT
    assert detok.ids == ids


@pytest.mark.parametrize("kind", KINDS)
def test_every_prefix_streams_what_decode_gives_it(demo_gpt: LoadedModel, kind: str) -> None:
    """Special tokens among the text, characters cut mid-byte: after each token, the text streamed so far
    plus a flush is ``decode`` of the tokens so far."""
    tokenizer = demo_gpt.tokenizer
    eos = demo_gpt.manifest.eos_token_id
    assert eos is not None
    ids = list(tokenizer(TEXT)["input_ids"])
    with_special = [eos, *ids[:5], eos, *ids[5:], eos]
    new = detokenizers(demo_gpt, kind)
    for end in range(1, len(with_special) + 1):
        detok = new()
        streamed = "".join(detok.push(token) for token in with_special[:end])
        assert streamed + detok.flush() == tokenizer.decode(with_special[:end], skip_special_tokens=True)


@pytest.mark.parametrize("kind", KINDS)
def test_chunks_caught_up_at_once_stream_what_decode_gives_them(demo_gpt: LoadedModel, kind: str) -> None:
    """What the runner does for a streamed request without stop strings: it appends a chunk's tokens, then
    decodes them in one call. After every chunk (cut anywhere, special tokens among them) the text so far
    plus a flush is ``decode`` of the tokens so far, and a chunk that does not end inside a character
    holds nothing back."""
    tokenizer = demo_gpt.tokenizer
    eos = demo_gpt.manifest.eos_token_id
    assert eos is not None
    ids = list(tokenizer(TEXT)["input_ids"])
    with_special = [eos, *ids[:5], eos, *ids[5:], eos]
    new = detokenizers(demo_gpt, kind)
    rng = random.Random(3)
    held = 0
    for _ in range(40):
        detok = new()
        streamed, end = "", 0
        while end < len(with_special):
            step = rng.randint(1, 9)
            detok.ids.extend(with_special[end : end + step])
            end += step
            streamed += detok.catch_up()
            whole = str(tokenizer.decode(with_special[:end], skip_special_tokens=True))
            assert whole.startswith(streamed)
            assert "\ufffd" not in streamed
            if whole.endswith("\ufffd"):
                held += 1
            else:
                assert streamed == whole
        assert detok.catch_up() == "", "nothing new, nothing to say"
        assert streamed + detok.flush() == TEXT == detok.text
        assert detok.ids == with_special
    assert held > 0, "some chunks ended inside a character (the emoji, the CJK)"


@pytest.mark.parametrize("kind", KINDS)
def test_tokens_appended_without_push_are_decoded_by_flush(demo_gpt: LoadedModel, kind: str) -> None:
    """What the runner does for a request that needs no streamed text: one decode at the end."""
    ids = list(demo_gpt.tokenizer(TEXT)["input_ids"])
    detok = detokenizers(demo_gpt, kind)()
    detok.ids.extend(ids)
    assert detok.flush() == TEXT == detok.text


def test_a_tokenizer_that_cleans_up_spaces_detokenizes_in_python(minilm: LoadedModel) -> None:
    tokenizer = copy.deepcopy(minilm.tokenizer)
    tokenizer.clean_up_tokenization_spaces = True
    detok = detokenizer_for(tokenizer)()
    assert isinstance(detok, IncrementalDetokenizer)
    ids = list(tokenizer("hello , world ! it ' s fine")["input_ids"])
    detok.ids.extend(ids)
    assert detok.flush() == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_stream_cut_inside_a_character_flushes_what_was_held_back(demo_gpt: LoadedModel) -> None:
    tokenizer = demo_gpt.tokenizer
    ids = list(tokenizer("water 🌊")["input_ids"])
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    for kind in KINDS:
        for cut in range(1, len(ids)):
            detok = detokenizers(demo_gpt, kind)()
            streamed = "".join(detok.push(token) for token in ids[:cut])
            assert streamed + detok.flush() == tokenizer.decode(ids[:cut], skip_special_tokens=True), kind
    assert whole == "water 🌊"


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-style tokenizer: byte-fallback tokens <0x00>..<0xFF>, a few words, a decoder that fuses bytes
    and strips the first space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for word in ["▁the", "▁water", "▁", "a", "b", "é"]:
        vocab[word] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend, clean_up_tokenization_spaces=False, eos_token="</s>"
    )


def test_bytes_the_rust_stream_refuses_go_on_through_the_window_method() -> None:
    """The Rust stream raises when a token changes text it already returned (bytes that complete, or fail
    to complete, a character). A sampled model can produce any bytes: the request goes on with the window
    method from there instead of the worker failing, and its text is what the window method alone gives."""
    tokenizer = byte_fallback_tokenizer()
    new = detokenizer_for(tokenizer)
    window = decoder_for(tokenizer)
    rng = random.Random(7)
    fell_back = 0
    for _ in range(300):
        ids = [rng.choice([rng.randrange(3, 259), rng.randrange(259, 265), 2]) for _ in range(8)]
        cuts = [*sorted(rng.sample(range(1, 8), rng.randint(0, 3))), 8]
        for whole_chunks in (False, True):  # token by token, or a chunk's tokens at once
            detok = new()
            assert isinstance(detok, StreamDetokenizer)
            if whole_chunks:
                streamed, start = "", 0
                for cut in cuts:
                    detok.ids.extend(ids[start:cut])
                    streamed += detok.catch_up()  # never raises
                    start = cut
            else:
                streamed = "".join(detok.push(token) for token in ids)  # never raises
            assert streamed + detok.flush() == detok.text
            assert detok.ids == ids
            fell_back += detok._window is not None
            if detok._window is None:
                # the window method's deltas and text, which are not always decode's for such bytes ("V"
                # then an invalid byte: decode makes both U+FFFD, but "V" was already streamed)
                alone = IncrementalDetokenizer(window)
                if whole_chunks:
                    start, alone_streamed = 0, ""
                    for cut in cuts:
                        alone.ids.extend(ids[start:cut])
                        alone_streamed += alone.catch_up()
                        start = cut
                else:
                    alone_streamed = "".join(alone.push(token) for token in ids)
                assert alone_streamed == streamed
                alone.flush()
                assert alone.text == detok.text
    assert fell_back > 20, "the Rust stream refused some of these sequences"
    text = "the water é"
    detok = new()
    ids = list(tokenizer(text)["input_ids"])
    assert "".join(detok.push(token) for token in ids) + detok.flush() == tokenizer.decode(ids)


def test_a_chunk_the_rust_stream_refuses_is_streamed_by_the_window_method() -> None:
    """A stray continuation byte after bytes already streamed makes the Rust stream refuse the chunk that
    holds it (the byte decoder turns the whole run of bytes into U+FFFD). The window takes over from the
    tokens before that chunk, so the chunk's own text is streamed with it, not held back until the end."""
    tokenizer = byte_fallback_tokenizer()
    detok = detokenizer_for(tokenizer)()
    byte = tokenizer.get_vocab()
    detok.ids.extend([byte["<0x1A>"], byte["<0x4D>"]])
    assert detok.catch_up() == "\x1aM"
    detok.ids.extend([byte["<0xBA>"], *tokenizer("the water")["input_ids"]])
    delta = detok.catch_up()
    assert isinstance(detok, StreamDetokenizer)
    assert detok._window is not None, "the Rust stream refused the chunk"
    assert delta.endswith("ater")
    assert detok.flush() == ""
    assert detok.text == "\x1aM" + delta
