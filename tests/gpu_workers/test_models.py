from __future__ import annotations

import json
import math
import os
import shutil
import sys
import types
from pathlib import Path

import msgspec
import pytest
import tokenizers
import torch
from transformers.utils import import_utils

from gpu_workers.models import (
    DEMO_GPT_ID,
    ROLE_TOKENS,
    DemoRecipe,
    LoadedModel,
    ModelError,
    add_version,
    build_demo_gpt,
    configure_openmp,
    configure_torch_threads,
    default_torch_threads,
    demo_corpus,
    list_versions,
    load_embedding_model,
    load_generation_model,
    prepare_hf_dir,
    prepare_models,
    verify_model_dir,
)
from gpu_workers.padding import decode_bias
from schemas.manifest import MANIFEST_FILE, current_model_dir, read_manifest
from schemas.settings import PlatformSettings

TINY = DemoRecipe(corpus_documents=60, stdlib_modules=("textwrap.py",), vocab_size=400, seq_len=32, steps=4)


def test_demo_build_is_cached_content_addressed_and_current(
    demo_gpt_dir: Path, shared_models_root: Path
) -> None:
    messages: list[str] = []
    again = build_demo_gpt(shared_models_root, messages.append)
    assert again == demo_gpt_dir
    assert messages == [f"demo-gpt: cached build {demo_gpt_dir.name}"]
    current = shared_models_root / DEMO_GPT_ID / "current"
    assert current.is_symlink()
    assert os.readlink(current) == demo_gpt_dir.name  # relative: the cache directory can move
    manifest = read_manifest(demo_gpt_dir)
    assert manifest.version == demo_gpt_dir.name
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(manifest.files)


def test_demo_manifest_and_tokenizer(demo_gpt: LoadedModel, demo_gpt_dir: Path) -> None:
    manifest = demo_gpt.manifest
    assert (manifest.model_id, manifest.task, manifest.max_context, manifest.max_output_tokens) == (
        DEMO_GPT_ID, "generation", 512, 256,
    )  # fmt: skip
    edge = tokenizers.Tokenizer.from_file(str(demo_gpt_dir / "tokenizer.json"))  # what the edge uses
    assert 2000 <= edge.get_vocab_size() <= 4096
    assert len(demo_gpt.tokenizer) == edge.get_vocab_size() == demo_gpt.model.config.vocab_size
    assert manifest.eos_token_id == edge.token_to_id("<|endoftext|>") == demo_gpt.tokenizer.eos_token_id
    chat = manifest.chat.turn.format(role="user", content="Hello there.") + manifest.chat.assistant_prefix
    ids = edge.encode(chat).ids
    assert ids == demo_gpt.tokenizer(chat).input_ids
    assert edge.token_to_id("<|user|>") in ids
    assert edge.token_to_id("<|assistant|>") in ids
    for token in ROLE_TOKENS:
        assert edge.encode(token).ids == [edge.token_to_id(token)]
    assert edge.decode(edge.encode("Return the value, please!").ids) == "Return the value, please!"


def test_demo_model_learned_something(demo_gpt: LoadedModel) -> None:
    """Loss on held-out text of the corpus' kind is far below a uniform guess (ln 3072 ≈ 8.0)."""
    text = " ".join(demo_corpus(seed=999, documents=20))
    ids = torch.tensor([demo_gpt.tokenizer(text).input_ids[:256]], device=demo_gpt.device)
    with torch.inference_mode():
        loss = float(demo_gpt.model(input_ids=ids, labels=ids).loss)
    assert loss < 0.5 * math.log(demo_gpt.model.config.vocab_size)


def test_demo_build_is_deterministic(tmp_path: Path) -> None:
    first = build_demo_gpt(tmp_path / "a", recipe=TINY)
    second = build_demo_gpt(tmp_path / "b", recipe=TINY)
    assert first.name == second.name
    assert read_manifest(first).files == read_manifest(second).files
    manifest = read_manifest(first)  # its end tokens recorded: <|endoftext|>, and the role tokens for a chat
    assert (manifest.eos_token_ids, manifest.chat.end_of_turn_ids) == ((0,), (1, 2, 3))


def test_a_prepared_model_is_readable_by_any_user_that_serves_it(tmp_path: Path) -> None:
    """Found by an audit: ``save_pretrained`` writes the weights 0600, so the image, whose models are
    prepared as root and served as uid 10001, could not load demo-gpt."""
    built = build_demo_gpt(tmp_path / "models", recipe=TINY)
    modes = {path.name: path.stat().st_mode & 0o777 for path in built.rglob("*")}
    assert modes
    assert all(mode & 0o444 == 0o444 for mode in modes.values()), modes
    assert built.stat().st_mode & 0o555 == 0o555


