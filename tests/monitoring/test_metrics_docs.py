"""The metrics catalogue and its documentation agree, and labels stay bounded."""

from __future__ import annotations

from pathlib import Path

from monitoring import metrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_every_metric_is_documented_with_its_labels() -> None:
    text = DOC.read_text()
    for info in metrics.catalogue():
        row = f"| `{info.name}` | {info.kind} | {', '.join(info.labels)} |"
        assert row in text, f"docs/metrics.md lacks the row for {info.name}: {row}"


def test_names_follow_prometheus_conventions() -> None:
    for info in metrics.catalogue():
        assert info.name.startswith("sluice_")
        assert (info.kind == "counter") == info.name.endswith("_total"), info.name
        if info.kind == "histogram":
            assert info.name.endswith(("_seconds", "_size")), info.name


def test_tenant_label_is_bounded() -> None:
    bound = metrics._TenantBound(2)
    assert [bound.label(t) for t in ("a", "b", "c", "a", "d", "b")] == ["a", "b", "other", "a", "other", "b"]
