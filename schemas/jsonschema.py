"""JSON Schema (draft 2020-12) of every event, for consumers outside Python and for the docs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from schemas.codec import ce_type
from schemas.events import EVENT_TYPES, Envelope, event_type_name

DIALECT = "https://json-schema.org/draft/2020-12/schema"
ID_BASE = "https://sluicegate.dev/schemas/"


def schema_file_name(cls: type[Envelope]) -> str:
    return f"{event_type_name(cls)}.schema.json"


def event_schema(cls: type[Envelope]) -> dict[str, Any]:
    """The JSON Schema of one event type, with ``$schema``, ``$id`` and ``title`` set."""
    schema: dict[str, Any] = msgspec.json.schema(cls)
    schema["$schema"] = DIALECT
    schema["$id"] = f"{ID_BASE}{event_type_name(cls)}/v{cls.schema_version}.schema.json"
    schema["title"] = ce_type(cls)
    return schema


def _dump(document: object) -> str:
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def export_json_schemas(directory: Path) -> list[Path]:
    """Write ``<type>.schema.json`` for every event type and an ``index.json``; return the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    index: list[dict[str, object]] = []
    for cls in EVENT_TYPES:
        path = directory / schema_file_name(cls)
        path.write_text(_dump(event_schema(cls)), encoding="utf-8")
        written.append(path)
        index.append(
            {
                "type": event_type_name(cls),
                "ce_type": ce_type(cls),
                "schema_version": cls.schema_version,
                "file": path.name,
            }
        )
    index.sort(key=lambda entry: str(entry["type"]))
    index_path = directory / "index.json"
    index_path.write_text(_dump({"events": index}), encoding="utf-8")
    written.append(index_path)
    return written
