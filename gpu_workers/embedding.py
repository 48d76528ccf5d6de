"""Sentence embeddings: one padded forward per batch, mean pooling over real tokens, L2 normalisation.

This is what sentence-transformers does for all-MiniLM-L6-v2 (its ``1_Pooling`` config: mean tokens,
then ``Normalize``). Token ids come from the edge (``tokenizer.json`` via ``tokenizers``); the engine
adds nothing but padding. Like the generation engine it is used from one dedicated thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from gpu_workers import GpuWorkerError
from gpu_workers.padding import pad_rows

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


class EmbeddingError(GpuWorkerError):
    """A batch the embedding engine cannot take (empty item, too long, ids outside the vocabulary)."""


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

    def embed(self, batch: Sequence[Sequence[int]]) -> npt.NDArray[np.float32]:
        """``[len(batch), dim]`` float32 unit vectors, one forward pass for the whole batch."""
        import torch

        if not batch:
            return np.zeros((0, self.dim), dtype=np.float32)
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
        result: npt.NDArray[np.float32] = unit.cpu().numpy()
        return result
