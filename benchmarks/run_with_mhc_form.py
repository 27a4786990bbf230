"""Run a benchmark script with the decode step's mHC projection form chosen from a ``bench_decode_glue.py`` result
measured just before in the same process tree (the faster of "one_pass" / "dot" / "split_dot" at the largest batch
timed): ``ops.mhc._DOT_MIN_TOKENS`` / ``_DOT_SPLIT`` set before the script runs.

    python benchmarks/run_with_mhc_form.py GLUE_JSON SCRIPT [ARGS...]
"""

import json
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dsv41_jax.ops import mhc as M  # noqa: E402


def main():
    glue, script, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    if not os.path.exists(glue):  # the bench did not run: the code's default form
        print(f"{glue} missing: the default mHC projection form (_DOT_MIN_TOKENS {M._DOT_MIN_TOKENS})", flush=True)
        sys.argv = [script] + rest
        runpy.run_path(script, run_name="__main__")
        return
    rows = [r for r in json.load(open(glue))["rows"] if r["part"] == "mhc"]
    top = max(r["batch"] for r in rows)
    us = {r["form"]: r["us_per_site"] for r in rows if r["batch"] == top}
    best = min(us, key=us.get)
    M._DOT_MIN_TOKENS = 2 if best in ("dot", "split_dot") else 1 << 30
    M._DOT_SPLIT = best == "split_dot"
    print(f"mHC projection form for the step: {best} (batch {top}: {us}); _DOT_MIN_TOKENS {M._DOT_MIN_TOKENS}, "
          f"_DOT_SPLIT {M._DOT_SPLIT}", flush=True)
    sys.argv = [script] + rest
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
