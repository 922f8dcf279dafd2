"""tests/support/wait.py: a wait on a condition returns its first truthy value, and names what it waited for when
the deadline passes (the suite's waits on processes and ranks rely on both)."""

from __future__ import annotations

import pytest

from tests.support.wait import WaitTimeout, wait_until


def test_the_wait_returns_the_first_truthy_value_of_the_condition():
    answers = iter([None, [], 0, ["ready"], ["later"]])
    assert wait_until(lambda: next(answers), "an answer", poll_s=0) == ["ready"]
    assert next(answers) == ["later"]  # polled no further than the first truthy value


def test_the_wait_fails_naming_what_it_waited_for_once_the_deadline_passed():
    polls = []
    with pytest.raises(WaitTimeout, match=r"^the peer to start: not within 0 s$"):
        wait_until(lambda: polls.append(1), "the peer to start", timeout_s=0, poll_s=0)
    assert polls == [1]  # polled once, even with no time left
