"""`accounting.json_input`: the one bounded reader of untrusted JSON, and the files that read through it.

Every payload here is one an attacker or an unlucky user produced against an earlier reader: a
FIFO nobody writes, a link to /dev/zero (`--hf-config`'s cases are in unit/test_hf_config.py), NaN, a number that overflows to infinity, a duplicate
key, nesting past the recursion limit, a 5000-digit integer. Each must be a one-line
`JsonInputError` naming the file (and the field, for the typed helpers), never a hang, a
traceback or gigabytes read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accounting.json_input import (
    MAX_DEPTH,
    JsonInputError,
    check_number,
    get_bool,
    get_int,
    get_number,
    get_str,
    load_json,
    parse_json,
    printable,
    read_regular_file,
    require_list,
    require_object,
)

pytestmark = pytest.mark.L0

ROOT = Path(__file__).resolve().parent.parent

STRICT_REFUSALS = {
    "NaN": (b'{"a": NaN}', "NaN is not a JSON number"),
    "Infinity": (b'{"a": Infinity}', "Infinity is not a JSON number"),
    "-Infinity": (b'{"a": [-Infinity]}', "-Infinity is not a JSON number"),
    "a float that overflows to infinity": (b'{"a": 1e999}', "overflows a float"),
    "a duplicate key": (b'{"a": 1, "a": 2}', "appears twice"),
    "a 5000-digit integer": (b'{"a": 1' + b"0" * 5000 + b"}", "not JSON the kit reads"),
    "nesting past the recursion limit": (b"[" * 100_000 + b"]" * 100_000, "nested deeper than"),
    "nesting past MAX_DEPTH": (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "nested deeper than"),
    "not UTF-8": (b'{"a": "\xff\xfe"}', "is not UTF-8 text"),
    "truncated": (b'{"a": [1, 2', "is not JSON: "),
}


@pytest.mark.parametrize("case", sorted(STRICT_REFUSALS))
def test_what_is_not_strict_json_is_a_one_line_error_naming_the_file(case: str, tmp_path: Path) -> None:
    data, says = STRICT_REFUSALS[case]
    path = tmp_path / "in.json"
    path.write_bytes(data)
    with pytest.raises(JsonInputError) as err:
        load_json(path, what="golden file")
    message = str(err.value)
    assert says in message and "\n" not in message, message
    assert message.startswith(f"golden file {path}"), message


def test_nesting_up_to_max_depth_and_plain_json_read_back_unchanged(tmp_path: Path) -> None:
    deep = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert parse_json(deep, where="x") == json.loads(deep)
    value = {"a": [1, 2.5, -3e-5, "text", None, True], "b": {"c": {}}}
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(value))
    assert load_json(path) == value


def test_a_fifo_a_device_and_a_directory_are_refused_before_a_byte_is_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # nobody writes: a blocking open would wait forever
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")  # endless: a plain read would take all memory
    for path in (fifo, zero, tmp_path):
        with pytest.raises(JsonInputError, match="is not a regular file"):
            read_regular_file(path, 1024, "hf config")


def test_a_file_past_the_limit_is_refused_after_reading_at_most_limit_plus_one_bytes(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    with open(path, "wb") as f:
        f.truncate(1 << 34)  # 16 GiB, sparse: no disk used, and far more than memory holds
    with pytest.raises(JsonInputError, match="is larger than 4096 bytes"):
        load_json(path, limit=4096)
    path.write_bytes(b"[" + b"1," * 100 + b"1]")
    assert len(load_json(path, limit=4096)) == 101


def test_a_missing_file_says_it_cannot_be_read_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(JsonInputError, match=r"^kit report .*missing\.json: cannot read it \(No such file"):
        load_json(tmp_path / "missing.json", what="kit report")


def test_a_hostile_file_name_is_escaped_in_the_message(tmp_path: Path) -> None:
    path = tmp_path / "a\x1b[2Jb\nc.json"
    path.write_text("{")
    with pytest.raises(JsonInputError) as err:
        load_json(path)
    assert "\x1b" not in str(err.value) and "\n" not in str(err.value)
    assert "\\x1b[2J" in str(err.value)


def test_the_typed_field_helpers_name_the_field_in_one_line() -> None:
    obj = {"s": "x", "i": 3, "f": 1.5, "b": True, "n": None, "l": [1, 2], "o": {}}
    assert get_str(obj, "s", "golden") == "x"
    assert get_int(obj, "i", "golden", low=0, high=3) == 3
    assert get_number(obj, "f", "golden") == 1.5 and get_number(obj, "i", "golden") == 3
    assert get_bool(obj, "b", "golden") is True
    assert get_str(obj, "n", "golden", nullable=True) is None
    assert get_int(obj, "absent", "golden", default=7) == 7
    assert require_list(obj["l"], "golden.l", max_items=2) == [1, 2]
    assert require_object(obj["o"], "golden.o") == {}
    refusals = [
        (
            lambda: get_str(obj, "i", "golden.series['loss']"),
            "golden.series['loss'].i is not text (got an integer)",
        ),
        (lambda: get_int(obj, "b", "rec"), "rec.b is not an integer (got a boolean)"),
        (lambda: get_int(obj, "i", "rec", high=2), "rec.i = 3 is outside [None, 2]"),
        (lambda: get_number(obj, "s", "rec"), "rec.s is not a number (got text)"),
        (lambda: get_bool(obj, "i", "rec"), "rec.i is not true or false (got an integer)"),
        (lambda: get_str(obj, "absent", "rec"), "rec has no 'absent'"),
        (lambda: get_str(obj, "s", "rec", max_chars=0), "rec.s is longer than 0 characters"),
        (lambda: require_list(obj["l"], "rec.l", max_items=1), "rec.l has more than 1 entries"),
        (lambda: require_object([], "rec"), "rec is not an object (got a list)"),
        (lambda: check_number(float("inf"), "rec.v"), "rec.v = inf is not a finite number"),
        (lambda: check_number(float("nan"), "rec.v"), "rec.v = nan is not a finite number"),
    ]
    for call, says in refusals:
        with pytest.raises(JsonInputError) as err:
            call()
        assert str(err.value) == says


def test_printable_escapes_control_and_format_characters() -> None:
    assert printable("ok\x1b[31m\u202e\n\x00") == "ok\\x1b[31m\\u202e\\n\\x00"
    assert printable("abcdef", 4) == "abc…"


def test_importing_the_reader_imports_no_torch() -> None:
    """The kit's plugin and `python -m ci job` read through it where torch is not installed."""
    code = "import sys, accounting.json_input; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False"
