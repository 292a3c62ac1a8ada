"""Where the file store's compiled reader puts a cold page file: through staging, or
straight into the pool.

Both read a file that the page cache does not hold with O_DIRECT, one request per
run of parts, and hash it on a thread beside the reader while the next file is read.
They differ in where the disk writes it:

- ``staged``: a few stretches of staging, used over and over, copied out to the pool
  once the file checks out;
- ``in_place``: the pool's own pages (pieces the layout cannot read in place still
  go through staging).

Which is faster is the machine's: on the VM where staging was added (a virtio disk
reading 2-3 GB/s), staging read 8 MiB ``page_first`` pages at 3.2 GB/s against 2.4 in
place; on an AMD EPYC VM whose disk reads 4.5 GB/s with O_DIRECT, in place read them
at 3.7-4.0 against 2.9-3.1 (MiMo-like pages the same way), alternated in one process.
So a store learns it from its own reads (``cold_reads="auto"``): its first cold
batches try each mode in turn, then it keeps the faster one, trying the other every
:attr:`ColdReads.EXPLORE` cold batches so that it follows a change.
``"staged"`` or ``"in_place"`` fixes the mode.
"""

from __future__ import annotations

import threading

from ..errors import UsageError

MODES = ("staged", "in_place")
CHOICES = ("auto", *MODES)


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`CHOICES`, else a :class:`UsageError` (a
    ``ValueError``) naming them."""
    if mode not in CHOICES:
        raise UsageError(f"cold_reads must be one of {', '.join(CHOICES)}, got {mode!r}")
    return mode


class ColdReads:
    """The mode of each batch, learned from the batches whose files were all cold (a
    batch that read cached files too times the page cache as well)."""

    TRIALS = 2    # the first cold batches, one in each mode
    EXPLORE = 16  # then one cold batch in this many tries the mode not kept
    WEIGHT = 0.3  # of the latest batch in a mode's running rate
    MIN_FILES = 2  # a batch of fewer cold files teaches nothing

    def __init__(self, mode: str = "auto") -> None:
        self.fixed = None if check_mode(mode) == "auto" else mode
        self._lock = threading.Lock()
        self._rate: dict[str, float | None] = dict.fromkeys(MODES)  # bytes/s, a running average
        self._learned = 0  # cold batches learned from

    def pick(self) -> str:
        """The mode for the next batch."""
        if self.fixed is not None:
            return self.fixed
        with self._lock:
            n = self._learned
            if n < self.TRIALS:
                return MODES[n % 2]
            untried = [m for m in MODES if self._rate[m] is None]  # (concurrent batches of one mode)
            if untried:
                return untried[0]
            kept = max(MODES, key=lambda m: self._rate[m])
            return _other(kept) if n % self.EXPLORE == 0 else kept

    def learn(self, mode: str, files: int, cold_files: int, nbytes: int, seconds: float) -> None:
        """A batch in ``mode`` read ``files`` files, ``cold_files`` of them cold (with
        O_DIRECT), ``nbytes`` bytes in all, in ``seconds``."""
        if self.fixed is not None or cold_files < self.MIN_FILES or cold_files != files or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            old = self._rate[mode]
            self._rate[mode] = rate if old is None else old + self.WEIGHT * (rate - old)
            self._learned += 1

    def rates(self) -> dict[str, float | None]:
        """Each mode's running rate, bytes/s (``None`` before its first cold batch)."""
        with self._lock:
            return dict(self._rate)


def _other(mode: str) -> str:
    return MODES[1 - MODES.index(mode)]
