"""Every malformed copy is CopyInvalid: arbitrary bytes, and valid framing and checksum around
any header (a JSON list, a number, nesting deeper than the parser's limit, non-UTF-8, a length
past the end, a broken object table). Loads and the start-up scan never raise anything else.
Hypothesis runs derandomized (the same examples every run, no example database)."""
from __future__ import annotations

import hashlib
import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcheck.reference.tiers import MAGIC, CopyInvalid, TierStore, pack, unpack

KEY = "c" * 64
FIXED_EXAMPLES = {"deadline": None, "derandomize": True, "database": None}
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                    max_leaves=20)
FIELDS = st.fixed_dictionaries({}, optional={
    "format": st.sampled_from([2, 1, "2", 2.0, True, None]),
    "payload_len": st.integers(-2, 40) | st.booleans() | st.text(max_size=3),
    "objects": JSON | st.lists(st.dictionaries(st.sampled_from(["g", "kind", "offset", "nbytes", "ver"]),
                                               st.integers(-5, 50) | st.text(max_size=3), max_size=5), max_size=3),
    "bind": JSON | st.fixed_dictionaries({"key": st.just(KEY) | st.text(max_size=3)}),
    "block": JSON, "model_id": JSON})


def frame(header: bytes, payload: bytes = b"", hlen: int | None = None) -> bytes:
    body = MAGIC + struct.pack("<I", len(header) if hlen is None else hlen) + header + payload
    return body + hashlib.sha256(body).digest()


def only_copy_invalid(blob: bytes) -> None:
    try:
        header, _ = unpack(blob)
    except CopyInvalid:
        return
    assert isinstance(header, dict)


@pytest.mark.parametrize("header", [
    b"[1, 2]", b"3", b'"x"', b"null", b"[" * 100_000 + b"]" * 100_000, b'{"a": ' * 50_000 + b"1" + b"}" * 50_000,
    b"\xff\xfe{}", b'{"format": 2, "payload_len": 0, "objects": {"g": 1}}',
    b'{"format": 2, "payload_len": 0, "objects": [{"g": 0, "kind": "tail", "offset": 0, "nbytes": 99}]}',
    b'{"format": 2, "payload_len": 0, "bind": [1]}', b'{"format": 2, "payload_len": true}',
    b"9" * 5000, b'{"format": NaN}',
])
def test_malformed_headers_with_a_valid_checksum(header) -> None:
    with pytest.raises(CopyInvalid):
        unpack(frame(header))


def test_header_length_past_the_end() -> None:
    for hlen in (2**32 - 1, 2**20 + 1, 40):
        with pytest.raises(CopyInvalid, match="header length"):
            unpack(frame(b"{}", hlen=hlen))


def test_header_length_must_not_reach_into_the_checksum() -> None:
    good = pack({"x": 1}, b"")
    (hlen,) = struct.unpack("<I", good[8:12])
    with pytest.raises(CopyInvalid):
        unpack(frame(good[12:12 + hlen], hlen=hlen + 32))


@settings(max_examples=300, **FIXED_EXAMPLES, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_arbitrary_bytes(blob) -> None:
    only_copy_invalid(blob)
    only_copy_invalid(MAGIC + blob)


@settings(max_examples=300, **FIXED_EXAMPLES)
@given(JSON, st.binary(max_size=40))
def test_valid_framing_around_any_json(doc, payload) -> None:
    only_copy_invalid(frame(json.dumps(doc).encode(), payload))


@settings(max_examples=300, **FIXED_EXAMPLES)
@given(FIELDS, st.binary(max_size=40))
def test_valid_framing_around_header_like_json(doc, payload) -> None:
    only_copy_invalid(frame(json.dumps(doc).encode(), payload))


@settings(max_examples=200, **FIXED_EXAMPLES)
@given(st.binary(max_size=64), st.binary(max_size=40))
def test_valid_framing_around_any_header_bytes(header, payload) -> None:
    only_copy_invalid(frame(header, payload))


@settings(max_examples=60, **FIXED_EXAMPLES,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(FIELDS, st.binary(max_size=40))
def test_load_and_recovery_only_raise_copy_invalid(tmp_path_factory, doc, payload) -> None:
    d = tmp_path_factory.mktemp("t")
    (d / f"{KEY}.kvblk").write_bytes(frame(json.dumps(doc).encode(), payload))
    t = TierStore(d)                                  # the scan quarantines or indexes, never raises
    assert t.recovery["scanned"] == 1
    assert t.recovery["recovered"] + t.recovery["quarantined"] == 1
    if t.recovery["recovered"]:
        t.expect(KEY, {"block": 0})
        t.load(KEY)
        with pytest.raises(CopyInvalid):
            t.loaded(KEY)
    t.close()
