from __future__ import annotations

import numpy as np
import pytest

from lit_seqpack._checks import check_choice, check_flag, check_int, check_optional_int, round_up


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3)])
def test_check_int_returns_a_python_int(value):
    out = check_int("n", value, minimum=1, maximum=3)
    assert out == 3 and type(out) is int


@pytest.mark.parametrize(
    ("value", "bounds", "message"),
    [
        (True, {"minimum": 0}, "n must be an int >= 0, got True"),  # a bool is not a count
        (np.bool_(True), {"minimum": 0}, "n must be an int >= 0, got "),
        (2.0, {"minimum": 0}, "n must be an int >= 0, got 2.0"),  # no silent truncation of floats
        ("4", {}, "n must be an int, got '4'"),
        (None, {"minimum": 1}, "n must be an int >= 1, got None"),
        (0, {"minimum": 1}, "n must be an int >= 1, got 0"),
        (9, {"minimum": 0, "maximum": 8}, r"n must be an int in \[0, 8\], got 9"),
        (9, {"maximum": 8}, "n must be an int <= 8, got 9"),
    ],
)
def test_check_int_names_the_setting_and_the_bad_value(value, bounds, message):
    with pytest.raises(ValueError, match=message):
        check_int("n", value, **bounds)


def test_check_optional_int_allows_none_and_says_so():
    assert check_optional_int("m", None, minimum=1) is None
    assert check_optional_int("m", np.int64(4), minimum=1) == 4
    with pytest.raises(ValueError, match="m must be an int >= 1 or None, got 0"):
        check_optional_int("m", 0, minimum=1)


@pytest.mark.parametrize("value", ["false", 1, None])
def test_check_flag_refuses_what_is_not_a_bool(value):
    with pytest.raises(TypeError, match=f"shuffle={value!r} must be a bool"):
        check_flag("shuffle", value)
    assert check_flag("shuffle", np.bool_(True)) is True


def test_check_choice_refuses_a_bool_that_equals_a_choice():
    assert check_choice("k", 1, (1, 2)) == 1
    with pytest.raises(ValueError, match=r"k=True must be one of \(1, 2\)"):
        check_choice("k", True, (1, 2))
    with pytest.raises(ValueError, match=r"k=\['a'\] must be one of \('a',\)"):
        check_choice("k", ["a"], ("a",))


def test_round_up_on_ints_and_arrays():
    assert round_up(0, 8) == 0 and round_up(1, 8) == 8 and round_up(8, 8) == 8 and round_up(7, None) == 7
    assert round_up(np.array([1, 8, 9]), 8).tolist() == [8, 8, 16]
