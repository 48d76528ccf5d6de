"""Kafka consumers, batching scheduler and the model runtime — the only package that imports torch.

Importing the package (or ``gpu_workers.models``) does not import torch; the runtime modules import it
where they need it.
"""

from __future__ import annotations


class GpuWorkerError(Exception):
    """Root of every error raised by ``gpu_workers``."""


class StartCancelled(GpuWorkerError):
    """A worker was told to stop while it was still starting (loading its model): it stops without
    waiting for the load, which cannot be interrupted and has taken nothing from Kafka."""
