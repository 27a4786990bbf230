"""Where a batch-1 DSpark verification step's time goes against a plain decode step, on the recipe of the DSpark
bench's call 11 (``bench_dspark_h200.py --target-experts 8 --target-topk 6 --drafter-experts 4 --block-size 7``),
in one process: both device loops timed, then profiled (``jax.profiler.trace``), the speculative step's device time
split into its phases (the named scopes of ``inference.speculative.SCOPES``: verification, acceptance, rollback,
the DSpark rings, the next block's drafting, the rest of the chain), and the drafter's program timed alone.

    PYTHONUNBUFFERED=1 python benchmarks/profile_dspark_step.py --out DIR [--variants before,base] [--budget-s 200]

Weights are random (std 0.02): a step's cost does not depend on them (static shapes; routing near uniform, so the
8-token chunk picks nearly all 8 experts, as the trained router did: call 11's byte count), but acceptance does,
so the tokens per step that turn the step times into a speed-up are call 11's measured ones (``--tokens-per-step``).
Variants (each its own programs, ``VARIANTS``): ``base`` (the engine's defaults: since DSpark call 14 XLA's Triton
GEMMs in the speculative programs on the GPU), ``cublas`` (the defaults with cuBLAS GEMMs in the speculative programs
too, as the process's flag says), ``before`` (as call 11 ran: cuBLAS, XLA's dot merger on in the decode programs —
it copies the weights of projections sharing an input into one matrix before their GEMM, every step — and the
speculative device loop one run at a time), ``merge`` / ``nopipe`` (one of the two), ``triton`` (XLA's Triton GEMMs
back on in every program, autotuned; the bench turns them off for compile time). Kernels are attributed to phases through the optimised HLO each compile dumps
(``--xla_dump_to``): a trace's per-op line ("XLA Ops") names the HLO instruction, whose ``op_name`` carries the scope.

Output: the tables on stdout, ``DIR/profile_dspark_step.json``, ``DIR/traces.tar.gz`` (the traces and the traced
programs' optimised HLO, for reading offline).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import statistics
import sys
import tarfile
import time

DUMP = "/tmp/profile_dspark_step_hlo"
if __name__ == "__main__":
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_triton_gemm" not in flags:  # as bench_dspark_h200 runs
        flags += " --xla_gpu_enable_triton_gemm=false"
    flags += (f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text"
              " --xla_dump_hlo_module_re=.*(speculative_chain|decode_chain|draft_from_rings).*")
    os.environ["XLA_FLAGS"] = flags.strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_dspark_h200 import inference_params, step_bytes, target_config  # noqa: E402
from benchmarks.bench_speculative import heldout_prompts  # noqa: E402
from benchmarks.trace_events import load_trace, newest_trace, union_length  # noqa: E402
from dsv41_jax.inference import Engine, InferenceOptions  # noqa: E402
from dsv41_jax.inference import speculative as S  # noqa: E402
from dsv41_jax.inference.engine import compile_seconds  # noqa: E402
from dsv41_jax.model.counting import count_params  # noqa: E402
from dsv41_jax.model.params import init_from_specs, param_specs  # noqa: E402
from dsv41_jax.tokenizer import ByteTokenizer  # noqa: E402

# name -> (InferenceOptions fields, SpeculativeDecoder arguments). "before": the engine as DSpark call 11 ran it
# (XLA's dot merger on in the decode programs, one device-loop run at a time); "nomerge" = "nopipe" (the call of
# 2026-12-03 13:00 ran "before" as "base" and this as "nomerge", before these became the defaults)
VARIANTS = {"base": ({}, {}),
            "cublas": (dict(verification_compiler_options=()), {}),
            "before": (dict(decode_dot_merger=True, verification_compiler_options=()), dict(pipeline=False)),
            "merge": (dict(decode_dot_merger=True), {}),
            "nopipe": ({}, dict(pipeline=False)),
            "nomerge": ({}, dict(pipeline=False)),
            "triton": (dict(compiler_options=(("xla_gpu_enable_triton_gemm", True),)), {})}


def hlo_ops(paths) -> dict:
    """HLO instruction name -> (op_name, opcode / fusion kind, result shape) over optimised HLO dumps."""
    out = {}
    for p in paths:
        with open(p) as f:
            for line in f:
                m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\(", line)
                if not m:
                    continue
                op = re.search(r'op_name="([^"]*)"', line)
                kind = m.group(3)
                if kind == "fusion":
                    k = re.search(r"kind=(k\w+)", line)
                    kind += ":" + (k.group(1) if k else "?")
                elif kind == "custom-call":
                    t = re.search(r'custom_call_target="([^"]+)"', line)
                    kind += ":" + (t.group(1) if t else "?")
                out.setdefault(m.group(1), (op.group(1) if op else "", kind, m.group(2)[:60]))
    return out


def phase_of(op_name: str) -> str:
    for name in S.SCOPES:
        if f"/{name}/" in op_name or op_name.endswith(f"/{name}"):
            return name
    return "chain / other"


def trace_tables(path: str, steps: int, ops: dict, module: str) -> dict:
    """From a trace file: the kernels of the program ``module`` (a kernel event's ``hlo_module`` argument holds
    it; the prefill and the first draft in the same trace are left out): device busy ms per step, kernels per
    step, and their time by phase (the ``op_name`` of the kernel's ``hlo_op`` in the optimised HLO ``ops``), by
    HLO op and by kernel name."""
    events, pname, tname = load_trace(path)
    dev = {p for p, n in pname.items() if re.search(r"/device:GPU", n, re.I)}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in dev
               and tname.get((e["pid"], e.get("tid")), "").lower().startswith("stream")
               and module in e.get("args", {}).get("hlo_module", "")]
    if not kernels:
        return {"error": f"no kernels of {module} in the trace", "path": path}
    ivs = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in kernels)
    busy = union_length(ivs)
    by_kernel = collections.defaultdict(lambda: [0, 0.0])
    by_phase = collections.defaultdict(lambda: [0, 0.0])
    by_op = collections.defaultdict(lambda: [0, 0.0])
    # the step runs as command buffers (hlo_op names the buffer, not the op): a kernel named after its fusion
    # ("loop_convert_fusion_1" for %loop_convert_fusion.1) is placed by that fusion's op_name; a library or
    # Pallas kernel (cuBLAS, slot kernels, copies) takes the phase of the kernel before it in the stream, the
    # phases running one after another in the program's order (an estimate at the phases' edges)
    named = {k.replace(".", "_"): v for k, v in ops.items()}
    unknown, phase = 0, "chain / other"
    for e in sorted(kernels, key=lambda e: float(e["ts"])):
        dur = float(e.get("dur", 0))
        by_kernel[e["name"]][0] += 1
        by_kernel[e["name"]][1] += dur
        op_name, kind, shape = named.get(e["name"], (None, "?", ""))
        if op_name is None:
            unknown += 1
        else:
            phase = phase_of(op_name)
        by_phase[phase][0] += 1
        by_phase[phase][1] += dur
        key = f"{phase} | {e['name'][:60]} | {kind} | {shape} | {(op_name or '').split('/')[-1][:40]}"
        by_op[key][0] += 1
        by_op[key][1] += dur

    def table(d, top):
        return [[k, round(v[0] / steps, 2), round(v[1] / 1e3 / steps, 4)]
                for k, v in sorted(d.items(), key=lambda kv: -kv[1][1])[:top]]

    return dict(trace=path, module=module, steps=steps, busy_ms_per_step=busy / 1e3 / steps,
                span_ms_per_step=(ivs[-1][1] - ivs[0][0]) / 1e3 / steps, kernels_per_step=len(kernels) / steps,
                kernels_not_in_hlo=unknown, phases=table(by_phase, 20), ops=table(by_op, 150),
                kernels=table(by_kernel, 80))


def write_raw(out: str, limit: int = 15 << 20) -> None:
    """DIR/traces.tar.gz: the traces and the traced programs' optimised HLO (rewritten after every variant, so a
    run cut short by its time limit keeps what it traced); the HLO is left out where the archive would pass
    ``limit`` bytes (the JSON keeps the per-op tables)."""
    path = os.path.join(out, "traces.tar.gz")
    for with_hlo in (True, False):
        with tarfile.open(path, "w:gz") as tar:
            for p in glob.glob("/tmp/profile_dspark_step_traces/**/*.trace.json.gz", recursive=True):
                tar.add(p, arcname=os.path.relpath(p, "/tmp/profile_dspark_step_traces"))
            for p in glob.glob(os.path.join(DUMP, "*after_optimizations.txt")) if with_hlo else ():
                if re.search(r"speculative_chain|decode_chain", p):
                    tar.add(p, arcname="hlo/" + os.path.basename(p))
        if os.path.getsize(path) <= limit:
            return


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="before,base")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--drafter-experts", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--trace-tokens", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens-per-step", default="2.11,2.13,3.05",
                    help="tokens per verification step measured with the trained pair (call 11: greedy on "
                         "non-degenerate text, sampled T 1, greedy on all 14 prompts) for the decomposition")
    ap.add_argument("--budget-s", type=float, default=200.0, help="variants that would start after this are skipped")
    ap.add_argument("--smoke", action="store_true", help="toy widths (CPU rehearsal)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    shutil.rmtree(DUMP, ignore_errors=True)
    shutil.rmtree("/tmp/profile_dspark_step_traces", ignore_errors=True)

    def say(msg):
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg} (compiling so far {compile_seconds():.0f} s)",
              file=sys.stderr, flush=True)

    config = target_config(args.smoke, args.block_size, args.experts, args.topk, args.drafter_experts)
    gamma = config.dspark_block_size
    counts = count_params(config)
    cpu = jax.default_backend() == "cpu"
    record = dict(config=config.name, device=jax.devices()[0].device_kind, jax=jax.__version__,
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=" ".join(sys.argv),
                  xla_flags=os.environ.get("XLA_FLAGS", ""), gamma=gamma,
                  moe=dict(target_experts=config.n_routed_experts, target_topk=config.num_experts_per_tok,
                           drafter_experts=config.dspark_n_routed_experts),
                  params=dict(backbone=counts.backbone, dspark=counts.dspark, active_decode=counts.active_decode),
                  variants={})
    out_json = os.path.join(args.out, "profile_dspark_step.json")

    def save():
        with open(out_json, "w") as f:
            json.dump(record, f, indent=1)

    tok = ByteTokenizer(model_vocab_size=config.vocab_size)
    prompt = heldout_prompts(1, 96, tok)
    new = args.new_tokens if not args.smoke else 8
    max_len = 2 * 96 + new + 16
    params = jax.device_put(inference_params(init_from_specs(param_specs(config, include_dspark=True),
                                                             jax.random.PRNGKey(0)), config), jax.devices()[0])
    say(f"{config.name}: {counts.backbone / 1e9:.2f} B backbone, {counts.dspark / 1e9:.3f} B drafter, random weights")
    bw = None
    if not cpu:
        from benchmarks.ceilings import read_bandwidth

        bw = read_bandwidth(2.0)
        say(f"read-only bandwidth {bw / 1e12:.2f} TB/s")
    record["read_bandwidth_bytes_per_s"] = bw
    plain_bytes = step_bytes(config, 1)["total"]
    spec_bytes = step_bytes(config, gamma + 1)["total"] + 2 * counts.dspark
    record["bytes"] = dict(plain=plain_bytes, verification_with_drafter=spec_bytes)
    tps = [float(x) for x in args.tokens_per_step.split(",") if x]

    for vi, name in enumerate(v for v in args.variants.split(",") if v):
        if time.perf_counter() - t_start > args.budget_s:
            say(f"budget: variant {name} skipped")
            record.setdefault("skipped", []).append(name)
            save()
            continue
        fields, dec_kw = VARIANTS[name]
        opts = InferenceOptions(ced=False, **fields)
        eng = Engine(config, params, max_batch=1, max_len=max_len, options=opts, tokenizer=tok)
        dec = S.SpeculativeDecoder(eng, **dec_kw)
        rec = record["variants"][name] = dict(options={k: str(v) for k, v in fields.items()}, decoder=dec_kw,
                                              decode_compiler_options=[list(x) for x in dec.opts.compiler_options])
        try:
            before = set(glob.glob(os.path.join(DUMP, "*after_optimizations.txt")))
            c0 = compile_seconds()
            eng.generate(prompt, max_new_tokens=4, stop_tokens=())
            dec.generate(prompt, max_new_tokens=2 * gamma + 2, stop_tokens=())
            rec["compile_s"] = compile_seconds() - c0
            say(f"{name}: programs compiled ({rec['compile_s']:.0f} s)")
            times = collections.defaultdict(list)
            outs = {}
            for _ in range(args.reps):
                res = eng.generate(prompt, max_new_tokens=new, stop_tokens=())
                times["plain"].append(eng.last_stats.decode_s / (new - 1))
                outs["plain"] = res[0].tokens
                res = dec.generate(prompt, max_new_tokens=new, stop_tokens=())
                st = dec.stats
                times["spec"].append(st.decode_s / st.steps)
                outs["spec"] = res[0].tokens
                rec["spec_counts"] = dict(steps=st.steps, emitted=st.emitted, rows_verified=st.rows_verified,
                                          accepted=st.accepted, device_steps=st.device_steps)
            plain_ms = statistics.median(times["plain"]) * 1e3
            spec_ms = statistics.median(times["spec"]) * 1e3
            rec.update(plain_step_ms=plain_ms, spec_step_ms=spec_ms, spec_vs_plain=spec_ms / plain_ms,
                       runs_ms=dict(plain=[t * 1e3 for t in times["plain"]], spec=[t * 1e3 for t in times["spec"]]),
                       same_tokens=outs["plain"] == outs["spec"])
            # the drafter's program alone (compiled by the first draft after prefill), on the rings as they are
            e, d = eng, dec  # bound here: the loop deletes its names at the end of each variant
            first = jnp.zeros((1,), jnp.int32)

            def draft_once():
                return S._draft_jit(e.params, d.rings, e.cache["length"], e.cache["floor"], first, None,
                                    config=config, quant_on=d.quant_on, moe_impl=d.opts.moe_impl,
                                    gemm_input_fp8=d.opts.gemm_input_fp8)
            jax.block_until_ready(draft_once().tokens)
            n = 50
            t0 = time.perf_counter()
            for _ in range(n):
                d = draft_once()
            jax.block_until_ready(d.tokens)
            rec["draft_alone_ms"] = (time.perf_counter() - t0) / n * 1e3
            say(f"{name}: plain step {plain_ms:.3f} ms, speculative step {spec_ms:.3f} ms "
                f"({spec_ms / plain_ms:.2f}x), drafter alone {rec['draft_alone_ms']:.3f} ms, same tokens "
                f"{rec['same_tokens']}")
            rec["speedup_at"] = {str(t): t * plain_ms / spec_ms for t in tps}
            save()
            # profiles: a short run of each loop
            after = sorted(set(glob.glob(os.path.join(DUMP, "*after_optimizations.txt"))) - before)
            rec["hlo_files"] = [os.path.basename(p) for p in after]
            module = {"plain": "decode_chain", "spec": "speculative_chain"}
            for kind in ("plain", "spec"):
                d = os.path.join("/tmp", "profile_dspark_step_traces", f"{name}_{kind}")
                shutil.rmtree(d, ignore_errors=True)
                with jax.profiler.trace(d):
                    if kind == "plain":
                        eng.generate(prompt, max_new_tokens=args.trace_tokens, stop_tokens=())
                        steps = args.trace_tokens - 1
                    else:
                        dec.generate(prompt, max_new_tokens=args.trace_tokens, stop_tokens=())
                        steps = dec.stats.steps
                path = newest_trace(d)
                t = {"error": "no trace"} if path is None else trace_tables(
                    path, steps, hlo_ops([p for p in after if module[kind] in p]), module[kind])
                rec[f"trace_{kind}"] = t
                if "error" in t:
                    say(f"{name} {kind} trace: {t['error']}")
                    continue
                say(f"{name} {kind}: busy {t['busy_ms_per_step']:.3f} ms / step of a {t['span_ms_per_step']:.3f} ms "
                    f"span, {t['kernels_per_step']:.0f} kernels / step; phases (op line ms / step): "
                    + ", ".join(f"{p} {ms:.3f} ({n:.0f})" for p, n, ms in t["phases"]))
            save()
            write_raw(args.out)
        except Exception as ex:  # noqa: BLE001 - the other variants still run
            import traceback

            rec["error"] = f"{type(ex).__name__}: {ex}"
            say(f"{name} FAILED: {rec['error']}\n{traceback.format_exc()[-3000:]}")
            save()
        del eng, dec

    # ---- tables ---------------------------------------------------------------------------------------------
    print(f"# profile_dspark_step: {config.name}, γ {gamma}, batch 1, {record['device']}, jax {jax.__version__}; "
          f"read BW {'—' if bw is None else f'{bw / 1e12:.2f} TB/s'}; bytes plain {plain_bytes / 1e9:.2f} GB, "
          f"verification + drafter {spec_bytes / 1e9:.2f} GB")
    print("| variant | plain step ms | speculative step ms | × plain | drafter alone ms | busy plain / spec ms | "
          "kernels plain / spec | same tokens | " + " | ".join(f"speed-up at {t} tok/step" for t in tps) + " |")
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(tps))
    for name, r in record["variants"].items():
        if "spec_step_ms" not in r:
            print(f"| {name} | {r.get('error', '—')} |")
            continue
        tp, ts = r.get("trace_plain", {}), r.get("trace_spec", {})
        busy = f"{tp.get('busy_ms_per_step', float('nan')):.3f} / {ts.get('busy_ms_per_step', float('nan')):.3f}"
        kern = f"{tp.get('kernels_per_step', float('nan')):.0f} / {ts.get('kernels_per_step', float('nan')):.0f}"
        print(f"| {name} | {r['plain_step_ms']:.3f} | {r['spec_step_ms']:.3f} | {r['spec_vs_plain']:.2f} | "
              f"{r['draft_alone_ms']:.3f} | {busy} | {kern} | {r['same_tokens']} | "
              + " | ".join(f"{v:.2f}" for v in r["speedup_at"].values()) + " |")
    for name, r in record["variants"].items():
        for kind in ("plain", "spec"):
            t = r.get(f"trace_{kind}")
            if not t or "error" in t:
                continue
            print(f"\n## {name} {kind}: phases (op line ms / step, ops / step)")
            for p, n, ms in t["phases"]:
                print(f"| {p} | {ms:.4f} | {n:.1f} |")
            print(f"\n## {name} {kind}: top ops (phase | kind | shape | op)")
            for k, n, ms in t["ops"][:45]:
                print(f"| {k} | {ms:.4f} | {n:.1f} |")
            print(f"\n## {name} {kind}: top kernels")
            for k, n, ms in t["kernels"][:30]:
                print(f"| {k[:90]} | {ms:.4f} | {n:.1f} |")
    save()
    say("done")


if __name__ == "__main__":
    main()
