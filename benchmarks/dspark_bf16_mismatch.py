"""Why greedy DSpark speculation and plain decoding pick different tokens in bf16 at batch 16 (CPU, the DSpark
bench's toy-width target, random weights): the rows that differ, the float32 reference's top-2 logit gap at each
first differing position (compared with the gaps at every position), whether plain decoding itself changes with the
batch, and whether float32 (same bf16-rounded values) is lossless. With ``--row R``: that row's tokens per decoding
and the float32 / bf16 whole-sequence forward's top-3 logits at its first positions.

    python benchmarks/dspark_bf16_mismatch.py [--row 3]      # STD=0.1 NNEW=24 by default; writes $OUT (default ./dspark_bf16_mismatch.json)

Results and reading: benchmarks/RESULTS.md, "DSpark on the H200, call 7".
"""
import sys, os, json
sys.path.insert(0, os.getcwd())
import numpy as np, jax, jax.numpy as jnp
from benchmarks.bench_dspark_h200 import target_config, inference_params
from dsv41_jax.inference import FAST_COMPILE, Engine, InferenceOptions
from dsv41_jax.inference.speculative import SpeculativeDecoder
from dsv41_jax.inference.weights import host_random_params
from dsv41_jax.model.forward import forward

config = target_config(True)
B, N = 16, int(os.environ.get("NNEW", 24))
p32 = host_random_params(config, 5, std=float(os.environ.get("STD", 0.1)), include_dspark=True)
pbf = inference_params(p32, config)
opts = InferenceOptions(ced=False, compiler_options=FAST_COMPILE)
rng = np.random.default_rng(0)
prompts = [[int(t) for t in rng.integers(3, 256, int(n))] for n in rng.integers(8, 40, B)]
def run(params, b=B, ps=prompts, spec=None, **kw):
    eng = Engine(config, params, max_batch=b, max_len=128, prefill_chunk=64, options=opts)
    if spec is None:
        return [r.tokens for r in eng.generate(ps, max_new_tokens=N, stop_tokens=())]
    dec = SpeculativeDecoder(eng, **kw) if spec is True else SpeculativeDecoder(eng, drafter=spec, **kw)
    out = [r.tokens for r in dec.generate(ps, max_new_tokens=N, stop_tokens=())]
    return out, dec.stats
ROW = int(sys.argv[sys.argv.index('--row') + 1]) if '--row' in sys.argv else None
if ROW is None:
    plain = run(pbf)
    spec, st = run(pbf, spec=True)
    print("accepted length", st.mean_accepted_length, flush=True)
    bad = [s for s in range(B) if spec[s] != plain[s]]
    print("rows differing (bf16, batch 16, device loop):", bad, flush=True)
    # float32 with the same (bf16-rounded) values: the reference
    p32r = jax.tree.map(lambda x: x.astype(jnp.float32), pbf)
    plain32 = run(p32r)
    spec32, _ = run(p32r, spec=True)
    print("f32 spec == f32 plain:", spec32 == plain32, flush=True)
    print("bf16 plain == f32 plain rows:", sum(a == b for a, b in zip(plain, plain32)), "of", B, flush=True)
    # plain at batch 1 vs batch 16 (bf16): does plain decoding itself depend on the batch?
    plain1 = [run(pbf, 1, [prompts[s]])[0] for s in bad[:4]]
    print("bf16 plain batch1 == plain batch16 for bad rows:", [a == plain[s] for a, s in zip(plain1, bad)], flush=True)
    spec1 = [run(pbf, 1, [prompts[s]], spec=True)[0][0] for s in bad[:4]]
    print("bf16 spec batch1 == plain batch1:", [a == b for a, b in zip(spec1, plain1)], flush=True)
    # the f32 reference logits at the first differing position: top-2 gap and ranks
    fwd = jax.jit(lambda p, t: forward(p, t, config=config))
    rep = []
    for s in bad:
        j = next(i for i, (a, b) in enumerate(zip(spec[s], plain[s])) if a != b)
        seq = prompts[s] + plain[s][:j]
        lg = np.asarray(fwd(p32r, jnp.asarray([seq], jnp.int32))[0, -1], np.float64)
        order = np.argsort(-lg)
        gap = lg[order[0]] - lg[order[1]]
        rep.append(dict(row=s, pos=j, plain_tok=plain[s][j], spec_tok=spec[s][j], f32_top2=[int(order[0]), int(order[1])],
                        f32_gap=float(gap), logit_scale=float(np.abs(lg).max()),
                        plain_minus_spec_f32=float(lg[plain[s][j]] - lg[spec[s][j]])))
        print(rep[-1], flush=True)
    # gaps at all plain positions of good rows (how rare are gaps this small?)
    gaps = []
    for s in range(B):
        seq = prompts[s] + plain[s]
        lg = np.asarray(fwd(p32r, jnp.asarray([seq], jnp.int32))[0, len(prompts[s]) - 1:-1], np.float64)
        srt = np.sort(lg, -1)
        gaps += list(srt[:, -1] - srt[:, -2])
    gaps = np.array(gaps)
    print("f32 top-2 gap over all plain positions: median %.4g, 1%% %.4g, min %.4g" % (np.median(gaps), np.quantile(gaps, .01), gaps.min()))
    for r in rep:
        r["fraction_of_positions_with_smaller_gap"] = float((gaps < r["f32_gap"]).mean())
    json.dump(dict(bad=bad, rep=rep, gaps_quantiles=[float(np.quantile(gaps, q)) for q in (0, .01, .05, .5)]),
              open(os.environ.get("OUT", "dspark_bf16_mismatch.json"), "w"), indent=1)
    print("done")
else:
    plain = run(pbf)
    p1 = run(pbf, 1, [prompts[ROW]])[0]
    p32r = jax.tree.map(lambda x: x.astype(jnp.float32), pbf)
    plain32 = run(p32r)
    print("row", ROW, "prompt len", len(prompts[ROW]))
    print("plain bf16 b16:", plain[ROW][:8]); print("plain bf16 b1 :", p1[:8]); print("plain f32 b16 :", plain32[ROW][:8])
    fwd = jax.jit(lambda p, t: forward(p, t, config=config))
    for name, seqtoks in (("b16", plain[ROW]), ("b1", p1)):
        seq = prompts[ROW] + seqtoks[:6]
        l32 = np.asarray(fwd(p32r, jnp.asarray([seq], jnp.int32))[0], np.float64)
        l16 = np.asarray(fwd(pbf, jnp.asarray([seq], jnp.int32))[0], np.float64)
        for j in range(6):
            i = len(prompts[ROW]) - 1 + j
            o32 = np.argsort(-l32[i])[:3]; o16 = np.argsort(-l16[i])[:3]
            print(name, "pos", j, "engine tok", seqtoks[j], "f32 fwd top3", o32.tolist(), np.round(l32[i][o32], 3).tolist(),
                  "bf16 fwd top3", o16.tolist(), np.round(l16[i][o16], 3).tolist(), "max|l16-l32|", round(float(np.abs(l16[i]-l32[i]).max()), 3))
