"""Candidate names to fleet rows straight from JSON text: the same answer as decoding and a dict."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sharegpu.extender import lookup

DNS = st.text(alphabet="abcz019.-", min_size=1, max_size=40)
"""Node-name characters (a real name also starts and ends alphanumeric: looser is harder here)."""
ANY = st.text(max_size=30)


def reference(fleet: list[str], asked: list[str]) -> list[int]:
    row_of = {n: r for r, n in enumerate(fleet)}
    return [row_of.get(n, -1) for n in asked]


def rows(fleet: list[str], text: bytes) -> list[int] | None:
    index = lookup.NameIndex(fleet, range(len(fleet)))
    found = index.rows(text)
    return None if found is None else found.tolist()


@settings(max_examples=100, deadline=None)
@given(fleet=st.lists(DNS, unique=True, max_size=60), data=st.data())
def test_any_order_of_any_subset_with_strangers_maps_like_a_dict(fleet: list[str], data: st.DataObject) -> None:
    asked = data.draw(st.lists(st.sampled_from(fleet) | DNS, max_size=80)) if fleet else data.draw(st.lists(DNS))
    assert rows(fleet, msgspec.json.encode(asked)) == reference(fleet, asked)


@settings(max_examples=100, deadline=None)
@given(fleet=st.lists(ANY, unique=True, max_size=30), data=st.data())
def test_names_of_any_text_map_like_a_dict_or_are_left_to_the_decoder(fleet: list[str], data: st.DataObject) -> None:
    """Quotes, backslashes, non-ASCII and empty names: either the exact rows, or None (decode)."""
    asked = data.draw(st.lists(st.sampled_from(fleet) | ANY, max_size=30)) if fleet else data.draw(st.lists(ANY))
    texts = (msgspec.json.encode(asked), json.dumps(asked).encode(), json.dumps(asked, ensure_ascii=False).encode())
    for text in texts:
        got = rows(fleet, text)
        assert got is None or got == reference(fleet, asked), text


@pytest.mark.parametrize(
    "text",
    [
        b"null",
        b"[1,2]",
        b'[ "a" ]',
        b'["a",1,"b"]',
        b'["a\\"b"]',
        b'["a,b","c"]',
        b'["a",["b","c"],"d"]',
        b'["a",{"b":"c"},"d"]',
        b'{"a":"b"}',
        b'"a"',
    ],
)
def test_a_text_that_is_not_a_plain_array_of_names_is_left_to_the_decoder(text: bytes) -> None:
    assert rows(["a", "b"], text) is None


def test_spaces_between_names_change_nothing() -> None:
    assert rows(["a", "b"], b'["b", "a",  "c"]') == [1, 0, -1]


def test_an_empty_list_has_no_rows() -> None:
    assert rows(["a"], b"[]") == []


def test_names_whose_hashes_all_collide_still_map_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hash only finds a candidate row: the bytes decide. With every hash equal, each name is
    still mapped to its own row, and a stranger to none."""
    monkeypatch.setattr(lookup, "_hash", lambda words, lengths: np.zeros(len(lengths), dtype=np.uint64))
    fleet = [f"node-{i}" for i in range(20)]
    asked = ["node-7", "node-19", "stranger", "node-0", "node-7"]
    assert rows(fleet, msgspec.json.encode(asked)) == reference(fleet, asked)


def test_names_longer_than_any_in_the_fleet_and_prefixes_do_not_match() -> None:
    fleet = ["gpu-node-1", "gpu-node-12345678"]
    asked = ["gpu-node-1", "gpu-node-12345678", "gpu-node-123456789", "gpu-node-", "gpu-node-1234567", "gpu-node-1" * 9]
    assert rows(fleet, msgspec.json.encode(asked)) == [0, 1, -1, -1, -1, -1]


def test_nodes_the_fleet_does_not_place_on_map_to_minus_one() -> None:
    """CPU-only nodes come in candidate lists too: they are indexed with no row."""
    index = lookup.NameIndex(["gpu-0", "cpu-0", "gpu-1", "cpu-1"], [0, -1, 1, -1])
    found = index.rows(msgspec.json.encode(["cpu-1", "gpu-1", "cpu-0", "gpu-0", "new-node"]))
    assert found is not None and found.tolist() == [-1, 1, -1, 0, -1]


@settings(max_examples=100, deadline=None)
@given(fleet=st.lists(DNS, unique=True, min_size=1, max_size=40), data=st.data())
def test_a_plain_text_mentions_exactly_its_names(fleet: list[str], data: st.DataObject) -> None:
    asked = data.draw(st.lists(st.sampled_from(fleet), unique=True, min_size=1))
    text = msgspec.json.encode(asked)
    assert lookup.plain_names(text)
    for name in fleet:
        assert lookup.mentions(text, name) == (name in asked)


@pytest.mark.parametrize("name", [",", 'a"b', "a\\b", "a,b", '","', ""])
def test_names_that_a_search_cannot_tell_are_not_claimed(name: str) -> None:
    text = msgspec.json.encode(["x", "a", "b", "y"])
    assert lookup.mentions(text, name) is False
