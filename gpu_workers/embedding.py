"""Sentence embeddings: one padded forward per batch, mean pooling over real tokens, L2 normalisation.

This is what sentence-transformers does for all-MiniLM-L6-v2 (its ``1_Pooling`` config: mean tokens,
then ``Normalize``). Token ids come from the edge (``tokenizer.json`` via ``tokenizers``); the engine
adds nothing but padding. Like the generation engine it is used from one dedicated thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from gpu_workers import GpuWorkerError
from gpu_workers.padding import pad_rows

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


class EmbeddingError(GpuWorkerError):
    """A batch the embedding engine cannot take (empty item, too long, ids outside the vocabulary)."""


class PendingVectors(Protocol):
    def result(self) -> npt.NDArray[np.float32]:
        """``[len(batch), dim]`` float32 unit vectors (waits for the device if it has not finished)."""
        ...


class _Ready:
    def __init__(self, vectors: npt.NDArray[np.float32]) -> None:
        self._vectors = vectors

    def result(self) -> npt.NDArray[np.float32]:
        return self._vectors


class _OnTheWay:
    """A batch the GPU is still computing and copying back (into pinned memory) when ``launch`` returns."""

    def __init__(self, host: torch.Tensor, copied: torch.cuda.Event) -> None:
        self._host = host
        self._copied = copied

    def result(self) -> npt.NDArray[np.float32]:
        self._copied.synchronize()  # waits without the GIL
        vectors: npt.NDArray[np.float32] = self._host.numpy()
        return vectors


class EmbeddingEngine:
    def __init__(
        self, model: PreTrainedModel, *, pad_token_id: int | None = None, max_length: int | None = None
    ):
        config = model.config
        self._model = model
        self._device = next(model.parameters()).device
        config_pad = getattr(config, "pad_token_id", None)
        self._pad_id: int = pad_token_id if pad_token_id is not None else int(config_pad or 0)
        positions: int = getattr(config, "max_position_embeddings", 512)
        self.max_length = max_length or positions
        hidden: int = config.hidden_size
        self.dim = hidden
        self._vocab_size = int(config.vocab_size)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def overlaps(self) -> bool:
        """Whether ``launch`` returns before the device has finished (a GPU): the caller can do other work,
        such as finishing the previous batch's requests, while this one runs."""
        return self._device.type == "cuda"

    def embed(self, batch: Sequence[Sequence[int]]) -> npt.NDArray[np.float32]:
        """``[len(batch), dim]`` float32 unit vectors, one forward pass for the whole batch."""
        return self.launch(batch).result()

    def launch(self, batch: Sequence[Sequence[int]]) -> PendingVectors:
        """Start the forward pass over ``batch`` and the copy of its vectors back to the host. On a GPU both
        are queued on the device and this returns at once; on a CPU they have finished. Out of memory is
        raised here, when the pass allocates, never by ``result()``."""
        import torch

        if not batch:
            return _Ready(np.zeros((0, self.dim), dtype=np.float32))
        for item in batch:
            if not item:
                raise EmbeddingError("cannot embed an empty token sequence")
            if len(item) > self.max_length:
                raise EmbeddingError(f"{len(item)} tokens exceed the model's {self.max_length}")
            if min(item) < 0 or max(item) >= self._vocab_size:
                raise EmbeddingError(f"token ids outside the vocabulary of {self._vocab_size}")
        ids, mask = pad_rows(batch, self._pad_id, self._device)
        with torch.inference_mode():
            hidden = self._model(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids))
            weights = mask.unsqueeze(-1).to(hidden.last_hidden_state.dtype)
            summed = (hidden.last_hidden_state * weights).sum(dim=1)
            pooled = summed / weights.sum(dim=1).clamp(min=1e-9)
            unit = torch.nn.functional.normalize(pooled.float(), p=2, dim=1)
        if not self.overlaps:
            return _Ready(unit.cpu().numpy())
        host = unit.to("cpu", non_blocking=True)  # into pinned memory, after the pass on the same stream
        copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        copied.record()
        return _OnTheWay(host, copied)
