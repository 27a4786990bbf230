"""This process's host memory, split the way the loading bound needs it (Linux ``/proc/self/status``).

``VmRSS`` mixes three kinds of resident pages: ``RssAnon`` (heap, numpy buffers, XLA host buffers, pinned staging
memory), ``RssFile`` (file-backed pages: shared libraries, memory-mapped files) and ``RssShmem`` (shared memory,
including some drivers' mappings). The loader reads with ``pread`` into fresh buffers and maps nothing, so what it
adds shows up as anonymous memory; file pages stay at the libraries' size.

    with PeakSampler() as peak:          # samples every 2 ms in a thread; also resets the kernel's VmHWM
        load(...)
    peak.max["RssAnon"], peak.hwm        # sampled peak of anonymous RSS, the kernel's exact peak of VmRSS
"""

from __future__ import annotations

import threading

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")


def rss() -> dict[str, int]:
    """The :data:`FIELDS` of ``/proc/self/status`` in bytes (empty where the kernel does not provide them)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in FIELDS:
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def reset_peak() -> bool:
    """Reset the kernel's peak RSS (``VmHWM``) to the current RSS (``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakSampler:
    """Peak of each RSS field over a ``with`` block, sampled every ``interval`` seconds from a thread (a buffer
    that lives shorter than one interval can be missed; ``hwm`` is the kernel's exact peak of the total)."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.max: dict[str, int] = {}
        self.hwm = 0
        self.hwm_reset = False
        self._stop = threading.Event()

    def _sample(self) -> None:
        for k, v in rss().items():
            if v > self.max.get(k, 0):
                self.max[k] = v

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self):
        self.hwm_reset = reset_peak()
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()
        self.hwm = rss().get("VmHWM", 0)
        return False


def gib(n: float) -> float:
    return n / float(1 << 30)


__all__ = ["rss", "reset_peak", "PeakSampler", "FIELDS", "gib"]
