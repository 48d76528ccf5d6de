"""Continuous batching over a causal LM's forward pass: a pure synchronous ``step()``.

The engine owns the running batch and one batched KV cache (transformers' ``DynamicCache``). Rows are
left-padded to a common length with an attention mask, and every row carries its own absolute
``position_ids`` (GPT-2 uses absolute positions, so padding must not shift them). Each ``step()`` is one
token boundary:

1. one batched decode forward for every row (the cache grows by the model's own update); a row whose
   sequence finished becomes a *free row*: it stays in the batch, attending only to itself, and its output
   is ignored;
2. a batched prefill of waiting requests that fit (free slots, prefill token budget): each gets its first
   token from the prefill logits;
3. joiners move into free rows **in place** (their keys and values are written right-aligned into the
   row, the row's mask re-drawn): the other rows are not touched. Only when there are more joiners than
   free rows, or a joiner's prompt is longer than the cache, is the batch rebuilt (kept rows selected and
   concatenated with the joiners, all re-padded to one length); free rows nobody claims for
   ``COMPACT_AFTER_STEPS`` steps are dropped the same way;
4. leading columns no running row attends to are cut off (a view: the next decode's update copies anyway).

That is the growing cache, the CPU's. On a GPU the same steps run over a fixed KV ring instead
(``gpu_workers.ring``): every row's keys and values in ``max_context`` columns, the batch's rows rounded up
to a CUDA graph height, the decode one graph replay a step (the sampler's statistics part of it); joiners
still take free rows in place, and a rebuild moves rows within the ring.

Under saturation with staggered lengths (a sequence ends and another joins at nearly every step) this
keeps the cost of a membership change to the joiner's own cache instead of a copy of the whole batch's.

So every running sequence produces exactly one token per step. ``cancel()`` drops a row at once; a
cancelled request never produces another token. The engine is not thread-safe: one dedicated thread owns
it (and all torch work, see ``configure_torch_threads``).

Sampling is greedy at temperature 0 (below ``SAMPLING_EPS``), otherwise temperature / top-k / top-p with a per-request
``torch.Generator`` seeded by the request, so re-running a request reproduces its tokens (a retry after a
worker crash streams the same text).

A row whose next-token scores hold NaN or inf (a numeric blow-up in that sequence: an fp16 overflow, bad
weights) ends that sequence with ``error`` and no token, the others untouched; its keys and values are
zeroed as it is freed, since masked columns still enter attention (NaN plus the mask's lowest value is NaN)
and would poison whatever sequence takes the row next.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec

from gpu_workers import GpuWorkerError
from gpu_workers.graphs import GRAPH_ROWS, rows_bucket
from gpu_workers.padding import decode_bias, pad_rows
from gpu_workers.step_graphs import (
    StepGraphs,
    attention_span,
    eager_prefill,
    position_limit,
    positions_of,
    step_graphs,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from gpu_workers.ring import RingCache

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "error"]
"""``error``: the row's next-token scores held NaN or inf; the output's token is none of the model's."""


class EngineError(GpuWorkerError):
    """A request the engine cannot take (bad ids, too long, duplicate id)."""