def test_prepare_hf_dir_links_without_writing_the_source(minilm_source: Path, tmp_path: Path) -> None:
    before = sorted(p.name for p in minilm_source.iterdir())
    prepared = prepare_hf_dir("all-minilm-l6-v2", minilm_source, tmp_path)
    assert sorted(p.name for p in minilm_source.iterdir()) == before
    assert not (minilm_source / MANIFEST_FILE).exists()
    assert (prepared / "model.safetensors").is_symlink()
    manifest = read_manifest(prepared)
    assert (manifest.task, manifest.max_context, manifest.embedding_dim) == ("embedding", 256, 384)
    assert manifest.version == prepared.name
    assert "1_Pooling/config.json" in manifest.files
    assert current_model_dir(tmp_path.parent, "x") != prepared  # sanity of the helper's layout
    assert (tmp_path / "all-minilm-l6-v2" / "current").resolve() == prepared.resolve()
    assert (
        prepare_hf_dir("all-minilm-l6-v2", minilm_source, tmp_path) == prepared
    )  # same content, same version


def test_an_embedding_model_serves_the_inputs_sentence_transformers_embeds(
    minilm_source: Path, tmp_path: Path
) -> None:
    """Found by a review (2026-12-03): MiniLM was served with 512 tokens (config.json's
    max_position_embeddings) where sentence-transformers, the reference, embeds 256 of them
    (sentence_bert_config.json): an input of 257-512 tokens was neither refused nor embedded as the model
    does. A manifest prepared before says 512 and its version is kept as it is: reading it takes the
    smaller, at the edge and in the worker alike."""
    from ingest.errors import ContextLengthExceeded
    from ingest.models import ServedModel

    assert json.loads((minilm_source / "config.json").read_text())["max_position_embeddings"] == 512
    prepared = prepare_hf_dir("all-minilm-l6-v2", minilm_source, tmp_path)
    assert json.loads((prepared / MANIFEST_FILE).read_text())["max_context"] == 256  # as written
    old = msgspec.structs.replace(read_manifest(prepared), max_context=512)
    (prepared / MANIFEST_FILE).write_bytes(msgspec.json.encode(old))  # what a cache from before holds
    assert prepare_hf_dir("all-minilm-l6-v2", minilm_source, tmp_path) == prepared
    assert json.loads((prepared / MANIFEST_FILE).read_text())["max_context"] == 512  # kept as it is
    assert read_manifest(prepared).max_context == 256
    assert verify_model_dir(prepared).max_context == 256  # what the worker loads with
    served = ServedModel.load("all-minilm-l6-v2", prepared)
    assert served.manifest.max_context == 256
    served.check_context(256, "input")
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 256 tokens"):
        served.check_context(257, "input")


