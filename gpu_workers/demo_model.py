"""``demo-gpt``: a byte-level BPE tokenizer and a tiny GPT-2 trained for a few seconds on a deterministic
generated corpus, published as a content-addressed model directory. Builds are cached by a hash of the
recipe, so the second call is free.
"""

from __future__ import annotations

import ast
import hashlib
import json
import platform
import random
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.manifest import (
    MANIFEST_FILE,
    ChatFormat,
    ModelManifest,
    SamplingDefaults,
)

if TYPE_CHECKING:
    import tokenizers

from gpu_workers.end_tokens import end_of_turn_ids, end_token_ids
from gpu_workers.model_store import ModelError, Progress, model_lock, point_current, publish

DEMO_GPT_ID = "demo-gpt"
EOS_TOKEN = "<|endoftext|>"  # noqa: S105 - a vocabulary entry, not a secret
ROLE_TOKENS = ("<|user|>", "<|assistant|>", "<|system|>")


# ------------------------------------------------------------------------------------------- demo-gpt


_STDLIB_MODULES = (
    "argparse.py", "bisect.py", "calendar.py", "collections/__init__.py", "configparser.py", "contextlib.py",
    "csv.py", "dataclasses.py", "datetime.py", "difflib.py", "email/message.py", "enum.py", "fractions.py",
    "ftplib.py", "functools.py", "gzip.py", "heapq.py", "http/client.py", "imaplib.py", "inspect.py",
    "json/__init__.py", "json/decoder.py", "logging/__init__.py", "pickle.py", "pprint.py", "queue.py",
    "random.py", "sched.py", "selectors.py", "shutil.py", "smtplib.py", "socket.py", "statistics.py",
    "string.py", "subprocess.py", "tempfile.py", "textwrap.py", "threading.py", "unittest/case.py",
    "urllib/parse.py", "weakref.py", "zipfile.py",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class DemoRecipe:
    """Everything that determines the demo model's bytes; its hash keys the build cache."""

    corpus_seed: int = 20261101
    corpus_documents: int = 2000
    stdlib_modules: tuple[str, ...] = _STDLIB_MODULES
    vocab_size: int = 3072
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    n_positions: int = 512
    seq_len: int = 128
    batch_size: int = 8
    steps: int = 400
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    train_seed: int = 1234
    train_threads: int = 2
    recipe_revision: int = 2
    """Bump when the code of the build changes in a way the fields above do not show."""

    def digest(self) -> str:
        import tokenizers
        import torch
        import transformers

        payload = {
            **asdict(self),
            "torch": torch.__version__.split("+")[0],
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "python": platform.python_version(),  # the stdlib docstrings are part of the corpus
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


# fmt: off
_SUBJECTS = (
    "the river", "the old mill", "the sluice gate", "the harbour", "the miller", "the keeper",
    "the village", "the canal", "a small boat", "the north wind", "the bridge", "the lock keeper",
    "the farmer", "the ferry", "the lighthouse", "the market", "the children", "the clock tower",
    "the baker", "the fisherman",
)
_VERBS = (
    "opens", "watches", "carries", "follows", "crosses", "guards", "waits for", "remembers", "measures",
    "turns toward", "listens to", "counts", "holds", "repairs", "greets",
)
_OBJECTS = (
    "the morning tide", "the grain", "the heavy gate", "the evening light", "the water", "the last boat",
    "the long road", "the quiet town", "the stone wall", "the summer rain", "the green fields", "the nets",
    "the wooden wheel", "the bread", "the lantern", "the travellers",
)
_ENDINGS = (
    "at dawn", "before the storm", "every day", "in the spring", "after supper", "when the bell rings",
    "along the bank", "without a sound", "in the fog", "for the whole winter",
)
# fmt: on
_QUESTIONS = (
    ("What does {s} do?", "{S} {v} {o} {e}."),
    ("Tell me about {s}.", "{S} {v} {o}. It is known {e}."),
    ("When does {s} move?", "{S} moves {e}, and then it {v} {o}."),
    ("Why is {s} important?", "Because {s} {v} {o}, the town can rest {e}."),
    ("Write a short line about {o}.", "{O} waits {e}, and {s} {v} it."),
)
_SYSTEM = ("You are a helpful assistant.", "You answer briefly.", "You are a calm storyteller.")


def _slots(rng: random.Random) -> dict[str, str]:
    s, o = rng.choice(_SUBJECTS), rng.choice(_OBJECTS)
    return {
        "s": s, "S": s[0].upper() + s[1:], "o": o, "O": o[0].upper() + o[1:],
        "v": rng.choice(_VERBS), "e": rng.choice(_ENDINGS),
    }  # fmt: skip


def demo_corpus(seed: int, documents: int) -> list[str]:
    """A deterministic corpus of short stories and chat turns in the manifest's chat format."""
    rng = random.Random(seed)  # noqa: S311 - reproducible text, not security
    chat = ChatFormat()
    docs: list[str] = []
    for _ in range(documents):
        if rng.random() < 0.5:
            docs.append(" ".join("{S} {v} {o} {e}.".format(**_slots(rng)) for _ in range(rng.randint(3, 8))))
            continue
        question, answer = rng.choice(_QUESTIONS)
        slots = _slots(rng)
        text = chat.turn.format(role="system", content=rng.choice(_SYSTEM)) if rng.random() < 0.3 else ""
        text += chat.turn.format(role="user", content=question.format(**slots))
        docs.append(text + chat.assistant_prefix + answer.format(**slots) + "\n")
    return docs


def stdlib_docstrings(modules: tuple[str, ...]) -> list[str]:
    """Docstrings of the named standard-library source files, in file order (read with ``ast``, not imported)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    for name in modules:
        path = stdlib / name
        if not path.is_file():  # a trimmed Python install: the corpus is smaller, the recipe hash says which
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    docs.append(doc)
    return docs


def _train_tokenizer(corpus: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def _train_gpt(
    recipe: DemoRecipe, token_stream: list[int], vocab_size: int, eos_id: int, progress: Progress
) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=recipe.n_positions,
        n_embd=recipe.n_embd,
        n_layer=recipe.n_layer,
        n_head=recipe.n_head,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    stream = torch.tensor(token_stream, dtype=torch.long)
    chunks = stream[: (len(stream) // recipe.seq_len) * recipe.seq_len].view(-1, recipe.seq_len)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(recipe.train_threads)  # fixed, so the weights do not depend on the machine's cores
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.train_seed)
            model = GPT2LMHeadModel(config)  # type: ignore[no-untyped-call]  # transformers leaves __init__ untyped
            sampler = torch.Generator().manual_seed(recipe.train_seed)
            optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.01)
            schedule = torch.optim.lr_scheduler.LambdaLR(
                optimizer,
                lambda step: min(1.0, (step + 1) / recipe.warmup_steps) * (1 - 0.9 * step / recipe.steps),
            )
            model.train()
            for step in range(recipe.steps):
                batch = chunks[torch.randint(0, len(chunks), (recipe.batch_size,), generator=sampler)]
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad(set_to_none=True)
                if step % 50 == 0 or step == recipe.steps - 1:
                    progress(f"demo-gpt: step {step + 1}/{recipe.steps} loss {loss.item():.3f}")
    finally:
        torch.set_num_threads(previous_threads)
    model.train(False)
    model.generation_config.pad_token_id = eos_id
    return model


def build_demo_gpt(root: Path, progress: Progress | None = None, recipe: DemoRecipe | None = None) -> Path:
    """Build (or reuse) the ``demo-gpt`` model under ``root`` and point ``current`` at it; return its dir."""
    from transformers import GPT2Tokenizer  # the tokenizers-backed class; GPT2TokenizerFast is an alias

    say = progress or (lambda _msg: None)
    recipe = recipe or DemoRecipe()
    model_root = Path(root) / DEMO_GPT_ID
    marker = model_root / "recipes" / recipe.digest()
    with model_lock(model_root):
        if marker.is_file():
            version = marker.read_text().strip()
            if (model_root / version / MANIFEST_FILE).is_file():
                point_current(model_root, version)
                say(f"demo-gpt: cached build {version}")
                return model_root / version
        started = time.perf_counter()
        corpus = demo_corpus(recipe.corpus_seed, recipe.corpus_documents)
        corpus += stdlib_docstrings(recipe.stdlib_modules)
        tok = _train_tokenizer(corpus, recipe.vocab_size)
        eos_id = tok.token_to_id(EOS_TOKEN)
        if eos_id is None:
            raise ModelError(f"demo-gpt: trained tokenizer lacks {EOS_TOKEN}")
        say(f"demo-gpt: tokenizer trained, vocab {tok.get_vocab_size()}")
        stream: list[int] = []
        for encoding in tok.encode_batch(corpus):
            stream.extend(encoding.ids)
            stream.append(eos_id)
        model = _train_gpt(recipe, stream, tok.get_vocab_size(), eos_id, say)

        spec = json.loads(tok.to_str())
        # the tokenizers binding wants (left, right) pairs; transformers annotates the list as str
        merges: Any = [tuple(pair) for pair in spec["model"]["merges"]]
        tokenizer = GPT2Tokenizer(
            vocab=spec["model"]["vocab"],
            merges=merges,
            eos_token=EOS_TOKEN,
            bos_token=EOS_TOKEN,
            unk_token=EOS_TOKEN,
            pad_token=EOS_TOKEN,
            model_max_length=recipe.n_positions,
        )
        tokenizer.add_special_tokens({"additional_special_tokens": list(ROLE_TOKENS)})
        if len(tokenizer) != tok.get_vocab_size():
            raise ModelError(
                f"demo-gpt: tokenizer wrap lost tokens ({len(tokenizer)} != {tok.get_vocab_size()})"
            )

        staging = Path(tempfile.mkdtemp(prefix=".build-", dir=model_root))
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

        def manifest_for(version: str, files: dict[str, str]) -> ModelManifest:
            return ModelManifest(
                model_id=DEMO_GPT_ID,
                task="generation",
                version=version,
                max_context=recipe.n_positions,
                max_output_tokens=256,
                eos_token_id=eos_id,
                eos_token_ids=end_token_ids(staging),
                files=files,
                sampling=SamplingDefaults(temperature=0.8, top_p=0.95, top_k=50, max_tokens=64),
                chat=ChatFormat(end_of_turn_ids=end_of_turn_ids(staging, ChatFormat())),
                description=f"tiny GPT-2 built locally (recipe {recipe.digest()})",
            )

        target = publish(staging, model_root, manifest_for)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(target.name + "\n")
        say(f"demo-gpt: built {target.name} in {time.perf_counter() - started:.1f}s")
        return target