SAMPLING_EPS = 1e-5
"""A temperature below this samples greedily (as vLLM's ``_SAMPLING_EPS``): dividing the logits by a tiny
one overflows float32 (1e-40 makes them infinite, and the softmax NaN), and the distribution it means is
the greedy one anyway."""

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""The seeds ``torch.Generator.manual_seed`` takes."""


def cpu_seed(seed: int) -> int:
    """``seed`` for torch's CPU generator, which keeps only its low 32 bits (mt19937): seeds that differ only
    above them drew the same numbers (an audit: 7 and 2**32 + 7 wrote one text; a review: -1 and 2**32 - 1).
    A seed in [0, 2**32) is given as it is (so its text is what it was); the high part of any other, a
    negative one's included, is hashed into the low 32 bits (32 bits of state cannot keep every seed apart,
    but no longer do seeds that differ only above them collide by construction). A CUDA generator (Philox)
    keeps all 64 and is given the seed itself."""
    if 0 <= seed < 2**32:
        return seed
    high = seed >> 32
    mix = int.from_bytes(hashlib.blake2b(high.to_bytes(8, "big", signed=True), digest_size=4).digest(), "big")
    return (seed & 0xFFFF_FFFF) ^ mix


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

    def reset(self, *, keep_waiting: bool = False) -> list[str]: ...


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
    """The rows: their cache, 2D attention mask, and each row's sequence (``None``: a free row)."""

    seqs: list[_Seq | None] = field(default_factory=list)
    cache: Any = None  # DynamicCache
    mask: torch.Tensor | None = None
    idle_steps: int = 0
    """Steps in a row with free rows and nothing waiting to take them."""
    freed: bool = False
    """A row was freed since the leading columns were last looked at: only then can more of them go (a
    decode adds a column every row attends to; a joiner attends to at least what its free row did)."""

    @property
    def live(self) -> int:
        """Rows holding a sequence."""
        return sum(seq is not None for seq in self.seqs)

    def live_rows(self) -> list[int]:
        return [i for i, seq in enumerate(self.seqs) if seq is not None]


COMPACT_AFTER_STEPS = 16
"""Free rows nobody claims for this many steps are dropped (one rebuild); until then a joiner takes one in
place. A free row costs one row of each decode; a rebuild costs a copy of every row's cache."""


