"""A generation model's prefill: one forward over the joiners' left-padded prompts that gives each its
first token's scores and its keys and values.

On a CPU it runs as a traced, frozen graph (``gpu_workers.traced``), the sampler's statistics included:
for demo-gpt the eager forward is nearly all Python (transformers' modules, its mask building, the
cache), 0.96 ms for a 10-token prompt on one core against 0.46 traced, 1.6-1.9 against ~1.0 ms on a core
that idled first, as one client's requests find it. That is the model's part of the time to first token.
The graph takes a 4D additive mask built here (the 2D one made transformers build it in Python, with
conditions on the data the tracer would bake in), is traced on a padded batch and checked against the
eager forward on batches of other heights, widths and padding: the scores and the keys and values of
every real token. The decode stays eager (the growing cache's bookkeeping is Python by design)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpu_workers.padding import pad_rows, prefill_bias
from gpu_workers.traced import trace_checked

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

Head = Callable[["torch.Tensor"], "torch.Tensor"]

PROBES: tuple[tuple[tuple[int, ...], ...], ...] = (
    ((1, 2, 3, 4, 5, 6, 7), (1, 2, 3)),
    ((1,),),
    ((1, 2),),
    ((1,) * 40,),
    ((1, 2, 3), (4,) * 20, (5,) * 11),
)
"""Prompt batches (ids every vocabulary has): the graph is traced on the first (with padding) and checked
on each; a trace that baked in a shape, the padding or the causal mask would differ on another."""

ATOL = 1e-4
"""How far the graph's scores and keys and values may be from the eager forward's on :data:`PROBES`
(scores of order 10; the two differ by ~2e-6 on demo-gpt)."""

_GRAPHS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
"""Model -> its prefill graph (or None: it runs eagerly), shared by every engine over the model."""


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
    """The traced prefill of one model: ``run`` gives what :func:`eager_prefill` gives, plus ``head``'s
    statistics of the scores, from one graph call."""

    def __init__(self, model: PreTrainedModel, graph: Any) -> None:
        self._model = model
        self._graph = graph
        self._dtype = next(model.parameters()).dtype

    def run(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        from transformers import DynamicCache

        scores, stats, *kv = self._graph(ids, prefill_bias(mask, self._dtype), positions)
        cache = DynamicCache(config=self._model.config)
        for layer in range(len(kv) // 2):
            cache.update(kv[2 * layer], kv[2 * layer + 1], layer)
        return scores, stats, cache


def prefill_graph(model: PreTrainedModel, head: Head) -> PrefillGraph | None:
    """``model``'s prefill traced for the CPU, or None where it cannot be traced or differs from the eager
    forward on :data:`PROBES` (logged). Built once per model, under ``inference_mode``."""
    if model in _GRAPHS:
        graph: PrefillGraph | None = _GRAPHS[model]
        return graph
    import torch

    graph = None
    if not model.training:
        module = _module(model, head)
        probes = [_inputs(batch, model) for batch in PROBES]

        def distance(traced: Any) -> float:
            worst = 0.0
            for ids, mask, bias, positions in probes:
                scores, _, *kv = traced(ids, bias, positions)
                eager_scores, cache = eager_prefill(model, ids, mask, positions)
                real = mask.bool()[:, None, :, None]  # a padding column's keys and values are never read
                eager_kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]
                worst = max(
                    worst,
                    float((scores - eager_scores).abs().max()),
                    *(float(((a - b).abs() * real).max()) for a, b in zip(kv, eager_kv, strict=True)),
                )
            return worst

        with torch.inference_mode():
            ids, _, bias, positions = probes[0]
            traced = trace_checked(
                f"{type(model).__name__}'s prefill", module, (ids, bias, positions), distance, ATOL
            )
        graph = PrefillGraph(model, traced) if traced is not None else None
    _GRAPHS[model] = graph
    return graph


def _inputs(
    prompts: tuple[tuple[int, ...], ...], model: PreTrainedModel
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, mask = pad_rows(prompts, 0, next(model.parameters()).device, left=True)
    return ids, mask, prefill_bias(mask, next(model.parameters()).dtype), positions_of(mask)


def _module(model: PreTrainedModel, head: Head) -> torch.nn.Module:
    """``(ids, 4D mask, positions)`` -> ``(scores, head(scores), keys 0, values 0, keys 1, ...)``."""
    import torch
    from transformers import DynamicCache

    class Prefill(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(
            self, ids: torch.Tensor, bias: torch.Tensor, positions: torch.Tensor
        ) -> tuple[torch.Tensor, ...]:
            out = self.model(
                input_ids=ids,
                attention_mask=bias,
                position_ids=positions,
                past_key_values=DynamicCache(config=self.model.config),
                use_cache=True,
                logits_to_keep=1,
            )
            scores = out.logits[:, -1, :]
            kv = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
            return (scores, head(scores), *kv)

    return Prefill()
