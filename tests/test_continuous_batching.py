"""Continuous batching (``Engine.serve`` / ``ContinuousBatcher``): every request gets exactly the tokens it gets
alone through ``Engine.generate`` (greedy and seeded sampling, float32), slots are reused as soon as a sequence
finishes (no request waits for the slowest of a batch), and bad requests are clear errors."""

import functools

import numpy as np
import pytest

from dsv41_jax import Engine
from dsv41_jax.inference import FAST_COMPILE, EngineError, InferenceOptions, Request
from dsv41_jax.inference.weights import host_random_params
from dsv41_jax.tokenizer import ByteTokenizer
from dsv41_jax.train.testing import every_role_config

# One xdist worker runs this module's tests (tests/conftest.py): they share the engine and every request's tokens
# generated alone (_engine, _requests_and_alone), built once instead of once in each worker
pytestmark = pytest.mark.xdist_group("test_continuous_batching")

MAX_LEN = 40


@functools.lru_cache(maxsize=None)
def _engine():
    config = every_role_config(quant_sim=False)
    params = host_random_params(config, 3, std=0.1)
    opts = InferenceOptions(compiler_options=FAST_COMPILE)
    # the engine of test_inference_engine (its generate programs come from the run's compilation cache);
    # prefill_chunk 16 is the smallest bucket: one chunk shape, few programs to compile
    return Engine(config, params, max_batch=3, max_len=MAX_LEN, tokenizer=ByteTokenizer(), prefill_chunk=16,
                  options=opts)


def _prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


@functools.lru_cache(maxsize=None)
def _requests_and_alone():
    """Mixed prompt lengths (1 to 37 tokens: one to three chunks) and output lengths, one sampled request, two
    that end early on a stop token; each with the tokens Engine.generate gives it alone."""
    eng = _engine()
    long = Request(_prompt(9, 0), max_new_tokens=20, stop_tokens=())  # the slowest: holds a slot throughout
    reqs = [long]
    for i, (n, m) in enumerate([(1, 3), (37, 2), (20, 4), (5, 3), (17, 2), (3, 2)]):
        reqs.append(Request(_prompt(n, i + 1), max_new_tokens=m, stop_tokens=()))
    reqs.append(Request(_prompt(6, 9), max_new_tokens=5, temperature=0.9, top_k=50, top_p=0.95, seed=7,
                        stop_tokens=()))
    # two requests that stop early: their stop token is the third token they produce without one
    for n, seed in ((12, 10), (10, 13)):
        probe = eng.generate([Request(_prompt(n, seed), max_new_tokens=6, stop_tokens=())])[0].tokens
        stop = next(t for k, t in enumerate(probe) if 2 <= k <= 4 and t not in probe[:k])
        reqs.append(Request(_prompt(n, seed), max_new_tokens=6, stop_tokens=(stop,)))
    alone = [eng.generate([r])[0] for r in reqs]
    return reqs, alone


def test_every_request_gets_its_tokens_alone_and_slots_are_reused():
    eng = _engine()
    reqs, alone = _requests_and_alone()
    assert [a.finish_reason for a in alone[-2:]] == ["stop", "stop"] and all(len(a.tokens) < 6 for a in alone[-2:])
    streamed = {}
    # two prefill lanes (their rows gathered into a 2-row program): prompts of one to three chunks finish their
    # prefill at different iterations, lanes idle; one decode step per iteration
    batcher = eng.batcher(prefill_lanes=2, decode_run=1,
                          on_token=lambda i, t: streamed.setdefault(i, []).append(t))
    ids = [batcher.submit(r) for r in reqs]
    order, done, iters_when_done = [], {}, {}
    while batcher.busy:
        for c in batcher.step():
            order.append(c.id)
            done[c.id] = c
            iters_when_done[c.id] = batcher.stats.iterations
    for i, r in zip(ids, alone):
        assert done[i].tokens == r.tokens, f"request {i}"
        assert done[i].finish_reason == r.finish_reason and streamed[i] == r.tokens
        assert len(done[i].token_times) == len(r.tokens) and done[i].time_to_first_token_s > 0
    # Slot reuse: the long request holds one slot for its 20 tokens while the ten others stream through the two
    # other slots. It decodes at every iteration after its prefill chunk (never held back by admissions), the
    # requests admitted next to it finish long before it, and the run takes fewer iterations than static batches
    # of three in the same order (each batch as long as its slowest member, plus its prefill).
    n_iter = batcher.stats.iterations
    assert iters_when_done[ids[0]] == len(alone[0].tokens) - 1  # its prefill iteration also decodes its 2nd token
    assert order.index(ids[1]) < order.index(ids[0]) and order.index(ids[2]) < order.index(ids[0])
    static_iters = sum(3 + max(len(a.tokens) for a in alone[k:k + 3]) for k in range(0, len(alone), 3))
    assert n_iter < static_iters
    assert batcher.stats.max_prefilling == 2 and batcher.stats.max_running == 3 and batcher.stats.new_tokens == sum(len(a.tokens) for a in alone)


