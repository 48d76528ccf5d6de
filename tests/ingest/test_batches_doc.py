"""docs/batches.md's SDK example runs as written against the edge (only its ``base_url`` pointed at the
test's). Found by review: it read the output file right after one retrieve, while the batch was still
``validating`` and had no ``output_file_id`` (the SDK raised), and then cancelled a batch that had ended
(a 400)."""

from __future__ import annotations

import asyncio
import json
import re
import warnings
from pathlib import Path

import pytest

from tests.ingest.conftest import EMB, Client

DOC = Path(__file__).resolve().parents[2] / "docs" / "batches.md"


def example() -> str:
    found = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert found is not None, "docs/batches.md has no python example"
    return found.group(1)


def run_example(code: str, base_url: str, folder: Path) -> None:
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": EMB, "input": f"hi {i}"},
        }
        for i in range(3)
    ]
    (folder / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    code = code.replace("http://127.0.0.1:8080/v1", base_url).replace(
        'open("requests.jsonl"', f'open("{folder}/requests.jsonl"'
    )
    code = code.replace("...  #", "seen.append(line)  #")
    scope: dict[str, object] = {"seen": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # the example's open() is never closed
        exec(compile(code, str(DOC), "exec"), scope)
    assert len(scope["seen"]) == 3  # type: ignore[arg-type]


@pytest.mark.timeout(60)
async def test_the_batches_doc_example_runs_as_written(client: Client, tmp_path: Path) -> None:
    await asyncio.to_thread(run_example, example(), str(client.make_url("/v1")), tmp_path)