class GenerationEngine:
    """Continuous batching for a decoder-only model; see the module docstring."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_batch_size: int = 16,
        max_context: int | None = None,
        max_prefill_tokens: int = 4096,
        prefill_ratio: float = 8.0,
        max_prefill_wait: int = 8,
        static_cache: bool | None = None,
        cuda_graphs: bool = True,
        traced: bool = True,
    ) -> None:
        if max_batch_size < 1:
            raise EngineError("max_batch_size must be >= 1")
        self._model = model
        self._device = next(model.parameters()).device
        self._dtype = next(model.parameters()).dtype
        config = model.config
        self.max_context: int = max_context or position_limit(config)
        span = attention_span(config)
        if span is not None and self.max_context > span:
            # the engine hands transformers a ready 4D mask, which it uses as it is: no window applied
            log.warning(
                "%s attends to at most %d tokens at a time (a sliding window or chunks): this engine serves "
                "contexts of up to %d tokens",
                type(model).__name__,
                span,
                span,
            )
            self.max_context = span
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_ratio = prefill_ratio
        self.max_prefill_wait = max_prefill_wait
        self._waited = 0
        self._vocab_size = int(config.vocab_size)
        self._pending: deque[SeqRequest] = deque()
        self._batch = _Batch()
        self._ids: set[str] = set()
        self._rebuilds = 0
        self._lost: set[str] = set()
        """Requests that finished inside a step that then raised: their last outputs went with it."""
        self._ring: RingCache | None = None
        """The KV cache in fixed ring columns (``gpu_workers.ring``), the decode a CUDA graph per batch
        height with ``cuda_graphs``: on a GPU by default (``static_cache=None``), where the decode of a
        small model is host-bound; elsewhere the growing cache, whose attention spans only live columns."""
        if static_cache or (static_cache is None and self._device.type == "cuda"):
            self._ring = self._make_ring(cuda_graphs)
        self._graphs = (
            step_graphs(model, token_stats)
            if traced and self._device.type == "cpu"
            else StepGraphs(prefill=None, decode=None)
        )
        """The prefill and the growing cache's decode as traced graphs (``gpu_workers.step_graphs``): on a
        CPU unless ``traced`` is off or the model cannot be traced; on a GPU the prefill runs eagerly and
        the decode over the ring as CUDA graphs."""

    # ------------------------------------------------------------------------------------------- commands

    @property
    def running(self) -> int:
        return self._batch.live

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def rows(self) -> int:
        """Rows in the batch, free ones (waiting for a joiner or to be dropped) included."""
        return len(self._batch.seqs)

    @property
    def rebuilds(self) -> int:
        """Times the whole batch was copied (more joiners than free rows, or free rows dropped)."""
        return self._rebuilds

    @property
    def waiting(self) -> int:
        return len(self._pending)

    @property
    def static_cache(self) -> bool:
        """Whether the KV cache is the fixed ring (``gpu_workers.ring``) rather than the growing one."""
        return self._ring is not None

    @property
    def traced(self) -> tuple[bool, bool]:
        """Whether the prefill and the decode over the growing cache run as traced graphs
        (``gpu_workers.step_graphs``)."""
        return self._graphs.prefill is not None, self._graphs.decode is not None and self._ring is None

    @property
    def graphs(self) -> int:
        """Decode steps captured as CUDA graphs (one per batch height; 0 where the decode runs eagerly)."""
        return self._ring.graphs if self._ring is not None else 0

    def warm_up(self) -> int:
        """Run one short request through (kernels chosen, allocator warm), then, with CUDA graphs, capture
        the decode for every batch height up to ``max_batch_size`` so that no request waits for a capture.
        Returns the graphs captured. Call with the engine empty, before serving."""
        self.add(SeqRequest(request_id="warm-up", input_ids=[0, 1, 2], max_new_tokens=2))
        while self.has_work():
            self.step()
        if self._ring is None:
            return 0
        import torch

        with torch.inference_mode():
            return self._ring.capture_all([h for h in GRAPH_ROWS if h <= self._ring.rows])

    def has_work(self) -> bool:
        return bool(self._batch.live or self._pending)

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
        if not req.temperature >= 0 or not 0 < req.top_p <= 1 or req.top_k < 0:
            raise EngineError(f"request {req.request_id}: invalid sampling parameters")
        if not SEED_MIN <= req.seed <= SEED_MAX:
            raise EngineError(f"request {req.request_id}: seed {req.seed} outside [{SEED_MIN}, {SEED_MAX}]")
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

        for row, seq in enumerate(self._batch.seqs):
            if seq is not None and seq.req.request_id == request_id:
                with torch.inference_mode():
                    self._free(row)
                break
        return True

    def reset(self, *, keep_waiting: bool = False) -> list[str]:
        """Drop every request, running or waiting, and the batch with its cache: after a step that failed
        part-way (out of memory, or any other error), whose state is not to be trusted. Returns the ids
        dropped, those that finished inside the failed step included (their last outputs were lost with
        it); the engine is empty and ready for new requests. With ``keep_waiting`` the requests not yet
        prefilled stay queued (the failed step never touched them) and are not among the ids."""
        dropped = [seq.req.request_id for seq in self._batch.seqs if seq is not None]
        waiting = {req.request_id for req in self._pending} if keep_waiting else set()
        if not keep_waiting:
            dropped += [req.request_id for req in self._pending]
        # admitted by the failed step's prefill, or finished inside it (their last token lost with it)
        dropped += sorted((self._ids | self._lost) - set(dropped) - waiting)
        self._lost = set()
        self._batch = _Batch()
        if self._ring is not None:  # its rows hold what the failed step left: NaN, maybe (``_free``)
            import torch

            with torch.inference_mode():
                self._ring.clear()
        self._ids = waiting
        if not keep_waiting:
            self._pending.clear()
        self._waited = 0
        return dropped

    # ------------------------------------------------------------------------------------------------ step

    def step(self) -> list[StepOutput]:
        """One token boundary: decode every running sequence once, then prefill joiners (first token)."""
        import torch

        outputs: list[StepOutput] = []
        try:
            with torch.inference_mode():
                if self._batch.live:
                    self._decode(outputs)
                joined = self._prefill(outputs, free=self.max_batch_size - self._batch.live)
                if joined is not None:
                    self._place(*joined)
                self._tidy()
        except BaseException:
            # finished in this step (``_emit`` dropped them from the engine), their outputs lost with it:
            # ``reset`` names them too
            self._lost = {out.request_id for out in outputs if out.finish_reason is not None}
            raise
        return outputs

    def _decode(self, outputs: list[StepOutput]) -> None:
        import torch

        batch = self._batch
        seqs = batch.seqs
        live = batch.live_rows()
        running = [seq for seq in seqs if seq is not None]  # the rows of ``live``, in order
        last = [0 if s is None else s.last_token for s in seqs]
        position = [0 if s is None else s.position for s in seqs]
        if self._ring is not None:
            logits, stats = self._ring.decode(last, position)
        else:
            if batch.mask is None:
                raise EngineError("engine batch has no mask")  # unreachable: rows always come with a mask
            device = self._device
            batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(seqs), 1))], dim=1)
            ids = torch.tensor(last, dtype=torch.long, device=device)[:, None]
            positions = torch.tensor(position, dtype=torch.long, device=device)[:, None]
            bias = decode_bias(batch.mask, self._dtype)
            if self._graphs.decode is not None:
                layers = batch.cache.layers
                slots = [slot for layer in layers for slot in layer.reserve(1)]
                logits, stats = self._graphs.decode.run(ids, positions, bias, slots)
                for layer in layers:
                    layer.commit(1)
            else:
                out = self._model(
                    input_ids=ids,
                    attention_mask=bias,
                    position_ids=positions,
                    past_key_values=batch.cache,
                    use_cache=True,
                )
                logits = out.logits[:, -1, :]
                stats = token_stats(logits)
        tokens, logprobs, entropies, broken = self._sample(logits, stats, running, live)
        for j, row in enumerate(live):
            seq = running[j]
            seq.position += 1
            if self._emit(seq, tokens[j], outputs, logprobs[j], entropies[j], broken[j]) is not None:
                self._free(row, scrub=broken[j])

    def _defer_prefill(self) -> bool:
        """Let joiners gather for a batched prefill while a large batch decodes (TGI's ``waiting_served_ratio``
        and ``max_waiting_tokens``): a prefill forward costs about a decode step whatever its size, so at
        saturation, where a sequence ends at nearly every step, prefilling each joiner alone would add a
        forward per step. Never while the batch is small (``waiting * prefill_ratio >= running``: at low load
        a joiner starts at once), never past ``max_prefill_wait`` steps."""
        running = self._batch.live
        if not running or len(self._pending) * self.prefill_ratio >= running:
            return False
        self._waited += 1
        return self._waited <= self.max_prefill_wait

    def _prefill(self, outputs: list[StepOutput], free: int) -> tuple[list[_Seq], Any, torch.Tensor] | None:
        """Run waiting requests that fit through one padded forward; return the still-running ones."""

        if not self._pending or self._defer_prefill():
            return None
        admitted: list[SeqRequest] = []
        longest = 0
        while self._pending and len(admitted) < free:
            n = len(self._pending[0].input_ids)
            padded = max(longest, n) * (len(admitted) + 1)
            if admitted and padded > self.max_prefill_tokens:
                break
            admitted.append(self._pending.popleft())
            longest = max(longest, n)
        if not self._pending:
            self._waited = 0
        if not admitted:
            return None
        ids, mask = pad_rows([req.input_ids for req in admitted], 0, self._device, left=True)
        positions = positions_of(mask)
        if self._graphs.prefill is not None:
            logits, stats, cache = self._graphs.prefill.run(ids, mask, positions)
        else:
            logits, cache = eager_prefill(self._model, ids, mask, positions)
            stats = token_stats(logits)
        seqs = [
            _Seq(req=req, generator=self._generator(req), position=len(req.input_ids)) for req in admitted
        ]
        tokens, logprobs, entropies, broken = self._sample(logits, stats, seqs, range(len(seqs)))
        keep_rows = [  # a broken row is not kept: its keys and values never reach the batch's cache
            row
            for row, s in enumerate(seqs)
            if self._emit(s, tokens[row], outputs, logprobs[row], entropies[row], broken[row]) is None
        ]
        if not keep_rows:
            return None
        return [seqs[r] for r in keep_rows], _select(cache, keep_rows), mask[keep_rows]

    def _emit(
        self, seq: _Seq, token: int, outputs: list[StepOutput], logprob: float, entropy: float, broken: bool
    ) -> FinishReason | None:
        seq.generated += 1
        seq.last_token = token
        reason: FinishReason | None = None
        if broken:  # no token, and no NaN for the drift features
            reason, logprob, entropy = "error", 0.0, 0.0
        elif token in seq.req.stop_token_ids:
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

    def _free(self, row: int, *, scrub: bool = False) -> None:
        """The row's sequence is gone: from now on the row attends only to its own new columns. ``scrub``:
        its keys and values are zeroed too (they hold NaN or inf)."""
        batch = self._batch
        batch.seqs[row] = None
        if self._ring is not None:
            self._ring.free(row, scrub=scrub)
            return
        if scrub:
            for keys, values in _layers(batch.cache):
                keys[row].zero_()
                values[row].zero_()
        if batch.mask is not None:
            batch.mask[row] = 0
            batch.mask[row, -1] = 1  # never an all-masked row (a softmax over nothing)
            batch.freed = True

    def _place(self, seqs: list[_Seq], cache: Any, mask: torch.Tensor) -> None:
        """Joiners into free rows, in place, while they fit; the rest (if any) by one rebuild."""
        batch = self._batch
        left: list[int] = []
        free = (row for row, seq in enumerate(batch.seqs) if seq is None)
        ring = self._ring
        length = ring.columns if ring is not None else 0 if batch.mask is None else batch.mask.shape[1]
        joined = _layers(cache)
        placed: list[tuple[int, int, int]] = []  # into the ring, all at once: (row, joiner, its length)
        for j, seq in enumerate(seqs):
            n = len(seq.req.input_ids)
            row = next(free, None) if n <= length else None
            if row is not None and ring is not None:
                placed.append((row, j, n))
                batch.seqs[row] = seq
                continue
            if row is None or batch.mask is None:
                left.append(j)
                continue
            for (keys, values), (jk, jv) in zip(_layers(batch.cache), joined, strict=True):
                keys[row, :, length - n :] = jk[j, :, jk.shape[2] - n :]
                values[row, :, length - n :] = jv[j, :, jv.shape[2] - n :]
            batch.mask[row] = 0
            batch.mask[row, length - n :] = 1
            batch.seqs[row] = seq
        if placed and ring is not None:
            ring.place(placed, joined)
        if left:
            self._rebuild(batch.live_rows(), ([seqs[j] for j in left], _select(cache, left), mask[left]))

    def _tidy(self) -> None:
        """Drop free rows nobody took for a while, and leading columns no row attends to."""
        batch = self._batch
        if not batch.live:
            self._batch = _Batch()
            return
        if len(batch.seqs) == self._height(batch.live) or self._pending:
            batch.idle_steps = 0
        else:
            batch.idle_steps += 1
            if batch.idle_steps >= COMPACT_AFTER_STEPS:
                self._rebuild(batch.live_rows(), None)
                return
        if self._ring is not None:
            return  # the ring has no leading columns to drop: the next decode overwrites the oldest
        if batch.mask is None:
            raise EngineError("engine batch has no mask")  # unreachable: rows always come with a mask
        if not batch.freed:
            return
        batch.freed = False
        first = _first_attended(batch.mask)
        if first > 0:
            batch.mask = batch.mask[:, first:]
            for layer in batch.cache.layers:
                layer.trim(first)

    def _rebuild(self, keep: list[int], joined: tuple[list[_Seq], Any, torch.Tensor] | None) -> None:
        """New membership: kept rows (trimmed of all-padding columns) plus joiners, re-padded to one length."""
        import torch

        self._rebuilds += 1
        batch = self._batch
        if self._ring is not None:
            self._rebuild_ring(keep, joined)
            return
        parts: list[tuple[list[_Seq], list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]] = []
        if keep and batch.mask is not None:
            mask = batch.mask[keep]
            first = _first_attended(mask)
            layers = [(k[keep, :, first:], v[keep, :, first:]) for k, v in _layers(batch.cache)]
            parts.append(
                ([s for s in (batch.seqs[i] for i in keep) if s is not None], layers, mask[:, first:])
            )
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
        rows: list[_Seq | None] = [s for p in parts for s in p[0]]
        self._batch = _Batch(
            seqs=rows,
            cache=_growing_cache(data),
            mask=torch.cat([pad(p[2]) for p in parts]),
        )

    def _height(self, rows: int) -> int:
        """Rows the batch has for ``rows`` sequences: as many, or with the ring the smallest CUDA graph
        height that holds them (the rest free rows)."""
        if self._ring is None or not rows:
            return rows
        return min(rows_bucket(rows) or self._ring.rows, self._ring.rows)

    def _rebuild_ring(self, keep: list[int], joined: tuple[list[_Seq], Any, torch.Tensor] | None) -> None:
        """The ring's rows: kept ones to the top, then joiners, then free rows up to the graph height."""
        ring = self._ring
        if ring is None:
            raise EngineError("no ring cache")  # unreachable: the caller checked
        batch = self._batch
        joiners, layers = ([], []) if joined is None else (joined[0], _layers(joined[1]))
        height = self._height(len(keep) + len(joiners))
        rows: list[_Seq | None] = [batch.seqs[i] for i in keep]
        ring.gather(keep, height)
        if joiners:
            ring.place([(len(keep) + j, j, len(seq.req.input_ids)) for j, seq in enumerate(joiners)], layers)
        rows += joiners
        rows += [None] * (height - len(rows))
        self._batch = _Batch(seqs=rows)

    def _make_ring(self, cuda_graphs: bool) -> RingCache | None:
        """The ring for ``max_batch_size`` rows of ``max_context`` columns, or None (the growing cache)
        where it does not fit the device's memory."""
        from gpu_workers.oom import out_of_memory_in
        from gpu_workers.ring import RingCache, RingTooLarge

        rows = rows_bucket(self.max_batch_size) or self.max_batch_size
        try:
            return RingCache(self._model, rows, self.max_context, graphs=cuda_graphs, head=token_stats)
        except Exception as exc:
            if not isinstance(exc, RingTooLarge) and out_of_memory_in(exc) is None:
                raise
            log.warning("%s: the growing KV cache instead (no CUDA graphs of the decode)", exc)
            return None

    # -------------------------------------------------------------------------------------------- sampling

    def _generator(self, req: SeqRequest) -> torch.Generator | None:
        import torch

        if req.temperature < SAMPLING_EPS:
            return None  # greedy
        seed = req.seed if self._device.type == "cuda" else cpu_seed(req.seed)
        return torch.Generator(device=self._device).manual_seed(seed)

    def _sample(
        self, logits: torch.Tensor, stats: torch.Tensor, seqs: Sequence[_Seq], rows: Sequence[int]
    ) -> tuple[list[int], list[float], list[float], list[bool]]:
        """Each sequence's next token, with its log-probability, the distribution's entropy, and whether
        its scores were broken (NaN or inf: :func:`token_stats`'s log-probability of the best token is
        finite for every other row); ``seqs[i]`` is row ``rows[i]`` of ``logits`` and of ``stats``. All
        greedy: one copy back (one device sync) a step, and no other work on the device."""
        import torch

        argmax, greedy_logprob, entropy = stats.tolist()
        entropies = [entropy[r] for r in rows]
        broken = [not math.isfinite(greedy_logprob[r]) for r in rows]
        tokens = [int(argmax[r]) for r in rows]
        if all(seq.generator is None for seq in seqs):
            return tokens, [greedy_logprob[r] for r in rows], entropies, broken
        for i, seq in enumerate(seqs):
            if seq.generator is not None and not broken[i]:  # ``multinomial`` raises on a NaN distribution
                try:
                    tokens[i] = sample_token(logits[rows[i]], seq.req, seq.generator)
                except RuntimeError:  # what one request's sampling raises ends that request, not the batch
                    log.exception("sampling for %s failed; it ends with an error", seq.req.request_id)
                    broken[i] = True
        scores = logits[list(rows)].float()
        chosen = scores.gather(1, torch.tensor(tokens, device=scores.device).unsqueeze(1)).squeeze(1)
        return tokens, (chosen - torch.logsumexp(scores, dim=-1)).tolist(), entropies, broken


