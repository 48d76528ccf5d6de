"""Kafka consumers, batching scheduler and the model runtime — the only package that imports torch.

Importing the package (or ``gpu_workers.models``) does not import torch; the runtime modules import it
where they need it.
"""

from __future__ import annotations


class GpuWorkerError(Exception):
    """Root of every error raised by ``gpu_workers``."""
