"""Drift features of a text that hold none of it: length, writing system, a language guess, refusals.

Pure stdlib, so the worker (which builds :class:`~schemas.events.DriftFeatures`) and tests share one
definition. The language guess is deliberately small: stop-word counts for seven latin-script languages,
good enough to see a traffic mix move from English to German, not a language identifier.
"""

from __future__ import annotations

import functools
import hashlib
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

SCRIPTS = ("latin", "cyrillic", "greek", "arabic", "hebrew", "cjk", "other")
NO_LETTERS = "none"
"""The script and language of text with no letters (digits, punctuation, emoji, nothing). A label, not
None: None is "not measured" (no text at all), whose rising share the drift monitor reads as the feature
pipeline breaking; a shift to prompts of numbers alone read so, where the rollout gate saw a category (a
review). Its letters' non-ASCII share is 0."""

_STOPWORDS: dict[str, frozenset[str]] = {
    "en": frozenset(
        [
            "the",
            "and",
            "of",
            "to",
            "is",
            "in",
            "that",
            "it",
            "for",
            "you",
            "with",
            "on",
            "are",
            "this",
            "be",
            "was",
            "what",
            "how",
        ]
    ),
    "de": frozenset(
        [
            "der",
            "die",
            "das",
            "und",
            "ist",
            "nicht",
            "ich",
            "ein",
            "eine",
            "zu",
            "mit",
            "den",
            "von",
            "sie",
            "auf",
            "wie",
            "was",
        ]
    ),
    "fr": frozenset(
        [
            "le",
            "la",
            "les",
            "et",
            "est",
            "un",
            "une",
            "des",
            "que",
            "pas",
            "je",
            "vous",
            "pour",
            "dans",
            "du",
            "sur",
            "qui",
        ]
    ),
    "es": frozenset(
        [
            "el",
            "la",
            "los",
            "las",
            "y",
            "es",
            "un",
            "una",
            "que",
            "no",
            "por",
            "para",
            "con",
            "del",
            "se",
            "como",
            "qué",
        ]
    ),
    "it": frozenset(
        [
            "il",
            "lo",
            "la",
            "gli",
            "le",
            "e",
            "è",
            "un",
            "una",
            "che",
            "non",
            "per",
            "con",
            "del",
            "di",
            "come",
            "sono",
        ]
    ),
    "pt": frozenset(
        [
            "o",
            "a",
            "os",
            "as",
            "e",
            "é",
            "um",
            "uma",
            "que",
            "não",
            "por",
            "para",
            "com",
            "do",
            "da",
            "como",
            "você",
        ]
    ),
    "nl": frozenset(
        [
            "de",
            "het",
            "een",
            "en",
            "is",
            "van",
            "dat",
            "niet",
            "ik",
            "je",
            "met",
            "op",
            "voor",
            "zijn",
            "wat",
            "hoe",
        ]
    ),
}
_WORD = re.compile(r"[^\W\d_]+", re.UNICODE)
_ASCII_LETTER = re.compile(r"[A-Za-z]")
"""What ``str.isalpha`` accepts among ASCII characters."""
_LANGUAGES_OF: dict[str, tuple[str, ...]] = {
    word: tuple(language for language, stop in _STOPWORDS.items() if word in stop)
    for word in frozenset[str]().union(*_STOPWORDS.values())
}
"""Stop word -> the languages that have it."""
_REFUSAL = re.compile(
    r"\b(i\s*(?:can(?:'|no)?t|cannot|am unable to|won't|will not)\s+(?:help|assist|do|provide|comply)"
    r"|i'm sorry,? but|as an ai\b|i am not able to)",
    re.IGNORECASE,
)


def script_of(char: str) -> str | None:
    """The writing system of one letter (None for anything that is not a letter)."""
    if not char.isalpha():
        return None
    if char.isascii():
        return "latin"
    name = unicodedata.name(char, "")
    for script, prefixes in (
        ("latin", ("LATIN",)),
        ("cyrillic", ("CYRILLIC",)),
        ("greek", ("GREEK",)),
        ("arabic", ("ARABIC",)),
        ("hebrew", ("HEBREW",)),
        ("cjk", ("CJK", "HIRAGANA", "KATAKANA", "HANGUL")),
    ):
        if name.startswith(prefixes):
            return script
    return "other"


_script_of_char = functools.lru_cache(maxsize=8192)(script_of)
"""``script_of`` remembered per character (texts repeat a few hundred characters at most)."""


@dataclass(frozen=True, slots=True)
class TextProfile:
    chars: int
    script: str
    """Dominant script of the letters; :data:`NO_LETTERS` for text with none."""
    non_ascii: float
    """Share of letters outside ASCII (0 for text with no letters)."""
    language: str


def profile(text: str, *, max_chars: int = 4096) -> TextProfile:
    """Profile the first ``max_chars`` characters (the cost stays bounded for long prompts).

    It runs on a worker's model thread for every terminal event, so the per-character work is done in C:
    ASCII text needs one regex search, other text looks up the script of each distinct character once.
    Measured here: 4,096 characters of German 0.68 ms character by character, 0.27 ms so (most of it is
    finding the words); 400 of Japanese 0.24 → 0.03 ms; a 43-character ASCII sentence 16 → 6 us."""
    head = text[:max_chars]
    if head.isascii():  # an ASCII letter is latin, and none is outside ASCII
        if _ASCII_LETTER.search(head) is None:
            return TextProfile(chars=len(text), script=NO_LETTERS, non_ascii=0.0, language=NO_LETTERS)
        return TextProfile(
            chars=len(text), script="latin", non_ascii=0.0, language=guess_language(head, "latin")
        )
    scripts: Counter[str] = Counter()
    non_ascii = 0
    for char, count in Counter(head).items():
        script = _script_of_char(char)
        if script is not None:
            scripts[script] += count
            non_ascii += 0 if char.isascii() else count
    letters = sum(scripts.values())
    if not letters:
        return TextProfile(chars=len(text), script=NO_LETTERS, non_ascii=0.0, language=NO_LETTERS)
    script = max(SCRIPTS, key=lambda s: (scripts[s], -SCRIPTS.index(s)))
    return TextProfile(
        chars=len(text), script=script, non_ascii=non_ascii / letters, language=guess_language(head, script)
    )


def guess_language(text: str, script: str) -> str:
    """A stop-word guess for latin-script text; the script's name for other scripts; ``other`` when no
    language's stop words are there."""
    if script != "latin":
        return script
    words = Counter(map(str.lower, _WORD.findall(text)))
    if not words:
        return "other"
    counts = dict.fromkeys(_STOPWORDS, 0)
    for word, count in words.items():
        for language in _LANGUAGES_OF.get(word, ()):
            counts[language] += count
    best = max(counts, key=counts.__getitem__)  # a tie goes to the language listed first
    return best if counts[best] > 0 else "other"


def is_refusal(text: str) -> bool:
    """Whether an output reads as a refusal ("I can't help with …", "I'm sorry, but …")."""
    return _REFUSAL.search(text[:512]) is not None


def sampled(request_id: str, one_in: int) -> bool:
    """Whether a request is in the 1-in-``one_in`` drift sample: a hash of its id, so the choice is the
    same on every worker and every re-run, and unbiased across tenants and models. ``one_in`` 0 disables."""
    if one_in <= 0:
        return False
    if one_in == 1:
        return True
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, person=b"sluicedrift").digest()
    return int.from_bytes(digest, "big") % one_in == 0
