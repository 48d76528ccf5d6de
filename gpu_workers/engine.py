"""Continuous batching over a causal LM's forward pass: a pure synchronous ``step()``.

The engine owns the running batch and one batched KV cache (transformers' ``DynamicCache``). Rows are
left-padded to a common length with an attention mask, and every row carries its own absolute
``position_ids`` (GPT-2 uses absolute positions, so padding must not shift them). Each ``step()`` is one
token boundary:

1. one batched decode forward for every running sequence (the cache grows by the model's own update);
2. a batched prefill of waiting requests that fit (free slots, prefill token budget) — each gets its first
   token from the prefill logits;
3. only if membership changed (a sequence finished, or requests joined) the cache is rebuilt: kept rows
   are selected, leading all-padding columns trimmed, and joiners' caches left-padded and concatenated.

So every running sequence produces exactly one token per step. ``cancel()`` drops a row at once; a
cancelled request never produces another token. The engine is not thread-safe: one dedicated thread owns
it (and all torch work, see ``configure_torch_threads``).

Sampling is greedy at temperature 0, otherwise temperature / top-k / top-p with a per-request
``torch.Generator`` seeded by the request, so re-running a request reproduces its tokens (a retry after a
worker crash streams the same text).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec

from gpu_workers import GpuWorkerError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

FinishReason = Literal["stop", "length"]


class EngineError(GpuWorkerError):
    """A request the engine cannot take (bad ids, too long, duplicate id)."""


class SeqRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: frozenset[int] = frozenset()


class StepOutput(msgspec.Struct, frozen=True):
    request_id: str
    token_id: int
    finish_reason: FinishReason | None = None
    logprob: float = 0.0
    """Log-probability of ``token_id`` under the model's (untempered) next-token distribution."""
    entropy: float = 0.0
    """Entropy (nats) of that distribution: drift features, one batched reduction per step."""


class GenerationRuntime(Protocol):
    """What a worker needs from a generation engine; a GPU-grade engine (paged KV cache) can replace ours."""

    @property
    def running(self) -> int: ...

    def add(self, req: SeqRequest) -> None: ...

    def cancel(self, request_id: str) -> bool: ...

    def step(self) -> list[StepOutput]: ...

    def has_work(self) -> bool: ...


@dataclass(slots=True, eq=False)
class _Seq:
    req: SeqRequest
    generator: torch.Generator | None
    generated: int = 0
    last_token: int = -1
    position: int = 0
    """Absolute position the next fed token (``last_token``) takes."""


@dataclass(slots=True, eq=False)
class _Batch:
    """The running rows: their cache, 2D attention mask, next positions and last tokens (row order = seqs)."""

    seqs: list[_Seq] = field(default_factory=list)
    cache: Any = None  # DynamicCache
    mask: torch.Tensor | None = None