def test_prepare_hf_dir_infers_generation(demo_gpt_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "plain-hf"
    shutil.copytree(demo_gpt_dir, source, ignore=shutil.ignore_patterns(MANIFEST_FILE))
    prepared = prepare_hf_dir("my-gpt", source, tmp_path / "models")
    manifest = read_manifest(prepared)
    assert (manifest.task, manifest.max_context, manifest.embedding_dim) == ("generation", 512, None)
    assert manifest.version == demo_gpt_dir.name  # same files, same content hash
    assert (manifest.eos_token_id, manifest.eos_token_ids, manifest.chat.end_of_turn_ids) == (
        0,
        (0,),
        (1, 2, 3),
    )
    lm = load_generation_model(prepared, device="cpu")
    assert lm.manifest.model_id == "my-gpt"


def test_prepare_hf_dir_rejects_non_model_dir(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"config\.json"):
        prepare_hf_dir("x", tmp_path, tmp_path / "models")


def test_load_verifies_hashes_and_task(tmp_path: Path) -> None:
    built = build_demo_gpt(tmp_path, recipe=TINY)
    with pytest.raises(ModelError, match="is a generation model, not embedding"):
        load_embedding_model(built)
    lm = load_generation_model(built)
    assert lm.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert not lm.model.training
    config = built / "config.json"
    config.write_text(config.read_text().replace('"n_layer": 2', '"n_layer": 1'))
    with pytest.raises(ModelError, match=r"config\.json has sha256 .* prepare it again"):
        load_generation_model(built)
    (built / "config.json").unlink()
    with pytest.raises(ModelError, match="missing"):
        load_generation_model(built)
    with pytest.raises(ModelError, match=r"no sluice-manifest\.json"):
        load_generation_model(tmp_path)


def test_prepare_models(
    demo_gpt_dir: Path, shared_models_root: Path, tmp_path: Path, minilm_source: Path
) -> None:
    cache_dir = shared_models_root.parent
    settings = PlatformSettings(
        cache_dir=str(cache_dir),
        models=("demo-gpt", "all-minilm-l6-v2"),
        model_paths=(f"extra-minilm={minilm_source}",),
    )
    prepared = prepare_models(settings)
    assert list(prepared) == ["demo-gpt", "all-minilm-l6-v2", "extra-minilm"]
    assert prepared["demo-gpt"] == demo_gpt_dir
    assert read_manifest(prepared["extra-minilm"]).task == "embedding"
    assert current_model_dir(cache_dir, "extra-minilm").resolve() == prepared["extra-minilm"].resolve()
    with pytest.raises(ModelError, match="SLUICE_MODEL_PATHS=nope=/path"):
        prepare_models(PlatformSettings(cache_dir=str(tmp_path), models=("nope",)))
    with pytest.raises(ValueError, match="expected id=/path"):
        PlatformSettings(cache_dir=str(tmp_path), models=(), model_paths=("no-path",))


def asks_torch() -> bool:
    """transformers' own question, without its catch: a model loaded where CUDA is unavailable replaces it
    process-wide, so the tests put it back to see who asks."""
    return bool(torch.cuda.is_current_stream_capturing())


def test_a_cpu_model_without_a_cuda_driver_skips_the_per_forward_padding_check(
    demo_gpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers asks on every forward whether a CUDA stream is capturing (before its padding check);
    a CUDA build of torch without a driver answers by raising (~0.12 ms). A CPU model loaded where CUDA is
    unavailable no longer asks torch in the engine's decode (a ready 4D mask): the question is answered at
    once (``_no_stream_capture_without_cuda``); one loaded where CUDA is available keeps asking."""
    asked: list[int] = []

    def capturing() -> bool:
        asked.append(1)
        return False

    def decode(loaded: LoadedModel) -> None:
        ids = torch.tensor([[5], [6]])
        with torch.inference_mode():
            loaded.model(input_ids=ids, attention_mask=decode_bias(torch.ones_like(ids), torch.float32))

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", capturing)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    decode(load_generation_model(demo_gpt_dir, device="cpu"))
    assert asked == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(import_utils, "is_cuda_stream_capturing", asks_torch)  # as a process with CUDA has it
    decode(load_generation_model(demo_gpt_dir, device="cpu"))
    assert asked  # the control: the same forward asks when the check is kept


def test_a_process_without_cuda_answers_the_stream_capture_question_at_once(
    demo_gpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' mask builders ask whether a CUDA stream is capturing on every forward with a padding
    mask (a prefill, an embedding batch); torch's CUDA build without a driver answers by raising inside
    (25-150 us). A CPU model loaded where CUDA is unavailable makes the answer False without asking torch;
    the padded prefill's tokens are the same either way."""
    asked: list[int] = []

    def capturing() -> bool:
        asked.append(1)
        return False

    def prefill(loaded: LoadedModel) -> torch.Tensor:
        ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
        mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
        with torch.inference_mode():
            logits: torch.Tensor = loaded.model(input_ids=ids, attention_mask=mask).logits
        return logits[:, -1].argmax(-1)

    monkeypatch.setattr(import_utils, "is_cuda_stream_capturing", asks_torch)  # as transformers has it
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", capturing)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    control = prefill(load_generation_model(demo_gpt_dir, device="cpu"))
    assert asked  # with CUDA available the question still goes to torch
    asked.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tokens = prefill(load_generation_model(demo_gpt_dir, device="cpu"))
    assert asked == []
    assert tokens.tolist() == control.tolist()


def test_configure_torch_threads_defaults_to_half_the_cores() -> None:
    threads = configure_torch_threads()
    assert threads == default_torch_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
    assert torch.get_num_threads() == threads
    assert configure_torch_threads() == threads


# ---------------------------------------------------------------- versions (sluice models add / list)


def _variant(source: Path, tmp_path: Path, name: str, extra: str) -> Path:
    """A copy of ``source`` with one more file: same weights and tokenizer, another content hash."""
    copy = tmp_path / name
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns(MANIFEST_FILE, ".*"))
    (copy / "notes.json").write_text(json.dumps({"variant": extra}))
    return copy


def test_add_version_registers_without_moving_current(minilm_source: Path, tmp_path: Path) -> None:
    root = tmp_path / "models"
    first = prepare_hf_dir("all-minilm-l6-v2", minilm_source, root)
    stable = read_manifest(first).version
    added = add_version("all-minilm-l6-v2", _variant(minilm_source, tmp_path, "v2", "b"), root)
    candidate = read_manifest(added).version
    assert candidate != stable
    assert read_manifest(root / "all-minilm-l6-v2" / "current").version == stable  # what serves is unchanged
    again = add_version("all-minilm-l6-v2", _variant(minilm_source, tmp_path, "v2-again", "b"), root)
    assert again == added  # the same content is the same version
    versions = list_versions(root, "all-minilm-l6-v2")
    assert [(v.version, v.current, v.task) for v in versions] == [
        (stable, True, "embedding"),
        (candidate, False, "embedding"),
    ]
    assert [v.model_id for v in list_versions(root)] == ["all-minilm-l6-v2"] * 2


def test_add_version_of_a_new_model_makes_it_current(minilm_source: Path, tmp_path: Path) -> None:
    added = add_version("fresh", minilm_source, tmp_path / "models", "embedding")
    assert (tmp_path / "models" / "fresh" / "current").resolve() == added.resolve()


def test_add_version_refuses_another_tokenizer_or_task(minilm_source: Path, tmp_path: Path) -> None:
    root = tmp_path / "models"
    prepare_hf_dir("all-minilm-l6-v2", minilm_source, root)
    other = _variant(minilm_source, tmp_path, "other-tokenizer", "c")
    (other / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel"}}))
    with pytest.raises(ModelError, match=r"tokenizer\.json differs"):
        add_version("all-minilm-l6-v2", other, root)
    with pytest.raises(ModelError, match="serves embedding requests; a generation version"):
        add_version("all-minilm-l6-v2", _variant(minilm_source, tmp_path, "task", "d"), root, "generation")
    missing = _variant(minilm_source, tmp_path, "no-tokenizer", "e")
    (missing / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match=r"has no tokenizer\.json"):
        add_version("all-minilm-l6-v2", missing, root)
    assert len(list_versions(root, "all-minilm-l6-v2")) == 1  # nothing was registered


@pytest.mark.parametrize("registered", [True, False], ids=["model-with-a-version", "new-model"])
def test_add_version_of_a_path_that_is_no_directory_says_so(
    minilm_source: Path, tmp_path: Path, registered: bool
) -> None:
    """A review: ``sluice models add demo-gpt --path ./my-finetnue`` (a typo) said the directory "has no
    tokenizer.json" (or, for a new model, "no config.json"), sending the operator to look at tokenizers."""
    root = tmp_path / "models"
    if registered:
        prepare_hf_dir("all-minilm-l6-v2", minilm_source, root)
    with pytest.raises(ModelError, match=r"no such directory: .*my-finetnue$"):
        add_version("all-minilm-l6-v2", tmp_path / "my-finetnue", root, "embedding")
    a_file = tmp_path / "requests.jsonl"
    a_file.write_text("{}\n")
    with pytest.raises(ModelError, match=r"requests\.jsonl is not a directory"):
        add_version("all-minilm-l6-v2", a_file, root, "embedding")
    assert len(list_versions(root, "all-minilm-l6-v2")) == (1 if registered else 0)


def test_add_version_refuses_a_truncated_or_unreadable_weights_file(
    minilm_source: Path, tmp_path: Path
) -> None:
    """An operator audit: a version whose model.safetensors was cut short registered without a word; its
    workers then failed to load it at every restart, while the rollout waited for one to be ready."""
    root = tmp_path / "models"
    prepare_hf_dir("all-minilm-l6-v2", minilm_source, root)
    cut = _variant(minilm_source, tmp_path, "cut", "f")
    (weights,) = cut.glob("*.safetensors")
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(
        ModelError, match=r"model\.safetensors is \d+ bytes where its header describes \d+: truncated"
    ):
        add_version("all-minilm-l6-v2", cut, root)
    weights.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ModelError, match="not a safetensors file"):
        add_version("all-minilm-l6-v2", cut, root)
    weights.write_bytes(data)
    assert add_version("all-minilm-l6-v2", cut, root).is_dir()  # whole again: it registers
    assert len(list_versions(root, "all-minilm-l6-v2")) == 2


def test_an_added_version_owns_its_files(minilm_source: Path, tmp_path: Path) -> None:
    """A review (2026-12-03): `models add` registered an "immutable" version as links into the operator's
    directory; once it was moved or re-trained into, the promoted version failed to load at every worker
    restart and the model stopped answering. The version now holds copies of the files."""
    root = tmp_path / "models"
    prepare_hf_dir("all-minilm-l6-v2", minilm_source, root)
    source = _variant(minilm_source, tmp_path, "finetune", "g")
    added = add_version("all-minilm-l6-v2", source, root)
    assert not any(path.is_symlink() for path in added.rglob("*"))
    assert read_manifest(added).description == f"copied from {source}"
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "retrained": True}))  # in place, as saved
    verify_model_dir(added)
    shutil.rmtree(source)  # the operator cleans up after registering
    verify_model_dir(added)
    assert (added / "1_Pooling" / "config.json").is_file()  # a subdirectory is copied too


