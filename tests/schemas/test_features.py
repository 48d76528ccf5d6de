"""Text profiles for drift features: scripts, the language guess, refusals, the sample hash."""
# ruff: noqa: RUF001  (non-latin scripts are the point of these tests)

from __future__ import annotations

import random
from collections import Counter

import pytest

from schemas import features
from schemas.features import (
    NO_LETTERS,
    SCRIPTS,
    TextProfile,
    guess_language,
    is_refusal,
    profile,
    sampled,
    script_of,
)


@pytest.mark.parametrize(
    ("text", "script", "language"),
    [
        ("Tell me about the river and the weather.", "latin", "en"),
        ("Erzähl mir bitte etwas über den Fluss und das Wetter, wie ist es?", "latin", "de"),
        ("Dis-moi quelque chose sur la rivière et le temps qu'il fait.", "latin", "fr"),
        ("Расскажи мне о реке и погоде.", "cyrillic", "cyrillic"),
        ("川と天気について教えてください。", "cjk", "cjk"),
        ("Πες μου για το ποτάμι.", "greek", "greek"),
        ("xyzzy plugh", "latin", "other"),
    ],
)
def test_profile_finds_the_script_and_guesses_the_language(text: str, script: str, language: str) -> None:
    found = profile(text)
    assert found.chars == len(text)
    assert found.script == script
    assert found.language == language


@pytest.mark.parametrize("text", ["1234 !!", "", "   ", "12 € 😀", "٣٤٥"])
def test_text_without_letters_is_its_own_category_not_unmeasured(text: str) -> None:
    """None is "not measured" (no text), whose rising share the drift monitor reads as the feature
    pipeline breaking: prompts of numbers alone read so (a review); they are a category, as the rollout
    gate saw them."""
    found = profile(text)
    assert (found.script, found.non_ascii, found.language) == (NO_LETTERS, 0.0, NO_LETTERS)
    assert script_of("7") is None


def test_non_ascii_share_counts_letters_only() -> None:
    assert profile("abcd").non_ascii == 0.0
    assert profile("äbc, 1234").non_ascii == pytest.approx(1 / 3)


def test_profile_cost_is_bounded_for_long_text() -> None:
    found = profile("der die das " * 100_000, max_chars=1000)
    assert found.chars == 1_200_000
    assert found.language == "de"


def test_refusals() -> None:
    assert is_refusal("I'm sorry, but I can't help with that.")
    assert is_refusal("I cannot assist with this request")
    assert not is_refusal("The river runs to the sea.")
    assert guess_language("", "latin") == "other"


def test_sampling_is_a_stable_share_of_request_ids() -> None:
    ids = [f"req-{i}" for i in range(20_000)]
    picked = [i for i in ids if sampled(i, 20)]
    assert 800 < len(picked) < 1200
    assert picked == [i for i in ids if sampled(i, 20)], "the same choice on every call"
    assert all(sampled(i, 1) for i in ids[:10])
    assert not any(sampled(i, 0) for i in ids[:10])


def profile_char_by_char(text: str, max_chars: int = 4096) -> TextProfile:
    """The definition ``profile`` keeps, one character at a time (what it did before its work moved to C)."""
    head = text[:max_chars]
    scripts = Counter(s for s in map(script_of, head) if s is not None)
    letters = sum(scripts.values())
    if not letters:
        return TextProfile(chars=len(text), script=NO_LETTERS, non_ascii=0.0, language=NO_LETTERS)
    script = max(SCRIPTS, key=lambda s: (scripts[s], -SCRIPTS.index(s)))
    non_ascii = sum(1 for c in head if c.isalpha() and not c.isascii()) / letters
    if script != "latin":
        language = script
    else:
        words = [w.lower() for w in features._WORD.findall(head)]
        stopwords = features._STOPWORDS
        counts = {lang: sum(1 for w in words if w in stop) for lang, stop in stopwords.items()}
        best = max(counts, key=lambda lang: (counts[lang], -list(stopwords).index(lang)))
        language = best if counts[best] > 0 and words else "other"
    return TextProfile(chars=len(text), script=script, non_ascii=non_ascii, language=language)


def test_profile_equals_its_character_by_character_definition() -> None:
    stop = sorted(frozenset[str]().union(*features._STOPWORDS.values()))
    pieces = [
        *"abcXYZ 0123 .,!?'-_\n\t",
        *"äöüßéèçñøÅÆİı",  # latin beyond ASCII, and letters whose lower case changes their length
        *"дождьЖЯ",
        *"ποτάμιΩ",
        *"川天気東京",
        *"ひらカタ한글",
        *"مرحبا",
        *"שלום",
        *"ＡＢｃ",  # fullwidth latin: "other" by name
        "\u0301",  # a combining mark
        "🙂",
        *(f" {w} " for w in stop),
        *(f" {w.upper()} " for w in stop[:40]),
    ]
    rng = random.Random(12)
    texts = ["", " ", "1234", "der die das", "DER Die das THE the"]
    texts += ["".join(rng.choices(pieces, k=rng.randint(1, 60))) for _ in range(3000)]
    texts += ["".join(rng.choices(pieces, k=3000)) for _ in range(20)]  # past max_chars
    for text in texts:
        assert profile(text) == profile_char_by_char(text), text
        assert profile(text, max_chars=7) == profile_char_by_char(text, max_chars=7), text