def token_stats(logits: torch.Tensor) -> torch.Tensor:
    """``[3, rows]`` float32: each row's greedy token (exact below 2**24), its log-probability, and the
    entropy (nats) of the row's next-token distribution, in one tensor so that one copy brings them back.
    On a GPU it is part of the decode's CUDA graph.

    Element-wise passes and plain reductions only: on a CPU ``max(dim)``/``argmax`` and a broadcast
    comparison are scalar loops, each costing about what the ``exp`` does (~0.1-0.2 ms at 32 rows of a
    3k vocabulary on a 2.45 GHz EPYC), and for a small model this function was ~10 % of a decode step."""
    import torch

    scores = logits.float()
    vocab = scores.shape[-1]
    best = scores.amax(dim=-1, keepdim=True)
    shifted = scores - best  # 0 at the best score(s), < 0 (or -inf) elsewhere
    weights = shifted.exp()
    total = weights.sum(dim=-1)
    lse = total.log()  # logsumexp(scores) - best
    # entropy = logsumexp - E[score] = lse - sum(p * shifted); a -inf score has p = 0 (clamped: 0 * -inf)
    expected = (weights * shifted.clamp(min=torch.finfo(shifted.dtype).min)).sum(dim=-1) / total
    # the first best column, as argmax gives it: sign() is 0 there and -1 elsewhere, so (1 + sign) * rev
    # is rev (vocab - column) at the best columns and 0 elsewhere; a NaN row (no best) gives token 0
    rev = torch.arange(vocab, 0, -1, device=scores.device, dtype=scores.dtype)
    first = vocab - torch.addcmul(rev, shifted.sign(), rev).amax(dim=-1)
    return torch.stack(
        [first.nan_to_num(nan=0.0).clamp(max=vocab - 1), -lse, (lse - expected).clamp(min=0.0)]
    )


