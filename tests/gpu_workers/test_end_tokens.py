"""The tokens a model's answers end at, as its manifest records them and a worker's runner stops at them.

A model linked from ``SLUICE_MODEL_PATHS`` whose config.json names a list of end tokens (Llama 3.1
Instruct's ``[128001, 128008, 128009]``), or whose generation_config.json names more (Llama 3 Instruct's
``<|eot_id|>``), never stopped at them, and every answer ran on to ``max_tokens`` (a review, 2026-12-03).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest
import torch

from gpu_workers.end_tokens import end_of_turn_ids, end_token_ids, with_end_tokens
from gpu_workers.engine import GenerationEngine
from gpu_workers.models import (
    EOS_TOKEN,
    ROLE_TOKENS,
    LoadedModel,
    load_generation_model,
    prepare_hf_dir,
)
from gpu_workers.runtime import Arrival
from schemas.events import GenerationRequested, SamplingParams
from schemas.ids import uuid7
from schemas.manifest import MANIFEST_FILE, ChatFormat, ModelManifest, read_manifest, write_manifest
from tests.gpu_workers.test_runners import Collected, generation_runner
from tests.gpu_workers.tiny_hf import bpe_tokenizer

CHAT = "<|user|>\nTell me about the river.\n<|assistant|>\n"


def configs(directory: Path, config_eos: object, generation_eos: object | None = None) -> Path:
    """``directory`` with a config.json and (unless ``generation_eos`` is None) a generation_config.json
    naming these end tokens (``"absent"``: no ``eos_token_id`` key)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {"config.json": config_eos, "generation_config.json": generation_eos}
    for name, eos in files.items():
        if eos is not None:
            (directory / name).write_text(json.dumps({} if eos == "absent" else {"eos_token_id": eos}))
    return directory


@pytest.mark.parametrize(
    ("config_eos", "generation_eos", "ends"),
    [
        (0, None, (0,)),  # no generation_config.json
        (0, 0, (0,)),
        ([128001, 128008, 128009], [128001, 128008, 128009], (128001, 128008, 128009)),  # Llama 3.1
        (128001, [128001, 128009], (128001, 128009)),  # Llama 3: <|eot_id|> in generation_config only
        ("absent", 5, (5,)),
        ([], [None, 7, True, -1, "8"], (7,)),  # what is not a token id is no end token
        ("absent", "absent", ()),
    ],
)
def test_the_end_tokens_are_both_configs_ints_or_lists(
    tmp_path: Path, config_eos: object, generation_eos: object, ends: tuple[int, ...]
) -> None:
    assert end_token_ids(configs(tmp_path, config_eos, generation_eos)) == ends


def test_an_unreadable_config_adds_no_end_token(tmp_path: Path) -> None:
    configs(tmp_path, 3)
    (tmp_path / "generation_config.json").write_text("{not json")
    assert end_token_ids(tmp_path) == (3,)


def added(content: str, id_: int, *, special: bool = True) -> dict[str, object]:
    return {"id": id_, "content": content, "special": special, "normalized": False}


def test_the_end_of_turn_is_the_special_tokens_that_mark_a_role(tmp_path: Path) -> None:
    """A special token that is part of every turn without naming a role (a newline) would end every
    answer at once; a plain added token is text the model may write."""
    tokens = [
        added(EOS_TOKEN, 0),
        *(added(token, i) for i, token in enumerate(ROLE_TOKENS, start=1)),
        added("\n", 4),
        added("<|tool|>", 5),  # names no role the edge writes
        added("<|user|>x", 6),  # not in any turn's text
    ]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": tokens, "model": {"vocab": {}}}))
    assert end_of_turn_ids(tmp_path, ChatFormat()) == (1, 2, 3)
    plain = [added(token, i, special=False) for i, token in enumerate(ROLE_TOKENS, start=1)]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": plain}))
    assert end_of_turn_ids(tmp_path, ChatFormat()) == ()
    (tmp_path / "tokenizer.json").unlink()
    assert end_of_turn_ids(tmp_path, ChatFormat()) == ()


def test_a_manifest_written_before_the_end_tokens_gets_them_from_its_directory(tmp_path: Path) -> None:
    """A prepared version is never rewritten: its worker reads what its manifest lacks."""
    configs(tmp_path, [0, 9], 4)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [added("<|user|>", 1)]}))
    old = ModelManifest(model_id="m", task="generation", version="v", max_context=64, eos_token_id=0)
    filled = with_end_tokens(old, tmp_path)
    assert (filled.eos_token_ids, filled.chat.end_of_turn_ids) == ((0, 9, 4), (1,))
    assert (filled.end_token_ids, filled.chat_end_token_ids) == (
        frozenset({0, 9, 4}),
        frozenset({0, 9, 4, 1}),
    )
    recorded = msgspec.structs.replace(filled, eos_token_ids=(0,), chat=ChatFormat(end_of_turn_ids=()))
    assert with_end_tokens(recorded, tmp_path) is recorded  # what a manifest says stands
    # each field is read when it alone is missing: a chat answer must still stop at the next turn
    half = with_end_tokens(msgspec.structs.replace(filled, eos_token_ids=(0,), chat=ChatFormat()), tmp_path)
    assert (half.eos_token_ids, half.chat.end_of_turn_ids) == ((0,), (1,))


