"""A generation step's two forwards as traced, frozen graphs on a CPU (``gpu_workers.traced``), the
sampler's statistics included:

- the **prefill**: one forward over the joiners' left-padded prompts that gives each its first token's
  scores and its keys and values;
- the **decode**: one token for every row of the batch, over the growing cache's live columns, the new
  column written in place into the slot the cache reserved for it.

For demo-gpt both are nearly all Python eagerly (transformers' modules, its mask building, the cache's
bookkeeping): the prefill of a 10-token prompt took 0.96 ms on one core against 0.46 traced, 1.6-1.9
against ~1.0 ms on a core that idled first (as one client's requests find it: the model's part of the
time to first token); a decode step of one row 0.8 against 0.3 ms (docs/perf).

Each graph takes a 4D additive mask built by the engine (from the 2D one transformers builds it in Python,
with conditions on the data the tracer would bake in) and is traced on a padded batch, then checked against
the eager forward on batches of other heights, widths and padding: the scores, and the keys and values of
every real token. Where it cannot be traced or differs, that forward runs eagerly (logged)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from gpu_workers.padding import decode_bias, pad_rows, prefill_bias
from gpu_workers.traced import trace_checked

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

Head = Callable[["torch.Tensor"], "torch.Tensor"]

PREFILL_PROBES: tuple[tuple[tuple[int, ...], ...], ...] = (
    ((1, 2, 3, 4, 5, 6, 7), (1, 2, 3)),
    ((1,),),
    ((1, 2),),
    ((1,) * 40,),
    ((1, 2, 3), (4,) * 20, (5,) * 11),
)
"""Prompt batches (ids every vocabulary has): the prefill is traced on the first (with padding) and checked
on each; a trace that baked in a shape, the padding or the causal mask would differ on another."""

DECODE_PROBES: tuple[tuple[int, int], ...] = ((3, 20), (1, 1), (1, 40), (5, 7), (32, 100), (2, 300))
"""(rows, cached columns) of the decode's probes (random keys and values, the first row's first third
padding): traced on the first, checked on each."""

LONGEST_PROBE = 1024
"""Besides those, each step is also checked at the model's last position (up to this many tokens): a
branch taken by position (an embedding table's end, a rotary cache) shows there."""

ATOL = 1e-4
"""How far a graph's scores and keys and values may be from the eager forward's on its probes (scores of
order 10; the two differ by ~2e-6 on demo-gpt)."""


class StepGraphs(NamedTuple):
    prefill: PrefillGraph | None
    decode: DecodeGraph | None


_GRAPHS: weakref.WeakKeyDictionary[Any, StepGraphs] = weakref.WeakKeyDictionary()
"""Model -> its graphs (None: that forward runs eagerly), shared by every engine over the model."""


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """Each token's absolute position in its own prompt (left padding does not shift them)."""
    return (mask.cumsum(dim=1) - 1).clamp(min=0)


def eager_prefill(
    model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, Any]:
    """``(scores of the next token [rows, vocab], the prompts' DynamicCache)`` through transformers."""
    from transformers import DynamicCache

    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=DynamicCache(config=model.config),
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1, :], out.past_key_values


