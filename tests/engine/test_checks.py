import numpy as np
import pytest

from moelora.engine.checks import check_prompt
from moelora.errors import InvalidRequestError


def test_check_prompt_takes_plain_and_numpy_ints_in_range():
    check_prompt([0, 5, 99], vocab=100, max_len=8)  # the fast path: plain ints
    check_prompt([np.int64(3), 7, np.int32(99)], vocab=100, max_len=8)  # numpy's integers


@pytest.mark.parametrize(
    "ids,named",
    [([1, 100], "100"), ([-1, 2], "-1"), ([1, True], "True"), ([3, 2.0], "2.0"), ([1, "7"], "'7'")],
)
def test_check_prompt_names_the_first_bad_id(ids, named):
    with pytest.raises(InvalidRequestError, match=f"prompt token id {named} is invalid"):
        check_prompt(ids, vocab=100, max_len=8)