def linked(demo_gpt_dir: Path, tmp_path: Path, config_eos: object, generation_eos: object) -> LoadedModel:
    """demo-gpt's files as a Hugging Face directory naming these end tokens, linked and loaded."""
    source = tmp_path / "src"
    shutil.copytree(demo_gpt_dir, source, ignore=shutil.ignore_patterns(MANIFEST_FILE))
    for name, eos in (("config.json", config_eos), ("generation_config.json", generation_eos)):
        data = json.loads((source / name).read_text())
        data["eos_token_id"] = eos
        (source / name).write_text(json.dumps(data))
    return load_generation_model(prepare_hf_dir("my-gpt", source, tmp_path / "models"), device="cpu")


def answer(lm: LoadedModel, ids: list[int], *, chat: bool = False) -> tuple[str | None, str | None, int]:
    """A greedy request of 200 tokens through the worker's runner: its finish reason, text and usage."""
    engine = GenerationEngine(lm.model, max_batch_size=2, max_context=lm.manifest.max_context)
    runner = generation_runner(lm, engine, max_running=2, max_waiting=4)
    event = GenerationRequested(
        tenant="acme",
        model=lm.manifest.model_id,
        request_id=uuid7(),
        source="test",
        model_version=lm.manifest.version,
        input_ids=ids,
        sampling=SamplingParams(max_tokens=200, temperature=0.0),
        chat=chat,
    )
    out = Collected()
    runner.accept(Arrival(event, ("requests", 0), 0), out)
    while not out.finished:
        runner.tick(out)
    result = out.finished[event.request_id]
    return result.finish_reason, result.text, result.usage.completion_tokens


def reference(lm: LoadedModel, ids: list[int]) -> tuple[str, int]:
    """transformers' generate, which stops at generation_config's end tokens: its text and new tokens
    without the end token."""
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=200)  # type: ignore[operator]
    new = out[0, len(ids) :].tolist()
    return str(lm.tokenizer.decode(new, skip_special_tokens=True)), len(new) - 1


@pytest.mark.parametrize(
    ("config_eos", "generation_eos"),
    [([0], [0]), ([0, 3071], [0, 3071]), (3071, [3071, 0]), (None, 0)],
    ids=["a-list-in-config", "llama-3.1-style", "more-in-generation-config", "only-in-generation-config"],
)
def test_a_linked_model_stops_where_generate_stops(
    demo_gpt_dir: Path, tmp_path: Path, config_eos: object, generation_eos: object
) -> None:
    lm = linked(demo_gpt_dir, tmp_path, config_eos, generation_eos)
    assert 0 in read_manifest(lm.path).end_token_ids  # recorded when it was linked
    ids = lm.tokenizer(CHAT).input_ids
    text, generated = reference(lm, ids)
    assert generated < 199, "generate stops at the end token"
    assert answer(lm, ids) == ("stop", text, generated)  # the end token is neither text nor usage


def test_a_version_prepared_before_the_end_tokens_were_recorded_stops_at_them(
    demo_gpt_dir: Path, tmp_path: Path
) -> None:
    """Its manifest says ``eos_token_id: null`` (config.json's list was not an int): the worker reads
    the list when it loads."""
    lm = linked(demo_gpt_dir, tmp_path, [0, 3071], [0, 3071])
    old = msgspec.structs.replace(
        read_manifest(lm.path), eos_token_id=None, eos_token_ids=None, chat=ChatFormat()
    )
    write_manifest(lm.path, old)
    again = load_generation_model(lm.path, device="cpu")
    ids = again.tokenizer(CHAT).input_ids
    text, generated = reference(again, ids)
    assert answer(again, ids) == ("stop", text, generated)


def test_a_templates_end_of_turn_is_the_special_token_its_tokenizer_reads_there(tmp_path: Path) -> None:
    """Where special tokens overlap (``<|end|>`` and ``<|end|><|eos|>``), the tokenizer reads the longest
    one after an answer, so that is the token a model tuned on the template writes to end its turn: an
    answer stopping at the shorter one would never stop, and run on to ``max_tokens``."""
    tok = bpe_tokenizer(["<|end|>", "<|end|><|eos|>", "<|eos|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|end|><|eos|>\n{% endfor %}"
    written = tok.encode("answer<|end|><|eos|>\n").ids
    assert end_of_turn_ids(tmp_path, ChatFormat(template=template)) == (tok.token_to_id("<|end|><|eos|>"),)
    assert tok.token_to_id("<|end|><|eos|>") in written
    assert tok.token_to_id("<|end|>") not in written