class GenerationEngine:
    """Continuous batching for a decoder-only model; see the module docstring."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_batch_size: int = 16,
        max_context: int | None = None,
        max_prefill_tokens: int = 4096,
    ) -> None:
        if max_batch_size < 1:
            raise EngineError("max_batch_size must be >= 1")
        self._model = model
        self._device = next(model.parameters()).device
        config = model.config
        limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
        self.max_context: int = max_context or int(limit or 2048)
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self._vocab_size = int(config.vocab_size)
        self._pending: deque[SeqRequest] = deque()
        self._batch = _Batch()
        self._ids: set[str] = set()

    # ------------------------------------------------------------------------------------------- commands

    @property
    def running(self) -> int:
        return len(self._batch.seqs)

    @property
    def waiting(self) -> int:
        return len(self._pending)

    def has_work(self) -> bool:
        return bool(self._batch.seqs or self._pending)

    def add(self, req: SeqRequest) -> None:
        """Queue ``req``; it is prefilled at the next step with a free slot."""
        n = len(req.input_ids)
        if req.request_id in self._ids:
            raise EngineError(f"request {req.request_id} is already in the engine")
        if n == 0:
            raise EngineError(f"request {req.request_id}: empty prompt")
        if n >= self.max_context:
            raise EngineError(
                f"request {req.request_id}: prompt of {n} tokens leaves no room in {self.max_context}"
            )
        if req.max_new_tokens < 1:
            raise EngineError(f"request {req.request_id}: max_new_tokens must be >= 1")
        if min(req.input_ids) < 0 or max(req.input_ids) >= self._vocab_size:
            raise EngineError(
                f"request {req.request_id}: token ids outside the vocabulary of {self._vocab_size}"
            )
        if req.temperature < 0 or not 0 < req.top_p <= 1 or req.top_k < 0:
            raise EngineError(f"request {req.request_id}: invalid sampling parameters")
        self._ids.add(req.request_id)
        self._pending.append(req)

    def cancel(self, request_id: str) -> bool:
        """Drop the request now (waiting or running); True if it was in the engine."""
        if request_id not in self._ids:
            return False
        self._ids.discard(request_id)
        for req in self._pending:
            if req.request_id == request_id:
                self._pending.remove(req)
                return True
        import torch

        keep = [i for i, seq in enumerate(self._batch.seqs) if seq.req.request_id != request_id]
        with torch.inference_mode():
            self._rebuild(keep, None)
        return True

    # ------------------------------------------------------------------------------------------------ step

    def step(self) -> list[StepOutput]:
        """One token boundary: decode every running sequence once, then prefill joiners (first token)."""
        import torch

        outputs: list[StepOutput] = []
        with torch.inference_mode():
            keep = self._decode(outputs) if self._batch.seqs else []
            joined = self._prefill(outputs, free=self.max_batch_size - len(keep))
            if joined is not None or len(keep) != len(self._batch.seqs):
                self._rebuild(keep, joined)
        return outputs

    def _decode(self, outputs: list[StepOutput]) -> list[int]:
        import torch

        batch = self._batch
        if batch.mask is None:
            raise EngineError("engine batch has no mask")  # unreachable: rows always come with a mask
        seqs = batch.seqs
        device = self._device
        input_ids = torch.tensor([[s.last_token] for s in seqs], dtype=torch.long, device=device)
        positions = torch.tensor([[s.position] for s in seqs], dtype=torch.long, device=device)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(seqs), 1))], dim=1)
        out = self._model(
            input_ids=input_ids,
            attention_mask=batch.mask,
            position_ids=positions,
            past_key_values=batch.cache,
            use_cache=True,
        )
        batch.cache = out.past_key_values
        tokens, logprobs, entropies = self._sample(out.logits[:, -1, :], seqs)
        keep = []
        for i, seq in enumerate(seqs):
            seq.position += 1
            if self._emit(seq, tokens[i], outputs, logprobs[i], entropies[i]) is None:
                keep.append(i)
        return keep

    def _prefill(self, outputs: list[StepOutput], free: int) -> tuple[list[_Seq], Any, torch.Tensor] | None:
        """Run waiting requests that fit through one padded forward; return the still-running ones."""
        import torch
        from transformers import DynamicCache

        admitted: list[SeqRequest] = []
        longest = 0
        while self._pending and len(admitted) < free:
            n = len(self._pending[0].input_ids)
            padded = max(longest, n) * (len(admitted) + 1)
            if admitted and padded > self.max_prefill_tokens:
                break
            admitted.append(self._pending.popleft())
            longest = max(longest, n)
        if not admitted:
            return None
        device = self._device
        ids = torch.zeros((len(admitted), longest), dtype=torch.long, device=device)
        mask = torch.zeros((len(admitted), longest), dtype=torch.long, device=device)
        for row, req in enumerate(admitted):
            n = len(req.input_ids)
            ids[row, longest - n :] = torch.tensor(req.input_ids, dtype=torch.long, device=device)
            mask[row, longest - n :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        out = self._model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=DynamicCache(config=self._model.config),
            use_cache=True,
            logits_to_keep=1,
        )
        seqs = [
            _Seq(req=req, generator=self._generator(req), position=len(req.input_ids)) for req in admitted
        ]
        tokens, logprobs, entropies = self._sample(out.logits[:, -1, :], seqs)
        keep_rows = [
            row
            for row, s in enumerate(seqs)
            if self._emit(s, tokens[row], outputs, logprobs[row], entropies[row]) is None
        ]
        if not keep_rows:
            return None
        return [seqs[r] for r in keep_rows], _select(out.past_key_values, keep_rows), mask[keep_rows]

    def _emit(
        self, seq: _Seq, token: int, outputs: list[StepOutput], logprob: float, entropy: float
    ) -> FinishReason | None:
        seq.generated += 1
        seq.last_token = token
        reason: FinishReason | None = None
        if token in seq.req.stop_token_ids:
            reason = "stop"
        elif (
            seq.generated >= seq.req.max_new_tokens
            or len(seq.req.input_ids) + seq.generated >= self.max_context
        ):
            reason = "length"
        outputs.append(StepOutput(seq.req.request_id, token, reason, logprob, entropy))
        if reason is not None:
            self._ids.discard(seq.req.request_id)
        return reason

    # -------------------------------------------------------------------------------------- batch surgery

    def _rebuild(self, keep: list[int], joined: tuple[list[_Seq], Any, torch.Tensor] | None) -> None:
        """New membership: kept rows (trimmed of all-padding columns) plus joiners, re-padded to one length."""
        import torch
        from transformers import DynamicCache

        batch = self._batch
        parts: list[tuple[list[_Seq], list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]] = []
        if keep and batch.mask is not None:
            mask = batch.mask[keep]
            first = int((mask.sum(dim=0) > 0).nonzero()[0])  # leading columns no kept row attends to
            layers = [(k[keep, :, first:], v[keep, :, first:]) for k, v in _layers(batch.cache)]
            parts.append(([batch.seqs[i] for i in keep], layers, mask[:, first:]))
        if joined is not None:
            seqs, cache, mask = joined
            parts.append((seqs, list(_layers(cache)), mask))
        if not parts:
            self._batch = _Batch()
            return
        length = max(mask.shape[1] for _, _, mask in parts)

        def pad(t: torch.Tensor) -> torch.Tensor:  # left-pad the sequence dim (-2 for k/v, -1 for mask)
            dim = t.dim() - 2 if t.dim() == 4 else 1
            missing = length - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        n_layers = len(parts[0][1])
        data = [
            (torch.cat([pad(p[1][i][0]) for p in parts]), torch.cat([pad(p[1][i][1]) for p in parts]))
            for i in range(n_layers)
        ]
        self._batch = _Batch(
            seqs=[s for p in parts for s in p[0]],
            cache=DynamicCache(ddp_cache_data=data),
            mask=torch.cat([pad(p[2]) for p in parts]),
        )

    # -------------------------------------------------------------------------------------------- sampling

    def _generator(self, req: SeqRequest) -> torch.Generator | None:
        import torch

        if req.temperature == 0:
            return None
        return torch.Generator(device=self._device).manual_seed(req.seed)

    def _sample(
        self, logits: torch.Tensor, seqs: Sequence[_Seq]
    ) -> tuple[list[int], list[float], list[float]]:
        """Each row's next token, with its log-probability and the distribution's entropy."""
        import torch

        tokens: list[int] = logits.argmax(dim=-1).tolist()
        for row, seq in enumerate(seqs):
            if seq.generator is not None:
                tokens[row] = sample_token(logits[row], seq.req, seq.generator)
        logp = logits.float().log_softmax(dim=-1)
        entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(dim=-1)
        chosen = logp.gather(1, torch.tensor(tokens, device=logp.device).unsqueeze(1)).squeeze(1)
        return tokens, chosen.tolist(), entropy.clamp(min=0.0).tolist()


def sample_token(logits: torch.Tensor, req: SeqRequest, generator: torch.Generator) -> int:
    """Temperature, then top-k, then top-p (nucleus) filtering; one draw from ``generator``."""
    import torch

    scores = logits.float() / req.temperature
    if 0 < req.top_k < scores.shape[-1]:
        kth = torch.topk(scores, req.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if req.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_scores.softmax(dim=-1) >= req.top_p  # keep the smallest set reaching top_p
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = scores.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _select(cache: Any, rows: list[int]) -> Any:
    import torch

    if len(rows) != len(cache.layers[0].keys):
        cache.batch_select_indices(torch.tensor(rows, dtype=torch.long, device=cache.layers[0].keys.device))
    return cache


# ------------------------------------------------------------------------------------------- benchmarks


def padded_generate(
    model: PreTrainedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, min_new_tokens: int = 0
) -> list[list[int]]:
    """One plain batched ``model.generate`` (greedy, left padding): each prompt's new token ids (padding
    after an early EOS is kept, as ``generate`` returns it). The raw baseline and the benchmark's peer
    servers all call the model through this."""
    import torch

    pad = model.generation_config.pad_token_id
    pad_id = int(pad if isinstance(pad, int) else (model.config.eos_token_id or 0))
    device = next(model.parameters()).device
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, longest - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            pad_token_id=pad_id,
        )
    new: list[list[int]] = out[:, longest:].tolist()
    return new


def raw_generate_throughput(
    model: PreTrainedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int
) -> float:
    """Tokens/s of plain batched ``model.generate`` (greedy, left padding): the baseline to compare against."""
    produced = 0
    started = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        produced += sum(
            len(row) for row in padded_generate(model, chunk, max_new_tokens, min_new_tokens=max_new_tokens)
        )
    return produced / (time.perf_counter() - started)


def engine_throughput(
    model: PreTrainedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int
) -> float:
    """Tokens/s of :class:`GenerationEngine` with ``batch_size`` slots, greedy, no stop tokens."""
    engine = GenerationEngine(model, max_batch_size=batch_size)
    for i, prompt in enumerate(prompts):
        engine.add(SeqRequest(request_id=str(i), input_ids=list(prompt), max_new_tokens=max_new_tokens))
    produced = 0
    started = time.perf_counter()
    while engine.has_work():
        produced += len(engine.step())
    return produced / (time.perf_counter() - started)