def test_adding_the_same_files_again_makes_a_linked_version_its_own(
    minilm_source: Path, tmp_path: Path
) -> None:
    """A version registered before `models add` copied is links; registering its files again (what the
    error of a broken one says to do) swaps the copies in, under the same version id."""
    root = tmp_path / "models"
    prepare_hf_dir("all-minilm-l6-v2", minilm_source, root)
    source = _variant(minilm_source, tmp_path, "old", "h")
    linked = prepare_hf_dir("all-minilm-l6-v2", source, root, point=False)  # as `models add` used to
    (source / "notes.json").rename(tmp_path / "notes.json")  # the operator moved a file away
    with pytest.raises(ModelError, match=rf"notes\.json is missing .*links into {source}: restore"):
        verify_model_dir(linked)
    (tmp_path / "notes.json").rename(source / "notes.json")
    assert add_version("all-minilm-l6-v2", source, root) == linked
    assert not any(path.is_symlink() for path in linked.rglob("*"))
    assert read_manifest(linked).description.startswith("copied from")
    shutil.rmtree(source)
    verify_model_dir(linked)


def test_a_broken_added_version_says_to_register_it_again(minilm_source: Path, tmp_path: Path) -> None:
    """`sluice models prepare` cannot restore a version registered with `models add` (a review: the
    worker's error said to run it, and it did nothing); the error says what can."""
    root = tmp_path / "models"
    prepare_hf_dir("all-minilm-l6-v2", minilm_source, root)
    added = add_version("all-minilm-l6-v2", _variant(minilm_source, tmp_path, "v", "i"), root)
    (added / "notes.json").write_text("{}")
    with pytest.raises(
        ModelError, match=r"register its files again with `sluice models add all-minilm"
    ) as err:
        verify_model_dir(added)
    assert "models prepare" not in str(err.value)
    (added / "notes.json").unlink()
    with pytest.raises(ModelError, match=r"notes\.json is missing .*`sluice models add"):
        verify_model_dir(added)


