"""One padded batch of token rows, built on the host and moved to the device in one copy each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def pad_rows(
    rows: Sequence[Sequence[int]],
    pad_id: int,
    device: torch.device,
    *,
    left: bool = False,
    shape: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention_mask)``, ``[len(rows), longest]`` int64 on ``device``; padding on the right (an
    encoder's) or, with ``left``, on the left (a decoder that generates after its prompt).

    With ``shape`` (at least that big) the result is that shape: the rows beyond ``rows`` are all padding
    and attend to one column only (a row that attends to nothing is NaN in some attention kernels),
    so a fixed-shape forward (a CUDA graph) can run any batch that fits.

    Filled in numpy, then one ``from_numpy`` and one copy per tensor: writing each row into a torch
    tensor cost ~6 us a row on the CPU (1.6 ms for 256 rows against 0.16 ms), and on a GPU each row was
    its own host-to-device copy and kernel launch."""
    import torch

    longest = max(len(row) for row in rows)
    height, width = shape or (len(rows), longest)
    if height < len(rows) or width < longest:
        raise ValueError(f"{len(rows)} rows of up to {longest} ids do not fit {shape}")
    longest = width
    ids = np.full((height, width), pad_id, dtype=np.int64)
    mask = np.zeros((height, width), dtype=np.int64)
    mask[len(rows) :, -1 if left else 0] = 1
    for i, row in enumerate(rows):
        n = len(row)
        span = slice(longest - n, longest) if left else slice(0, n)
        ids[i, span] = row
        mask[i, span] = 1
    return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)


def decode_bias(attend: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[rows, 1, 1, columns]`` of ``dtype``: 0 where ``attend`` (``[rows, columns]``, bool or 0/1) is
    set, the dtype's lowest value elsewhere: a one-token decode's attention mask, ready for the model.
    transformers takes a 4D mask as it is; given the 2D one it builds this itself on every forward, in
    Python (~15 % of a small model's decode step on a CPU, with its tracing checks)."""
    import torch

    rows, columns = attend.shape
    bias = torch.zeros((rows, 1, 1, columns), dtype=dtype, device=attend.device)
    return bias.masked_fill_(attend[:, None, None, :] == 0, torch.finfo(dtype).min)


def prefill_bias(attend: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[rows, 1, columns, columns]`` of ``dtype``: a prefill's causal attention mask over left-padded
    rows (``attend``, ``[rows, columns]``, 0/1): 0 where a token may attend (itself, and the real tokens
    before it), the dtype's lowest value elsewhere. A padding token attends to nothing: its scores are all
    that lowest value, so its softmax is even, never NaN, and nothing reads what it computes."""
    import torch

    columns = attend.shape[1]
    causal = torch.ones((columns, columns), dtype=torch.bool, device=attend.device).tril_()
    allowed = causal[None, None] & (attend[:, None, None, :] != 0)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=attend.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)