def test_default_batcher_refills_every_free_slot_and_decodes_in_runs():
    """The default batcher: free slots refilled together by one refill program (its rows bucketed to the slots
    it fills), decode steps in runs of readback_every read back at once; each request still gets its tokens."""
    eng = _engine()
    reqs, alone = _requests_and_alone()
    streamed = {}
    batcher = eng.batcher(on_token=lambda i, t: streamed.setdefault(i, []).append(t))
    assert batcher.lanes == eng.max_batch and batcher.decode_run == eng.readback_every
    ids = [batcher.submit(r) for r in reqs]
    done = {}
    while batcher.busy:
        for c in batcher.step():
            done[c.id] = c
    for i, r in zip(ids, alone):
        assert done[i].tokens == r.tokens and streamed[i] == r.tokens, f"request {i}"
        assert done[i].finish_reason == r.finish_reason
    s = batcher.stats
    assert s.max_prefilling == 3 and s.new_tokens == sum(len(a.tokens) for a in alone)
    # runs: fewer iterations than decode steps, and no more steps than one per token plus a run's slack per request
    assert s.iterations < s.decode_steps <= sum(len(a.tokens) for a in alone) + eng.readback_every * len(reqs)


def test_refill_min_refills_slots_together_in_row_buckets():
    """Admission waiting for two free slots (``refill_min=2``): refills of two slots run the 2-row program, a lone
    prompt the 1-row one, the first the 3-row one (the programs of the tests above: no new compile); every request
    still gets exactly its tokens alone, and while others decode no request is admitted alone with two waiting
    (unless it joins the chunk of a prompt already mid-prefill)."""
    eng = _engine()
    reqs, alone = _requests_and_alone()
    batcher = eng.batcher(refill_min=2)
    ids = [batcher.submit(r) for r in reqs]
    done, lone = {}, 0
    while batcher.busy:
        decoding, waiting, mid = int(batcher._decoding().sum()), batcher.waiting, bool(batcher._prefilling)
        for c in batcher.step():
            done[c.id] = c
        if decoding and waiting >= 2 and not mid and waiting - batcher.waiting == 1:
            lone += 1
    for i, r in zip(ids, alone):
        assert done[i].tokens == r.tokens and done[i].finish_reason == r.finish_reason, f"request {i}"
    s = batcher.stats
    assert lone == 0 and set(s.refill_buckets) <= {1, 2, 3} and s.refill_buckets.get(2, 0) >= 1
    assert s.prefill_rows == sum(p * k for p, k in s.refill_buckets.items()) < eng.max_batch * s.prefill_chunks


def test_serve_reports_bad_requests_and_serves_the_rest():
    eng = _engine()
    reqs, alone = _requests_and_alone()
    bad = [Request([], max_new_tokens=2), Request(_prompt(30, 1), max_new_tokens=12),  # 30 + 12 - 1 > 40
           {"prompt": _prompt(3, 1), "temprature": 0.5}, Request(_prompt(3, 1), top_p=0.0),
           Request([5, 300]), Request(_prompt(3, 1), max_new_tokens=0)]
    got = {c.id: c for c in eng.serve([reqs[1]] + bad + [reqs[3]], prefill_lanes=2)}
    assert got[0].tokens == alone[1].tokens and got[7].tokens == alone[3].tokens
    errors = [got[i].error for i in range(1, 7)]
    assert all(got[i].finish_reason == "error" for i in range(1, 7))
    for msg, want in zip(errors, ("empty prompt", "more than max_len 40", "unknown request option(s) ['temprature']",
                                  "top_p must be in (0, 1]", "token id 300", "max_new_tokens must be")):
        assert want in msg, msg
    # submit raises the same errors; the engine refuses static calls while a batcher holds its cache
    b = eng.batcher(prefill_lanes=2)
    with pytest.raises(EngineError, match="more than max_len"):
        b.submit(_prompt(40, 2), max_new_tokens=2)
    with pytest.raises(EngineError, match="prefill_lanes"):
        eng.batcher(prefill_lanes=4)
    b.submit(_prompt(3, 2), max_new_tokens=1)
    with pytest.raises(EngineError, match="ContinuousBatcher is serving"):
        eng.generate([_prompt(3, 2)])
    with pytest.raises(EngineError, match="another ContinuousBatcher"):
        eng.batcher(prefill_lanes=2).submit(_prompt(3, 2))
    served = [c.tokens for c in b.run()]
    assert served == [eng.generate([_prompt(3, 2)], max_new_tokens=1)[0].tokens]  # the engine is free again