def test_configure_openmp_sets_the_policy_before_torch_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    configure_openmp("passive")
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_configure_openmp_leaves_an_explicit_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    configure_openmp("passive")
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_configure_openmp_after_torch_loaded_warns_and_sets_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    configure_openmp("passive")
    assert "OMP_WAIT_POLICY" not in os.environ
    assert "comes too late" in caplog.text


LOADS_WITHOUT_SKLEARN = """
import sys
from pathlib import Path

from gpu_workers.models import load_generation_model

loaded = load_generation_model(Path(sys.argv[1]), device="cpu")
assert loaded.model.generation_config is not None
print(sorted(m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")))
"""


def test_a_worker_loads_its_model_without_importing_scikit_learn(demo_gpt_dir: Path) -> None:
    """scikit-learn is installed (evidently needs it), and transformers' generation module imports it when
    it is: ~5 s of a worker's start on 2 cores, for a feature workers never use. In a fresh process, as a
    worker starts; the control: the same import without the guard does load it."""
    import subprocess

    loads = subprocess.run(
        [sys.executable, "-c", LOADS_WITHOUT_SKLEARN, str(demo_gpt_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert loads.stdout.strip().splitlines()[-1] == "[]", loads.stdout
    control = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, transformers.generation.candidate_generator; print('sklearn' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert control.stdout.strip().splitlines()[-1] == "True"


def test_a_version_transformers_cannot_build_fails_to_load_as_a_model_error(
    demo_gpt_dir: Path, tmp_path: Path
) -> None:
    """Found under `sluice up`: a version whose config transformers refuses (its width not divisible by its
    heads) failed its worker with a ValueError, which is no load error the worker names on the control
    topic, so the rollout waited its whole ready timeout. It is a ``ModelError`` that says which files."""
    source = tmp_path / "bad"
    shutil.copytree(demo_gpt_dir, source, ignore=shutil.ignore_patterns(MANIFEST_FILE, ".*"))
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "n_embd": config["n_embd"] + 2}))
    added = add_version(DEMO_GPT_ID, source, tmp_path / "models", "generation")
    with pytest.raises(ModelError, match=r"does not load as a generation model: .*divisible"):
        load_generation_model(added, "cpu")
