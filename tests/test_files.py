"""The one bounded way edgetorch reads a file someone else made (edgetorch._files)."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import edgetorch
from edgetorch._files import InputFileError, parse_json, read_bytes, read_json


class _Mine(InputFileError):
    pass


def test_a_regular_file_within_its_limit_is_read_whole(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 100)
    assert read_bytes(tmp_path / "f", 100) == b"x" * 100


@pytest.mark.parametrize("make, match", [
    (lambda p: None, "is missing"),
    (lambda p: p.mkdir(), "not a regular file .a directory"),
    (lambda p: os.mkfifo(p), "not a regular file .a FIFO"),
    (lambda p: p.write_bytes(b"x" * 101), "101 bytes, over the 100-byte limit"),
    (lambda p: p.symlink_to(p), "cannot be opened as a regular file"),  # a symlink loop
], ids=["missing", "directory", "fifo", "too-large", "symlink-loop"])
def test_what_is_not_a_small_regular_file_is_refused_with_the_loaders_error(tmp_path, make, match):
    """A FIFO used to block the reader forever: it is refused without waiting for a writer."""
    path = tmp_path / "f.json"
    make(path)
    with pytest.raises(_Mine, match=match):
        read_bytes(path, 100, error=_Mine)


def test_a_symlink_is_refused_only_when_asked(tmp_path):
    (tmp_path / "real").write_bytes(b"{}")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert read_json(tmp_path / "link") == {}
    with pytest.raises(InputFileError, match="symlinks are refused"):
        read_json(tmp_path / "link", follow_symlinks=False)


def test_a_huge_limit_allocates_only_what_the_file_holds(tmp_path):
    """A limit computed from a manifest's claims was ~2 TB, and reading `limit` bytes allocated it."""
    (tmp_path / "f").write_bytes(b"abc")
    assert read_bytes(tmp_path / "f", 1 << 41) == b"abc"


@pytest.mark.parametrize("text, match", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply|deeper than"),
    ("[" * 33 + "]" * 33, "deeper than 32 levels"),
    ("1" * 5000, "not valid JSON"),
    ('{"a": 1', "not valid JSON"),
], ids=["recursion", "depth", "huge-int", "truncated"])
def test_json_that_is_not_json_or_nests_too_deep_is_refused(tmp_path, text, match):
    (tmp_path / "f.json").write_text(text)
    with pytest.raises(_Mine, match=match):
        read_json(tmp_path / "f.json", error=_Mine)


def test_json_that_is_not_utf8_is_refused(tmp_path):
    (tmp_path / "f.json").write_bytes(b'{"a": "\xff"}')
    with pytest.raises(InputFileError, match="not UTF-8"):
        read_json(tmp_path / "f.json")


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(), lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                     max_leaves=30)


@settings(max_examples=200, deadline=None)
@given(_json)
def test_plain_json_round_trips(value):
    assert parse_json(json.dumps(value), what="x") == value


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_any_text_parses_or_is_refused_with_the_packages_error(text):
    try:
        parse_json(text, what="x")
    except InputFileError:
        pass


def test_every_loaders_error_is_an_input_file_error():
    from edgetorch.data.folder import ImageFolderError
    from edgetorch.data.idx import IDXFormatError
    from edgetorch.split import SplitArtifactError
    from edgetorch.weights import CheckpointError

    assert edgetorch.InputFileError is InputFileError
    for error in (ImageFolderError, IDXFormatError, SplitArtifactError, CheckpointError):
        assert issubclass(error, InputFileError) and issubclass(error, ValueError)
