"""Malformed AdmissionReview bodies and pods thrown at the admission handler: always a well-formed
response, never a crash, never an allow for an invalid GPU request."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from sharegpu.webhook import admission, fuzz, server

POLICY = admission.Policy(system_users=frozenset({"sharegpu-extender"}), largest_gpu_memory_mib=81920)


@settings(max_examples=600, deadline=None)
@given(st.randoms(use_true_random=False))
def test_generated_reviews(rng: random.Random) -> None:
    kind, body = fuzz.case(rng)
    response = server.handle_review(kind, body, POLICY)
    assert fuzz.violations(kind, body, response) == []


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=30,
    ),
    st.sampled_from(["mutate", "validate"]),
)
def test_arbitrary_json_never_crashes_or_allows_without_a_request(body: object, kind: str) -> None:
    answer = server.handle_review(kind, body, POLICY)
    assert fuzz.violations(kind, body, answer) == [] or not answer.response.allowed
    if not (isinstance(body, dict) and isinstance(body.get("request"), dict)):
        assert answer.response.allowed is False


def test_oversized_bodies_get_a_clear_answer() -> None:
    body = {"request": {"uid": "u", "operation": "CREATE", "namespace": "ns",
                        "object": {"metadata": {"annotations": {"x": "y" * 3_000_000}},
                                   "spec": {"containers": [{"name": "c", "resources": {"limits": {
                                       "sharegpu.io/gpu-milli": "9" * 100_000}}}]}}}}  # fmt: skip
    answer = server.handle_review("mutate", body, POLICY)
    assert answer.response.allowed is False
    assert answer.response.status is not None
    assert "sharegpu.io/gpu-milli" in answer.response.status.message
