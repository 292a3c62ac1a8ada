"""kvtier.storage.cold_reads: the file store's choice of where cold files are read to,
learned from its own all-cold batches (the store's reads in each mode are tested,
bit for bit, in test_file_reads.py)."""

import threading

import pytest

from kvtier.storage.cold_reads import ColdReads

MB = 1 << 20


def learn(reads: ColdReads, mode: str, gb_s: float, files: int = 8) -> None:
    reads.learn(mode, files, files, files * 8 * MB, files * 8 * MB / (gb_s * 1e9))


def test_the_first_batches_try_each_mode_then_the_faster_is_kept_and_the_other_tried_now_and_then():
    reads = ColdReads()
    speeds = {"staged": 3.0, "in_place": 4.0}
    picked = []
    for _ in range(3 * ColdReads.EXPLORE):
        mode = reads.pick()
        picked.append(mode)
        learn(reads, mode, speeds[mode])
    assert picked[:ColdReads.TRIALS] == ["staged", "in_place"] * (ColdReads.TRIALS // 2)
    rest = picked[ColdReads.TRIALS:]
    explored = [n for n in range(ColdReads.TRIALS, 3 * ColdReads.EXPLORE) if n % ColdReads.EXPLORE == 0]
    assert rest.count("staged") == len(explored) == 2
    assert all(m == "staged" for n, m in enumerate(picked) if n >= ColdReads.TRIALS and n % ColdReads.EXPLORE == 0)
    rates = reads.rates()
    assert rates["in_place"] == pytest.approx(4e9) and rates["staged"] == pytest.approx(3e9)


def test_a_mode_that_slows_down_is_left():
    reads = ColdReads()
    for _ in range(ColdReads.TRIALS):
        mode = reads.pick()
        learn(reads, mode, 4.0 if mode == "staged" else 3.0)
    assert reads.pick() == "staged"
    while reads.pick() == "staged":  # the machine changes: staging now reads at a third
        learn(reads, "staged", 1.0)
    assert reads.pick() == "in_place" and reads.rates()["staged"] < reads.rates()["in_place"]


@pytest.mark.parametrize("files, cold, seconds", [(8, 7, 0.01), (1, 1, 0.01), (8, 8, 0.0), (0, 0, 0.01)],
                         ids=["some cached", "one file", "no time", "nothing"])
def test_batches_that_are_not_all_cold_teach_nothing(files, cold, seconds):
    reads = ColdReads()
    reads.learn("staged", files, cold, files * MB, seconds)
    assert reads.rates() == {"staged": None, "in_place": None} and reads.pick() == "staged"


@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_a_fixed_mode_is_kept_whatever_the_batches_ran_at(mode):
    reads = ColdReads(mode)
    for _ in range(40):
        assert reads.pick() == mode
        learn(reads, mode, 0.1)
    assert reads.rates() == {"staged": None, "in_place": None}


def test_concurrent_batches_of_one_mode_still_leave_the_other_tried():
    reads = ColdReads()
    for _ in range(ColdReads.TRIALS):  # every trial batch ran in staging (two at once, say)
        learn(reads, "staged", 3.0)
    assert reads.pick() == "in_place"
    learn(reads, "in_place", 2.0)
    assert reads.pick() == "staged"


def test_threads_learning_at_once_count_every_batch():
    reads = ColdReads()
    threads = [threading.Thread(target=lambda: [learn(reads, "staged", 3.0) for _ in range(200)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reads._learned == 800 and reads.rates()["staged"] == pytest.approx(3e9)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="cold_reads must be one of auto, staged, in_place, got 'fast'"):
        ColdReads("fast")
