"""An embedding result's terminal event: bytes and CPU time with vectors as JSON floats vs packed float32.

    python benchmarks/result_encoding.py [--inputs 64] [--dim 384] [--repeat 200]
        [--out benchmarks/results/result_encoding.json]

Unit vectors like MiniLM's (a ``[inputs, dim]`` float32 array, as ``EmbeddingEngine.embed`` returns) become
one ``RequestFinished`` both ways: before, each row as Python floats in ``embeddings`` (what the embedding
runner wrote); after, each row's bytes in ``embeddings_f32``. "encode" is the worker's side (array to the
record value), "decode + floats" a reader's (record value to ``vectors()``), "decode + base64" the edge's
``encoding_format="base64"`` reply (record value to one base64 string per vector). Medians of ``--repeat``.
"""

from __future__ import annotations

import argparse
import base64
import json
import platform as host
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ingest.prepare import embedding_inputs_that_fit
from schemas.codec import MAX_RECORD_BYTES, decode, encode
from schemas.events import Float32Vectors, RequestFinished, Usage

ROOT = Path(__file__).resolve().parents[1]


def finished(**vectors: Any) -> RequestFinished:
    return RequestFinished(
        tenant="acme",
        model="all-minilm-l6-v2",
        request_id="0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a50",
        source="gpu/worker-0",
        status="completed",
        finish_reason="stop",
        usage=Usage(prompt_tokens=512, completion_tokens=0, total_tokens=512),
        kind="embedding",
        **vectors,
    )


def as_floats(batch: npt.NDArray[np.float32]) -> bytes:
    return encode(finished(embeddings=[[float(x) for x in row] for row in batch]))


def packed(batch: npt.NDArray[np.float32]) -> bytes:
    rows = [row.astype("<f4", copy=False).tobytes() for row in batch]
    return encode(finished(embeddings_f32=Float32Vectors(dim=batch.shape[1], data=b"".join(rows))))


def read_floats(value: bytes) -> list[list[float]] | None:
    event = decode(value)
    return event.vectors() if isinstance(event, RequestFinished) else None


def read_base64(value: bytes) -> list[str] | None:
    event = decode(value)
    vectors = event.packed_vectors() if isinstance(event, RequestFinished) else None
    return None if vectors is None else [base64.b64encode(row).decode() for row in vectors.rows()]


def median_us(step: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "result_encoding.json")
    args = parser.parse_args()

    rng = np.random.default_rng(7)
    batch = rng.standard_normal((args.inputs, args.dim)).astype(np.float32)
    batch /= np.linalg.norm(batch, axis=1, keepdims=True)
    old, new = as_floats(batch), packed(batch)
    if read_floats(old) != read_floats(new) or read_base64(old) != read_base64(new):
        raise SystemExit("the two forms disagree")
    json_float_bytes = 24  # the most one JSON float took: the old edge limit's estimate
    rows = {
        "json_floats": {
            "event_bytes": len(old),
            "encode_us": median_us(lambda: as_floats(batch), args.repeat),
            "decode_floats_us": median_us(lambda: read_floats(old), args.repeat),
            "decode_base64_us": median_us(lambda: read_base64(old), args.repeat),
            "inputs_that_fit": (MAX_RECORD_BYTES - 16_384) // (args.dim * json_float_bytes + 2),
        },
        "packed_float32": {
            "event_bytes": len(new),
            "encode_us": median_us(lambda: packed(batch), args.repeat),
            "decode_floats_us": median_us(lambda: read_floats(new), args.repeat),
            "decode_base64_us": median_us(lambda: read_base64(new), args.repeat),
            "inputs_that_fit": embedding_inputs_that_fit(args.dim),
        },
    }
    result = {
        "machine": {"python": host.python_version(), "processor": host.processor() or host.machine()},
        "inputs": args.inputs,
        "dim": args.dim,
        "repeat": args.repeat,
        "forms": rows,
    }
    print(f"{args.inputs} x {args.dim}-dim vectors in one RequestFinished (medians of {args.repeat})")
    print(f"{'form':<16}{'bytes':>10}{'encode µs':>12}{'floats µs':>12}{'base64 µs':>12}{'max inputs':>12}")
    for name, row in rows.items():
        print(
            f"{name:<16}{row['event_bytes']:>10,}{row['encode_us']:>12,.0f}{row['decode_floats_us']:>12,.0f}"
            f"{row['decode_base64_us']:>12,.0f}{row['inputs_that_fit']:>12,}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
