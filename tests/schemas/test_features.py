"""Text profiles for drift features: scripts, the language guess, refusals, the sample hash."""
# ruff: noqa: RUF001  (non-latin scripts are the point of these tests)

from __future__ import annotations

import pytest

from schemas.features import guess_language, is_refusal, profile, sampled, script_of


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


def test_text_without_letters_has_no_script() -> None:
    found = profile("1234 !!")
    assert (found.script, found.non_ascii, found.language) == (None, None, None)
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
