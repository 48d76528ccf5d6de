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


UTC_OFFSET = r"(?:[Zz]|[+-]00:00)$"
"""What ends a time the codec takes: it refuses offsets other than UTC (``schemas.events._require_utc``)."""
INTEGERS = (
    "Integers are written without a fraction or an exponent: 16, never 16.0 or 1.6e1, which JSON Schema "
    "counts as integers and the codec refuses."
)


def _utc_only(node: object) -> None:
    """Every ``date-time`` in ``node`` must end in UTC: a bare ``format: date-time`` let any RFC 3339
    offset through, and a producer validating against the schema and writing local time had every event
    dead-lettered (a review)."""
    if isinstance(node, dict):
        if node.get("format") == "date-time":
            node["pattern"] = UTC_OFFSET
        for value in node.values():
            _utc_only(value)
    elif isinstance(node, list):
        for value in node:
            _utc_only(value)


def event_schema(cls: type[Envelope]) -> dict[str, Any]:
    """The JSON Schema of one event type, with ``$schema``, ``$id`` and ``title`` set, times UTC only."""
    schema: dict[str, Any] = msgspec.json.schema(cls)
    _utc_only(schema)
    schema["$comment"] = INTEGERS
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
