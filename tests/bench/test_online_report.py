"""What `relay-serve cues converge` writes holds no machine path."""

from __future__ import annotations

import pytest

from relay_serve.bench.online import _in_store


@pytest.mark.parametrize(
    ("source", "kept"),
    [
        (
            "file:///tmp/relay-converge-store-ab12/cues/versions/20261204T115222-manual-6042f1.json",
            "versions/20261204T115222-manual-6042f1.json",
        ),
        ("s3://bucket/prefix/versions/v1.json", "versions/v1.json"),
        ("", ""),
        ("embedded default", "embedded default"),
    ],
)
def test_a_rounds_source_is_the_version_file_inside_the_store(source, kept):
    assert _in_store(source) == kept