class PrefillGraph:
    """The traced prefill of one model: ``run`` gives what :func:`eager_prefill` gives, plus the head's
    statistics of the scores, from one graph call."""

    def __init__(self, model: PreTrainedModel, graph: Any) -> None:
        self._config = model.config  # not the model: the cache of graphs must not keep it alive
        self._graph = graph
        self._dtype = next(model.parameters()).dtype

    def run(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        from transformers import DynamicCache

        scores, stats, *kv = self._graph(ids, prefill_bias(mask, self._dtype), positions)
        cache = DynamicCache(config=self._config)
        for layer in range(len(kv) // 2):
            cache.update(kv[2 * layer], kv[2 * layer + 1], layer)
        return scores, stats, cache


class DecodeGraph:
    """The traced decode of one model: ``run(ids, positions, bias, slots)`` -> ``(scores, stats)``, where
    ``slots`` are each layer's keys then values over the live columns plus one reserved last column, into
    which the step writes the new token's."""

    def __init__(self, graph: Any) -> None:
        self._graph = graph

    def run(
        self, ids: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor, slots: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores, stats = self._graph(ids, positions, bias, *slots)
        return scores, stats


def step_graphs(model: PreTrainedModel, head: Head) -> StepGraphs:
    """``model``'s prefill and decode traced for the CPU (each None where it cannot be traced or differs
    from the eager forward on its probes, logged). Built once per model."""
    if model in _GRAPHS:
        return _GRAPHS[model]
    import torch

    name = type(model).__name__
    if model.training:  # not remembered: the same model in eval mode later is traced then
        log.warning("%s is in training mode: its steps run eagerly", name)
        return StepGraphs(None, None)
    graphs = StepGraphs(None, None)
    if (why := untraceable(model.config)) is not None:
        log.warning("%s's steps run eagerly: %s", name, why)
    else:
        with torch.inference_mode():
            prefill = _trace_prefill(model, head, name)
            decode = _trace_decode(model, head, name)
        graphs = StepGraphs(
            PrefillGraph(model, prefill) if prefill is not None else None,
            DecodeGraph(decode) if decode is not None else None,
        )
    _GRAPHS[model] = graphs
    return graphs


def attention_span(config: Any) -> int | None:
    """The most tokens a layer of this model attends to when that is less than its whole context
    (sliding-window or chunked attention, in any layer); None for full attention everywhere. The engine
    passes transformers a ready 4D mask, which transformers uses as it is, so such a window would not be
    applied: the engine serves no longer a context than this."""
    spans = [
        int(value)
        for key in ("sliding_window", "attention_chunk_size")
        if isinstance(value := getattr(config, key, None), int) and value > 0
    ]
    types = getattr(config, "layer_types", None) or ()
    if not spans or (types and all(kind == "full_attention" for kind in types)):
        return None
    return min(spans)


def untraceable(config: Any) -> str | None:
    """Why this model's steps must not be traced (None: they may): a trace records the branches its probes
    took, and these pick theirs by the position or the length the probes cannot all reach."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind in ("dynamic", "longrope"):
        return f"its rotary embedding's scaling ({kind}) depends on the sequence's length"
    if attention_span(config) is not None:
        return "it attends to a sliding window or in chunks"
    return None


OFFSET_POSITIONS = frozenset(
    {
        "camembert",
        "data2vec-text",
        "ibert",
        "longformer",
        "mpnet",
        "roberta",
        "roberta-prelayernorm",
        "xlm-roberta",
        "xlm-roberta-xl",
        "xmod",
    }
)
"""``model_type``s whose position ids start after the padding token's (``padding_idx + 1``, RoBERTa's
scheme): ``max_position_embeddings`` of 514 holds 512 usable positions. A RoBERTa encoder was served 514
tokens, and an input of 513 or 514 raised ``IndexError`` in the forward, failing its whole batch (a
review, 2026-12-03)."""


def position_limit(config: Any) -> int:
    """The most positions the model has embeddings for (2,048 where its config names none): for the
    :data:`OFFSET_POSITIONS` family, those after the padding token's. ``config``: a transformers config,
    or anything with its attributes."""
    limit = int(
        getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None) or 2048
    )
    pad = getattr(config, "pad_token_id", None)
    if (
        getattr(config, "model_type", None) in OFFSET_POSITIONS
        and isinstance(pad, int)
        and 0 <= pad < limit - 1
    ):
        return limit - pad - 1
    return limit


def _gap(
    scores: torch.Tensor, eager_scores: torch.Tensor, kv: Any, eager_kv: Any, mask: torch.Tensor
) -> float:
    """How far a graph's scores and keys and values are from the eager forward's; a padding column's keys
    and values are never read, so only real tokens' count."""
    real = mask.bool()[:, None, :, None]
    return max(
        float((scores - eager_scores).abs().max()),
        *(float(((a - b).abs() * real).max()) for a, b in zip(kv, eager_kv, strict=True)),
    )


def _trace_prefill(model: PreTrainedModel, head: Head, name: str) -> Any:
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    longest = min(position_limit(model.config), LONGEST_PROBE) - 1
    probes = []
    for prompts in (*PREFILL_PROBES, ((1,) * longest,)):
        prompts = tuple(prompt[:longest] for prompt in prompts)
        ids, mask = pad_rows(prompts, 0, device, left=True)
        probes.append((ids, mask, prefill_bias(mask, dtype), positions_of(mask)))

    def distance(traced: Any) -> float:
        worst = 0.0
        for ids, mask, bias, positions in probes:
            scores, _, *kv = traced(ids, bias, positions)
            eager_scores, cache = eager_prefill(model, ids, mask, positions)
            worst = max(worst, _gap(scores, eager_scores, kv, _flat(cache), mask))
        return worst

    ids, _, bias, positions = probes[0]
    return trace_checked(
        f"{name}'s prefill", _prefill_module(model, head), (ids, bias, positions), distance, ATOL
    )


def _trace_decode(model: PreTrainedModel, head: Head, name: str) -> Any:
    import torch
    from transformers import DynamicCache

    config, param = model.config, next(model.parameters())
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    width = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    generator = torch.Generator().manual_seed(0)
    longest = min(position_limit(config), LONGEST_PROBE) - 2  # the cached columns, the new one at the limit

    def probe(rows: int, columns: int) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(1, 3, (rows, 1), generator=generator).to(param.device)
        positions = torch.full((rows, 1), columns, dtype=torch.long, device=param.device)
        mask = torch.ones((rows, columns + 1), dtype=torch.long, device=param.device)
        mask[0, : columns // 3] = 0
        slots = [
            torch.randn((rows, heads, columns + 1, width), generator=generator).to(param)
            for _ in range(2 * int(config.num_hidden_layers))
        ]
        return (ids, positions, mask, decode_bias(mask, param.dtype), *slots)

    probes = [probe(rows, min(columns, longest)) for rows, columns in (*DECODE_PROBES, (1, longest))]

    def distance(traced: Any) -> float:
        worst = 0.0
        for ids, positions, mask, bias, *slots in probes:
            mine = [slot.clone() for slot in slots]
            scores, _ = traced(ids, positions, bias, *mine)
            cache = DynamicCache(config=config)
            for layer in range(len(slots) // 2):
                cache.update(slots[2 * layer][:, :, :-1], slots[2 * layer + 1][:, :, :-1], layer)
            out = model(input_ids=ids, attention_mask=bias, position_ids=positions, past_key_values=cache)
            worst = max(worst, _gap(scores, out.logits[:, -1, :], mine, _flat(cache), mask))
        return worst

    ids, positions, _, bias, *slots = probes[0]
    return trace_checked(
        f"{name}'s decode", _decode_module(model, head), (ids, positions, bias, *slots), distance, ATOL
    )


def _flat(cache: Any) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def _prefill_module(model: PreTrainedModel, head: Head) -> torch.nn.Module:
    """``(ids, 4D mask, positions)`` -> ``(scores, head(scores), keys 0, values 0, keys 1, ...)``."""
    import torch

    class Prefill(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(
            self, ids: torch.Tensor, bias: torch.Tensor, positions: torch.Tensor
        ) -> tuple[torch.Tensor, ...]:
            scores, cache = eager_prefill(self.model, ids, bias, positions)  # a 4D mask is used as it is
            return (scores, head(scores), *_flat(cache))

    return Prefill()


def _decode_module(model: PreTrainedModel, head: Head) -> torch.nn.Module:
    """``(ids, positions, 4D mask, keys 0, values 0, keys 1, ...)`` -> ``(scores, head(scores))``; each
    layer's new keys and values land in the last column of its slots."""
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class Slots(DynamicLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.slots = keys, values
            self.keys, self.values, self.is_initialized = keys, values, True
            self.dtype, self.device = keys.dtype, keys.device

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = self.slots
            keys[:, :, -1:].copy_(key_states)
            values[:, :, -1:].copy_(value_states)
            return keys, values

    class Decode(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(
            self, ids: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor, *slots: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            cache = DynamicCache()
            cache.layers = [Slots(slots[i], slots[i + 1]) for i in range(0, len(slots), 2)]
            out = self.model(
                input_ids=ids, attention_mask=bias, position_ids=positions, past_key_values=cache
            )
            scores = out.logits[:, -1, :]
            return scores, head(scores)

    return Decode()
