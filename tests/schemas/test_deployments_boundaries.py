"""Boundaries of schemas/deployments.py its other tests let pass: found by mutation testing, each test here fails
with a one-line change to it that the module's other tests did not notice."""

from __future__ import annotations

from schemas.deployments import Deployment, bucket, buckets_of
from tests.schemas.test_deployments import KEYS, MODEL, changed


def test_a_candidate_past_half_the_traffic_is_still_the_candidate() -> None:
    """deployments.py:63 (``event.stable or``): the named stable version stands even when the candidate has
    more traffic (a 60 % step): not the version with the most traffic."""
    d = Deployment.of(changed({"v1": 0.4, "v2": 0.6}, stable="v1", candidate="v2", shadow=0.1))
    assert (d.stable, d.candidate) == ("v1", "v2")
    routed = {d.route(key) for key in KEYS[:200]}
    assert routed == {"v1", "v2"}


def test_a_share_takes_the_nearest_number_of_buckets() -> None:
    """deployments.py:42 (``round``): 0.29 * 10_000 is 2899.9999999999995 in floats: 2900 buckets."""
    assert buckets_of(0.29) == 2900
    assert buckets_of(0.57) == 5700


def test_the_shadow_share_is_a_half_open_range_of_buckets() -> None:
    """deployments.py:80 (``<``): a key whose shadow bucket is exactly the share's count is not mirrored
    (shadow 0.5: buckets [0, 5000), 5000 of 10 000, as routing does)."""
    d = Deployment.of(changed({"v1": 1.0, "v2": 0.0}, stable="v1", candidate="v2", shadow=0.5))
    edge = [k for k in (f"k-{i}" for i in range(200_000)) if bucket(MODEL, k, "shadow") == 5000]
    assert edge, "no key on the boundary bucket"
    assert all(d.route(k) == "v1" for k in edge)
    assert all(d.shadow_to(k) is None for k in edge)
