"""Tiny random-weight Hugging Face model directories built in code (no hub access), shaped like the
models users link with ``SLUICE_MODEL_PATHS``: BERT or RoBERTa encoders with or without a
sentence-transformers pipeline, Mistral or Qwen2 decoders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS = [
    "hello world, how are you today?",
    "the quick brown fox jumps over the lazy dog",
    "tell me a story about cats",
] * 10


def bpe_tokenizer(specials: list[str], corpus: list[str] = CORPUS) -> Any:
    """A byte-level BPE tokenizer of 300 tokens trained on ``corpus``, ``specials`` its special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, initial_alphabet=alphabet)
    )
    return tok


def _encoder_sizes(tok: Any, positions: int) -> dict[str, Any]:
    """A tiny encoder's sizes, BERT's or RoBERTa's."""
    return {
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": positions,
    }


def _fast_tokenizer(tok: Any, **special_tokens: str) -> Any:
    """``tok`` as transformers' fast tokenizer, which ``save_pretrained`` writes with its config."""
    from transformers import PreTrainedTokenizerFast

    build: Any = PreTrainedTokenizerFast  # untyped in transformers
    return build(tokenizer_object=tok, **special_tokens)


def encoder_dir(
    path: Path,
    *,
    arch: str = "bert",
    positions: int = 64,
    modules: list[str] | None = None,
    pooling: dict[str, bool] | None = None,
    model_max_length: int | None = None,
) -> Path:
    """A BERT or RoBERTa encoder in ``path``; with ``modules`` (sentence-transformers module class names
    after the Transformer, e.g. ``["Pooling", "Normalize"]``) its pipeline too, ``pooling`` the
    ``1_Pooling/config.json`` flags."""
    import torch
    from tokenizers import processors
    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel

    if arch == "bert":
        tok = bpe_tokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
        cls, sep = ("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[cls, sep]
        )
        names = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]"}
        config: Any = BertConfig(**_encoder_sizes(tok, positions), pad_token_id=0)
        builder: Any = BertModel
    else:
        tok = bpe_tokenizer(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
        tok.post_processor = processors.RobertaProcessing(
            ("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>"))
        )
        names = {"cls_token": "<s>", "sep_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
        config = RobertaConfig(
            **_encoder_sizes(tok, positions), pad_token_id=tok.token_to_id("<pad>"), type_vocab_size=1
        )
        builder = RobertaModel
    torch.manual_seed(0)
    path.mkdir(parents=True, exist_ok=True)
    builder(config).save_pretrained(path)
    fast = _fast_tokenizer(tok, **names)
    if model_max_length is not None:
        fast.model_max_length = model_max_length
    fast.save_pretrained(path)
    if modules is not None:
        listed = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
        for index, kind in enumerate(modules, start=1):
            folder = f"{index}_{kind}"
            listed.append(
                {
                    "idx": index,
                    "name": str(index),
                    "path": folder,
                    "type": f"sentence_transformers.models.{kind}",
                }
            )
            (path / folder).mkdir()
            if kind == "Pooling":
                flags = {
                    "word_embedding_dimension": 32,
                    "pooling_mode_cls_token": False,
                    "pooling_mode_mean_tokens": False,
                    "pooling_mode_max_tokens": False,
                    "pooling_mode_mean_sqrt_len_tokens": False,
                    "pooling_mode_lasttoken": False,
                    **(pooling or {"pooling_mode_mean_tokens": True}),
                }
                (path / folder / "config.json").write_text(json.dumps(flags))
            if kind == "Dense":
                (path / folder / "config.json").write_text(
                    json.dumps({"in_features": 32, "out_features": 16, "bias": True})
                )
        (path / "modules.json").write_text(json.dumps(listed))
    return path


def decoder_dir(path: Path, *, arch: str = "mistral", **config_fields: Any) -> Path:
    """A Mistral or Qwen2 causal LM in ``path`` (256 positions), ``config_fields`` added to its config."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = bpe_tokenizer(["<s>", "</s>"])
    classes: dict[str, tuple[Any, Any]] = {
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }
    config_class, model_class = classes[arch]
    config = config_class(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        **config_fields,
    )
    torch.manual_seed(0)
    path.mkdir(parents=True, exist_ok=True)
    model_class(config).save_pretrained(path)
    _fast_tokenizer(tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return path
