"""Where the test suite's XLA compile time goes: a pytest plugin that writes one JSON line per XLA compile (a
persistent-cache miss: program name, cache key, wall and CPU seconds) and per persistent-cache hit, with the test
that caused it, and a summary of those lines (compile CPU per test, the same program compiled more than once, the
compiles under the suite's 30 ms cache threshold).

    DSV41_COMPILE_MAP=/tmp/compile_map PYTHONPATH=$PWD:$PWD/benchmarks \
        python -m pytest -n 2 -p suite_compile_map tests     # one file per worker in /tmp/compile_map
    python benchmarks/suite_compile_map.py /tmp/compile_map   # the summary

The plugin wraps two private functions of jax's compiler module (checked on jax 0.10): where they are missing it
says so and records nothing. Subprocesses (notebook generators, AOT compiles, multi-process tests) are not seen.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys
import time

_DIR = os.environ.get("DSV41_COMPILE_MAP")
_out = None


def _write(rec: dict) -> None:
    global _out
    if _out is None:
        os.makedirs(_DIR, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _out = open(os.path.join(_DIR, f"compiles.{worker}.{os.getpid()}.jsonl"), "a")
    rec["test"] = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    rec["t"] = round(time.time(), 2)
    _out.write(json.dumps(rec) + "\n")
    _out.flush()


def _install() -> None:
    import jax._src.compiler as compiler

    compile_and_write = getattr(compiler, "_compile_and_write_cache", None)
    log_hit = getattr(compiler, "log_persistent_cache_hit", None)
    if compile_and_write is None or log_hit is None:
        print("suite_compile_map: this jax has no _compile_and_write_cache / log_persistent_cache_hit; "
              "nothing is recorded", file=sys.stderr)
        return

    def timed_compile(backend, computation, devices, options, host_callbacks, module_name, cache_key, *a, **k):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return compile_and_write(backend, computation, devices, options, host_callbacks, module_name, cache_key,
                                     *a, **k)
        finally:
            _write({"ev": "compile", "name": module_name, "key": cache_key,
                    "s": round(time.perf_counter() - t0, 4), "cpu": round(time.process_time() - c0, 4)})

    def hit(module_name, cache_key):
        _write({"ev": "hit", "name": module_name, "key": cache_key})
        return log_hit(module_name, cache_key)

    compiler._compile_and_write_cache = timed_compile
    compiler.log_persistent_cache_hit = hit


if _DIR and __name__ != "__main__":  # imported as a pytest plugin (-p suite_compile_map)
    _install()


def summarize(directory: str, top: int = 30) -> None:
    recs = []
    for path in glob.glob(os.path.join(directory, "compiles.*.jsonl")):
        worker = os.path.basename(path).split(".")[1]
        with open(path) as f:
            recs += [dict(json.loads(line), worker=worker) for line in f]
    compiles = [r for r in recs if r["ev"] == "compile"]
    by_key = collections.defaultdict(list)
    for r in compiles:
        by_key[r["key"]].append(r)
    # CPU of every compile of a key after its cheapest: what a cache hit would have saved at most
    repeated = sorted(((sum(x["cpu"] for x in v) - min(x["cpu"] for x in v), k, v)
                       for k, v in by_key.items() if len(v) > 1), reverse=True)
    small = [r for r in compiles if r["cpu"] < 0.03]
    print(f"{len(compiles)} compiles, {sum(r['cpu'] for r in compiles):.1f} CPU-s; "
          f"{sum(r['ev'] == 'hit' for r in recs)} persistent-cache hits")
    per_worker = collections.Counter()
    for r in compiles:
        per_worker[r["worker"]] += r["cpu"]
    print("compile CPU-s per worker:", {w: round(c, 1) for w, c in sorted(per_worker.items())})
    print(f"the same program compiled again: {len(repeated)} programs, {sum(w for w, _, _ in repeated):.1f} CPU-s")
    for waste, key, v in repeated[:10]:
        print(f"  {waste:6.1f}  {key[:70]}  in {sorted({x['test'] for x in v})[:3]}")
    print(f"compiles under 30 ms of CPU: {len(small)}, {sum(r['cpu'] for r in small):.1f} CPU-s")
    per_test = collections.Counter()
    for r in compiles:
        per_test[r["test"]] += r["cpu"]
    print(f"compile CPU-s per test (top {top}):")
    for test, cpu in per_test.most_common(top):
        print(f"  {cpu:6.1f}  {test}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/suite_compile_map.py DIR   (the DSV41_COMPILE_MAP of the run)")
    summarize(sys.argv[1])
