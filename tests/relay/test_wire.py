"""Token ids cross the segment channel packed: 4 little-endian bytes an id."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from relay_serve.protocol import SegmentRequest, pack_token_ids

IDS = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300)


@given(IDS)
def test_packed_ids_are_four_little_endian_bytes_each(ids):
    assert pack_token_ids(ids) == struct.pack(f"<{len(ids)}I", *ids)


@given(IDS)
def test_a_segment_request_takes_its_ids_packed_or_as_a_list(ids):
    base = {"model": "large", "max_tokens": 4, "session_id": "gen-1"}
    packed = SegmentRequest.model_validate({**base, "prompt_token_ids": struct.pack(f"<{len(ids)}I", *ids)})
    listed = SegmentRequest.model_validate({**base, "prompt_token_ids": ids})
    assert packed.prompt_token_ids == listed.prompt_token_ids == ids
    assert all(type(t) is int for t in packed.prompt_token_ids)


@pytest.mark.parametrize("value", [b"\x01\x00\x00", b"\x01\x00\x00\x00\x02", ["a"], [-1.5]])
def test_malformed_ids_are_refused_naming_the_field(value):
    with pytest.raises(ValidationError) as e:
        SegmentRequest.model_validate(
            {"model": "large", "max_tokens": 4, "session_id": "gen-1", "prompt_token_ids": value}
        )
    assert e.value.errors()[0]["loc"][0] == "prompt_token_ids"
