"""The lock that lets two test workers share the machine and an ``exclusive`` test have it alone
(tests/helpers/machine_lock.py). Threads stand in for the workers: each ``open`` is its own
open file description, so ``flock`` treats them as it treats two processes."""

from __future__ import annotations

import threading

from machine_lock import Hold, machine

WAIT_S = 10  # for what must happen (a thread entering); "must not" is checked after 0.3 s


class Holder(threading.Thread):
    """Enters ``machine(folder, alone)``, sets ``inside``, stays until ``leave`` is set."""

    def __init__(self, folder, alone: bool, entered: list[str], name: str):
        super().__init__(daemon=True)
        self.folder, self.alone, self.entered, self.label = folder, alone, entered, name
        self.inside, self.leave = threading.Event(), threading.Event()

    def run(self) -> None:
        with machine(self.folder, self.alone):
            self.entered.append(self.label)
            self.inside.set()
            self.leave.wait(WAIT_S)


def test_sharers_are_in_together(tmp_path):
    entered: list[str] = []
    a, b = (Holder(tmp_path, False, entered, n) for n in "ab")
    a.start()
    assert a.inside.wait(WAIT_S)
    b.start()
    assert b.inside.wait(WAIT_S), "a second sharer waited for the first"
    for t in (a, b):
        t.leave.set()
        t.join()


def test_alone_waits_for_the_sharers_and_a_later_sharer_waits_for_it(tmp_path):
    entered: list[str] = []
    first = Holder(tmp_path, False, entered, "first sharer")
    alone = Holder(tmp_path, True, entered, "alone")
    later = Holder(tmp_path, False, entered, "later sharer")
    first.start()
    assert first.inside.wait(WAIT_S)
    alone.start()
    assert not alone.inside.wait(0.3), "the exclusive one entered beside a sharer"
    later.start()
    assert not later.inside.wait(0.3), "a sharer went ahead of the waiting exclusive one"
    first.leave.set()
    assert alone.inside.wait(WAIT_S)
    assert not later.inside.wait(0.3), "a sharer entered beside the exclusive one"
    alone.leave.set()
    assert later.inside.wait(WAIT_S)
    later.leave.set()
    for t in (first, alone, later):
        t.join()
    assert entered == ["first sharer", "alone", "later sharer"]


def test_a_run_of_tests_alone_keeps_the_machine_until_its_last(tmp_path):
    """A worker's test alone whose next test is alone too keeps the machine: the other worker's
    sharer, arriving between them, enters only after the last of the run."""
    hold = Hold(tmp_path)
    entered: list[str] = []
    with hold.test(alone=True, keep_alone=True):
        pass
    sharer = Holder(tmp_path, False, entered, "sharer")
    sharer.start()
    assert not sharer.inside.wait(0.3), "a sharer entered between two tests alone"
    with hold.test(alone=True, keep_alone=False):
        entered.append("second alone")
    assert sharer.inside.wait(WAIT_S)
    sharer.leave.set()
    sharer.join()
    with hold.test(alone=False):  # the worker's own next test shares again
        entered.append("shared")
    assert entered == ["second alone", "sharer", "shared"]


def test_a_kept_hold_is_given_up_for_a_shared_test_and_at_the_end(tmp_path):
    hold = Hold(tmp_path)
    with hold.test(alone=True, keep_alone=True):
        pass
    with hold.test(alone=False):  # the run ended early: shared now, not alone
        other = Holder(tmp_path, False, [], "other")
        other.start()
        assert other.inside.wait(WAIT_S), "the kept hold was not given up"
        other.leave.set()
        other.join()
    with hold.test(alone=True, keep_alone=True):
        pass
    hold.release()
    after = Holder(tmp_path, False, [], "after")
    after.start()
    assert after.inside.wait(WAIT_S), "release() did not give the machine up"
    after.leave.set()
    after.join()