def sample_token(logits: torch.Tensor, req: SeqRequest, generator: torch.Generator) -> int:
    """Temperature, then top-k, then top-p (nucleus) filtering; one draw from ``generator``. The best score
    is subtracted before the division, so that a small temperature cannot overflow: the best is 0, the rest
    at most -inf (no NaN)."""
    import torch

    scores = logits.float()
    scores = (scores - scores.max()) / max(req.temperature, SAMPLING_EPS)
    if 0 < req.top_k < scores.shape[-1]:
        kth = torch.topk(scores, req.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if req.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_scores.softmax(dim=-1) >= req.top_p  # keep the smallest set reaching top_p
        drop[0] = False  # the best always stays: a top_p that is 0 in float32 (1e-300) dropped every token
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = scores.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _first_attended(mask: torch.Tensor) -> int:
    """The first column some row of ``mask`` attends to: the ones before it can go."""
    return int(mask.any(dim=0).to(mask.dtype).argmax())


def _growing_cache(data: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A ``DynamicCache`` holding ``data`` in layers that grow in place (:func:`_growing_layer_class`)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    layer = _growing_layer_class()
    cache.layers = [layer(keys, values) for keys, values in data]
    return cache


@functools.cache
def _growing_layer_class() -> type:
    """transformers' ``DynamicLayer`` over a buffer with room to grow. Its ``update`` concatenates: a copy
    of the whole cache per layer per decode step (~9 % of the engine's time at batch 32 here); this one
    writes the new column into the buffer. ``keys``/``values`` are views of the live columns, ``trim``
    drops leading ones, and a full buffer moves to one twice the live size (one copy per doubling)."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):  # type: ignore[no-untyped-call]
        def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
            self._move(keys, values, room=0)

        def _move(self, keys: torch.Tensor, values: torch.Tensor, room: int) -> None:
            live = keys.shape[-2]
            shape = (*keys.shape[:2], max(64, 2 * (live + room)), keys.shape[3])
            self.kbuf, self.vbuf = keys.new_empty(shape), values.new_empty(shape)
            self.kbuf[:, :, :live] = keys
            self.vbuf[:, :, :live] = values
            self.start, self.end = 0, live
            self._live()

        def _live(self) -> tuple[torch.Tensor, torch.Tensor]:
            """``keys``/``values`` as views of the live columns; returned."""
            keys, values = self.kbuf[:, :, self.start : self.end], self.vbuf[:, :, self.start : self.end]
            self.keys, self.values = keys, values
            return keys, values

        def reserve(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            """Views of the live columns and ``n`` more after them, for the step to write into; ``commit``
            makes them live."""
            if self.end + n > self.kbuf.shape[2]:
                self._move(*self._live(), room=n)
            end = self.end + n
            return self.kbuf[:, :, self.start : end], self.vbuf[:, :, self.start : end]

        def commit(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            self.end += n
            return self._live()

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            n = key_states.shape[-2]
            keys, values = self.reserve(n)
            keys[:, :, -n:] = key_states
            values[:, :, -n:] = value_states
            return self.commit(n)

        def trim(self, columns: int) -> None:
            self.start += columns
            self._live()

    return GrowingLayer


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
    eos = model.config.eos_token_id
    # a config's end token may be a list (Llama 3.1's), whose first then pads
    pad_id = int(pad if isinstance(pad, int) else (eos[0] if isinstance(eos, list) and eos else eos or 0))
    longest = max(len(p) for p in prompts)
    ids, mask = pad_rows(prompts, pad_id, next(model.parameters()).device, left=True)
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
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int,
    static_cache: bool | None = None,
    engine: GenerationEngine | None = None,
) -> float:
    """Tokens/s of :class:`GenerationEngine` with ``batch_size`` slots, greedy, no stop tokens (its KV
    cache the device's default, or the one ``static_cache`` names; CUDA graphs captured before timing).
    ``engine``: an idle one of ``batch_size`` slots to use instead, left idle."""
    engine = _idle_engine(model, batch_size, engine, static_cache)
    for i, prompt in enumerate(prompts):
        engine.add(SeqRequest(request_id=str(i), input_ids=list(prompt), max_new_tokens=max_new_tokens))
    produced = 0
    started = time.perf_counter()
    while engine.has_work():
        produced += len(engine.step())
    return produced / (time.perf_counter() - started)


def churn_throughput(
    model: PreTrainedModel,
    prompt: Sequence[int],
    max_new_tokens: int,
    batch_size: int,
    seconds: float,
    engine: GenerationEngine | None = None,
) -> float:
    """Tokens/s of :class:`GenerationEngine` with ``batch_size`` slots under a serving load's churn, as a
    continuous-batching server at saturation meets it: a request joins as soon as one ends (more offered
    than there are slots, each admitted as a slot frees, as the worker's scheduler admits them), the first
    wave's lengths staggered so that the ends spread over the steps as a closed loop's do. Counted over
    ``seconds`` (one step at least) after ``max_new_tokens`` steps of it.

    What a static batch (:func:`engine_throughput`, every row starting and ending together) does not pay:
    each decode step attends over its oldest row's columns (a static batch's widths average half of that),
    and joiners need prefills of their own (gathered a few at a time, rows idle meanwhile).

    ``engine``: an idle one of ``batch_size`` slots to use again (on a GPU a new one captures its graphs
    first), left idle (what still runs at the end is cancelled)."""
    engine = _idle_engine(model, batch_size, engine)
    numbers = itertools.count()
    live: set[str] = set()

    def join(tokens: int) -> None:
        request_id = f"churn-{next(numbers)}"
        engine.add(SeqRequest(request_id=request_id, input_ids=list(prompt), max_new_tokens=tokens))
        live.add(request_id)

    def step() -> int:
        outputs = engine.step()
        for out in outputs:
            if out.finish_reason is not None:
                live.discard(out.request_id)
                join(max_new_tokens)
        return len(outputs)

    for row in range(batch_size):
        join(1 + row * max_new_tokens // batch_size)
    try:
        for _ in range(max_new_tokens):  # the churn settles: every row has joined since the first wave
            step()
        produced = 0
        started = time.perf_counter()
        while True:
            produced += step()
            elapsed = time.perf_counter() - started
            if elapsed >= seconds:
                return produced / elapsed
    finally:
        for request_id in live:
            engine.cancel(request_id)


def _idle_engine(
    model: PreTrainedModel, batch_size: int, engine: GenerationEngine | None, static_cache: bool | None = None
) -> GenerationEngine:
    """``engine`` if it is idle with ``batch_size`` slots (a throughput helper's to use again), else a new
    one, warmed up (its graphs traced or captured before anything is timed)."""
    if engine is None:
        engine = GenerationEngine(model, max_batch_size=batch_size, static_cache=static_cache)
        engine.warm_up()
    elif engine.has_work() or engine.max_batch_size != batch_size:
        raise EngineError(f"the throughput helpers need an idle engine of {batch_size} slots")
    return engine
