"""Shared by the manifest tests: load YAML documents, resolve a sluice command line against the CLI."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import typer.main
import yaml
from typer._click.exceptions import UsageError  # typer >= 0.26 vendors click

from sluice.cli import app

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "ghcr.io/example/sluicegate:0.1.0"

__all__ = ["IMAGE", "ROOT", "UsageError", "load_documents", "resolve_sluice_command"]


def load_documents(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    assert all(isinstance(d, dict) for d in docs), path
    return docs


def resolve_sluice_command(args: Sequence[str]) -> str:
    """The full name of the sluice subcommand ``args`` runs (``"topics apply"``), its options parsed as the
    real CLI parses them: an unknown command or option raises :class:`UsageError`."""
    command: Any = typer.main.get_command(app)
    rest = list(args)
    path: list[str] = []
    ctx = command.make_context("sluice", list(rest), resilient_parsing=True)
    while hasattr(command, "resolve_command"):  # a group
        if not rest:
            raise UsageError(f"sluice {' '.join(path)}: missing command")
        name, command, rest = command.resolve_command(ctx, rest)
        if command is None:
            raise UsageError(f"no such command: sluice {' '.join([*path, str(name)])}")
        path.append(name)
        ctx = command.make_context(
            name, list(rest), parent=ctx, resilient_parsing=hasattr(command, "resolve_command")
        )
    return " ".join(path)
