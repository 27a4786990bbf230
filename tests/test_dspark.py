"""DSpark: parameter names, target-feature capture, the drafter's maths, lossless greedy speculative decoding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import load_config
from dsv41_jax.inference import FAST_COMPILE, Engine, EngineError, InferenceOptions, Request
from dsv41_jax.inference.cache import visible_state
from dsv41_jax.inference.speculative import SpeculativeDecoder, _seed_jit, greedy_acceptance, ring_context
from dsv41_jax.inference.weights import host_random_params
from dsv41_jax.train.testing import every_role_config
from dsv41_jax.model import dspark
from dsv41_jax.model.forward import ForwardOptions, forward
from dsv41_jax.model.model import default_hasher
from dsv41_jax.model.params import FP32, flat_specs

# One xdist worker runs this module's tests (tests/conftest.py): they share the 6-layer model and its engines (_setup,
# _engine), built once instead of once in each worker
pytestmark = pytest.mark.xdist_group("test_dspark")


@functools.lru_cache(maxsize=None)
def _setup():
    # the tiny preset cut to 6 layers (fast compiles), every role kept: SWA 0, ratio-2 encoder 1-2 (Full + Engram,
    # Reuse), ratio-1 decoder 3-5 (Full candidate source, Reuse, Reindex); DSpark targets 3-5
    config = every_role_config(quant_sim=False)
    params = host_random_params(config, 5, std=0.1, include_dspark=True)
    return config, params


@functools.lru_cache(maxsize=None)
def _engine(ced: bool = True):
    config, params = _setup()
    opts = InferenceOptions(compiler_options=FAST_COMPILE, ced=ced)
    return Engine(config, params, max_batch=3, max_len=64, prefill_chunk=16, options=opts)


def _prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


def test_parameter_names_are_the_official_ones():
    flash = load_config("flash")
    names = {p: s for p, s in flat_specs(flash, include_dspark=True) if p.startswith("dspark/")}
    hf = {s.hf_name for s in names.values()}
    for want in ("mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.norm.weight",
                 "mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight",
                 "mtp.2.confidence_head.proj.weight", "mtp.1.attn.wkv.weight", "mtp.1.attn.attn_sink",
                 "mtp.0.hc_attn_fn", "mtp.2.hc_ffn_scale", "mtp.0.ffn.gate.bias", "mtp.2.ffn.experts.{e}.w2.weight",
                 "mtp.1.ffn.shared_experts.w1.weight", "mtp.0.attn_norm.weight"):
        assert want in hf, want
    assert not any("compressor" in n or "indexer" in n or "engram" in n for n in hf)  # SWA-only blocks
    assert names["dspark/main_proj"].shape == (5120, 3 * 5120)
    assert names["dspark/confidence"].shape == (1, 5120 + 256) and names["dspark/confidence"].dtype == FP32
    assert names["dspark/blocks/0/ffn/experts/w1"].shape[0] == 128
    tiny = load_config("tiny")
    assert tiny.num_nextn_predict_layers == 2 and tiny.dspark_block_size == 4


def _check_capture(ced: bool):
    """Prefill's captured features equal the training forward's (with bounded replay under CED); returns the
    forward's features [T, 3d]."""
    config, params = _setup()
    prompt = _prompt(21, 3)  # > 2 windows of 8
    hasher = default_hasher(config)
    tokens = jnp.asarray([prompt])
    eids = hasher.row_ids(np.asarray([prompt]))
    # CED's decoder replays the last sliding_window tokens only: the forward's bounded replay
    run = jax.jit(functools.partial(forward, config=config, return_dspark_features=True,
                                    options=ForwardOptions(bounded_replay=ced, moe_impl="dense")),
                  compiler_options=dict(FAST_COMPILE))
    _, aux = run(params, tokens, engram_ids=jnp.asarray(eids))
    feats = np.asarray(aux["dspark_features"][0])  # [T, 3d]
    assert feats.shape == (21, 3 * config.hidden_size)
    eng = _engine(ced)
    got = []
    eng.prefill([prompt], [1], on_features=lambda f, p0, nv: got.append((np.asarray(f), np.asarray(p0),
                                                                         np.asarray(nv))))
    seen = {}
    for f, p0, nv in got:
        for i in range(int(nv[1])):
            seen[int(p0[1]) + i] = f[1, i]
    first = 21 - 8 if ced else 0  # CED replays the decoder (layers 4-7 hold the targets) over 8 tokens
    assert sorted(seen) == list(range(first, 21))
    for p, v in seen.items():
        np.testing.assert_allclose(v, feats[p], rtol=1e-5, atol=1e-5)
    return prompt, feats


@pytest.mark.slow
def test_capture_and_speculation_with_full_replay_prefill():
    _check_capture(ced=False)
    eng = _engine(False)
    prompts = [_prompt(3, 10), _prompt(20, 12)]
    plain = _plain(eng, prompts, 12)
    spec = SpeculativeDecoder(eng)
    assert [r.tokens for r in spec.generate(prompts, max_new_tokens=12, stop_tokens=())] == plain


def test_capture_matches_training_forward_and_seeds_the_rings():
    """CED prefill's captured features equal the bounded-replay training forward's, and the rings they seed hold
    each block's context latents of the last W positions (per slot, mixed lengths)."""
    config, params = _setup()
    prompt, feats = _check_capture(ced=True)
    dec = SpeculativeDecoder(_engine(True))
    dec.prefill([prompt, prompt[:5]], [0, 2])
    cache = dec.engine.cache
    ctx, pos = ring_context(dec.rings, cache["length"], cache["floor"])
    pos = np.asarray(pos)
    assert pos[0].tolist() == list(range(13, 21)) and pos[2].tolist() == [-1] * 3 + [0, 1, 2, 3, 4]
    want = dspark.context_kvs(params["dspark"], jnp.asarray(feats[13:21])[None], jnp.arange(13, 21)[None], config,
                              False)
    for block in range(config.num_nextn_predict_layers):
        np.testing.assert_allclose(np.asarray(ctx[block][0]), np.asarray(want[block][0]), rtol=1e-5, atol=1e-5)


def test_drafter_block_is_bidirectional_and_heads_are_sequential():
    config, params = _setup()
    dp = params["dspark"]
    rng = np.random.default_rng(0)
    b, k, s = 2, 8, config.dspark_block_size
    ctx = [jnp.asarray(rng.standard_normal((b, k, config.head_dim)), jnp.float32) for _ in dp["blocks"]]
    ctx_pos = jnp.asarray([list(range(10, 18)), [-1, -1, -1, 0, 1, 2, 3, 4]], jnp.int32)
    block = jnp.asarray([[7, 258, 258, 258], [9, 258, 258, 258]], jnp.int32)
    pos = jnp.asarray([[18, 19, 20, 21], [5, 6, 7, 8]], jnp.int32)
    run = jax.jit(functools.partial(dspark.run_blocks, params, config=config, quant_on=False))
    hidden, base = run(block, pos, ctx, ctx_pos)
    assert hidden.shape == (b, s, config.hidden_size) and base.shape == (b, s, config.vocab_size)
    # a later block token changes the first slot (bidirectional inside the block) ...
    hidden2, _ = run(block.at[:, 3].set(100), pos, ctx, ctx_pos)
    assert float(jnp.max(jnp.abs(hidden2[:, 0] - hidden[:, 0]))) > 1e-4
    # ... the context matters, but its empty slots do not
    hidden3, _ = run(block, pos, [c.at[1, :3].set(5.0) for c in ctx], ctx_pos)
    np.testing.assert_array_equal(np.asarray(hidden3[1]), np.asarray(hidden[1]))
    hidden4, _ = run(block, pos, [c.at[0, 4].set(5.0) for c in ctx], ctx_pos)
    assert float(jnp.max(jnp.abs(hidden4[0] - hidden[0]))) > 1e-4
    # the Markov loop: slot k adds the bias of its predecessor (x_p, then the drafts), left to right
    tokens, logits, embeds = jax.jit(dspark.sample_sequential)(dp, base, block[:, 0])
    prev = np.asarray(block[:, 0])
    w1, w2 = np.asarray(dp["markov_embed"]), np.asarray(dp["markov_head"])
    for j in range(s):
        want = np.asarray(base[:, j]) + w1[prev] @ w2.T
        np.testing.assert_allclose(np.asarray(logits[:, j]), want, rtol=1e-5, atol=1e-5)
        assert np.asarray(tokens[:, j]).tolist() == np.argmax(want, -1).tolist()
        prev = np.asarray(tokens[:, j])
    # the confidence head: float32, pre-norm hidden state and the predecessor's Markov embedding, no bias
    conf = dspark.confidence_logits(dp, hidden, embeds)
    want = np.concatenate([np.asarray(hidden), np.asarray(embeds)], -1) @ np.asarray(dp["confidence"])[0]
    np.testing.assert_allclose(np.asarray(conf), want, rtol=1e-5, atol=1e-5)
    assert conf.dtype == jnp.float32
    with pytest.raises(dspark.DSparkError, match="dspark"):
        dspark.check_dspark({k: v for k, v in params.items() if k != "dspark"}, config)


def test_greedy_acceptance_rule():
    drafts = np.array([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    target = np.array([[1, 2, 3, 9], [1, 5, 3, 9], [4, 2, 3, 9], [1, 2, 3, 9]])
    assert greedy_acceptance(drafts, target, np.array([4, 4, 4, 2])).tolist() == [3, 1, 0, 1]


def _plain(eng, prompts, n):
    return [r.tokens for r in eng.generate(prompts, max_new_tokens=n, stop_tokens=())]


def test_speculative_greedy_equals_plain_greedy_with_every_acceptance_pattern():
    """Mixed batch, prompts of 3 / 11 / 20 tokens, 20 new tokens (across windows of 8 and ratio-2 groups): the
    DSpark drafter (random weights: low acceptance) and an oracle drafter (the plain continuation, corrupted to
    give all / partial / no acceptance) both reproduce plain greedy decoding token for token."""
    eng = _engine(True)
    prompts = [_prompt(3, 10), _prompt(11, 11), _prompt(20, 12)]
    n_new = 20
    plain = _plain(eng, prompts, n_new)
    spec = SpeculativeDecoder(eng)
    assert [r.tokens for r in spec.generate(prompts, max_new_tokens=n_new, stop_tokens=())] == plain
    assert spec.stats.rows_verified > 0

    lens = {s: len(p) for s, p in enumerate(prompts)}
    gamma = eng.config.dspark_block_size
    patterns = []

    def oracle(dec, pending, active):
        lengths = dec.engine.lengths()
        out = np.zeros((len(pending), gamma), np.int64)
        mode = dec.stats.steps % 3
        for s in np.flatnonzero(active):
            done = int(lengths[s]) - lens[s] + 1  # tokens emitted so far, the pending one included
            cont = plain[s][done:done + gamma]
            out[s, :len(cont)] = cont
            if mode == 1:
                out[s, 1] = (out[s, 1] + 1) % 259  # accept exactly one
            elif mode == 2:
                out[s, 0] = (out[s, 0] + 1) % 259  # accept none
        patterns.append(mode)
        return out

    spec = SpeculativeDecoder(eng, drafter=oracle)
    got = spec.generate(prompts, max_new_tokens=n_new, stop_tokens=())
    assert [r.tokens for r in got] == plain
    assert set(patterns) == {0, 1, 2}
    st = spec.stats
    assert st.accepted > 0 and st.rollbacks > 0 and st.reruns == 0 and st.mean_accepted_length > 1.5


def test_rollback_leaves_the_caches_of_plain_decoding():
    """After a verification step that rejects drafts, every cache (SWA rings, compressor partial groups, compressed
    entries, indexer keys, lengths) equals that of feeding the accepted tokens by plain decoding."""
    eng = _engine(True)
    config = eng.config
    prompts = [_prompt(7, 20), _prompt(14, 21)]
    # plain greedy decoding: row 0 feeds 3 tokens (4 sampled), row 1 feeds 1
    plain = eng.generate([Request(prompts[0], max_new_tokens=4, stop_tokens=()),
                          Request(prompts[1], max_new_tokens=2, stop_tokens=())])
    want = visible_state(eng.cache, config, [0, 1])
    t0, t1 = plain[0].tokens, plain[1].tokens
    # the same by one verification step: row 0 accepts 2 drafts and rejects the third, row 1 rejects the first;
    # rolled back from the one pass (restore) and by a second pass (rerun): the same bits
    by_mode = {}
    for mode in ("restore", "rerun"):
        dec = SpeculativeDecoder(eng, drafter=lambda *a: None, rollback=mode)
        dec.prefill(prompts, [0, 1])
        pending = np.array([t0[0], t1[0], 0])
        drafts = np.zeros((3, config.dspark_block_size), np.int64)
        drafts[0, :3] = [t0[1], t0[2], (t0[3] + 1) % 259]
        drafts[1, :2] = [(t1[1] + 1) % 259, 5]
        new, n_acc = dec.verify_greedy(pending, drafts, np.array([True, True, False]))
        assert n_acc.tolist() == [2, 0, 0] and dec.stats.rollbacks == 1 and dec.stats.reruns == (mode == "rerun")
        assert new[0] == t0[1:4] and new[1] == t1[1:2]
        got = visible_state(eng.cache, config, [0, 1])
        assert got["length"].tolist() == [len(prompts[0]) + 3, len(prompts[1]) + 1]
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=f"{mode}: {k}")
        by_mode[mode] = got
    for k in want:
        np.testing.assert_array_equal(by_mode["restore"][k], by_mode["rerun"][k], err_msg=k)


def test_speculative_sampling_is_lossless_on_a_small_vocabulary():
    """Chi-square test: tokens emitted by draft-then-verify (2 drafts from a deliberately different draft model,
    temperature 0.8 and top-k 4 on the target and the drafter alike) are distributed as plain sampling from the
    target, jointly over three positions (125 cells, 40 000 sequences, p-value threshold 1e-3)."""
    from jax.scipy.stats import chi2

    from dsv41_jax.inference.sampling import filter_logits
    from dsv41_jax.inference.speculative import speculative_accept

    v, n, temp, topk = 5, 40_000, 0.8, 4
    rng = np.random.default_rng(0)
    t1, t2, t3 = (rng.standard_normal(s) * 1.5 for s in ((v,), (v, v), (v, v, v)))  # target logits tables
    d1, d2 = (rng.standard_normal(s) * 1.5 for s in ((v,), (v, v)))  # draft logits tables

    def dist(z):  # what plain sampling draws from
        z = jnp.asarray(z, jnp.float32).reshape(-1, v)
        m = z.shape[0]
        f = filter_logits(z, jnp.full((m,), temp), jnp.full((m,), topk), jnp.ones((m,)))
        return np.asarray(jax.nn.softmax(f, -1), np.float64)

    def draw(probs):
        c = np.cumsum(probs, -1)
        return np.minimum((rng.random(len(probs))[:, None] > c).sum(-1), v - 1)

    x1 = draw(dist(d1)[np.zeros(n, int)])
    x2 = draw(dist(d2)[x1])
    drafts = np.stack([x1, x2], 1)
    target = np.stack([np.broadcast_to(t1, (n, v)), t2[x1], t3[x1, x2]], 1)
    draft_logits = np.stack([np.broadcast_to(d1, (n, v)), d2[x1]], 1)
    # 64 extra greedy rows (temperature 0) in the same call: exact argmax matching
    g = 64
    cat = lambda a, b: np.concatenate([a, b])  # noqa: E731
    keys = jax.random.split(jax.random.PRNGKey(1), n + g)
    acc_all, nxt_all = jax.jit(speculative_accept)(
        jnp.asarray(cat(target, target[:g]), jnp.float32),
        jnp.asarray(cat(draft_logits, draft_logits[:g]), jnp.float32),
        jnp.asarray(cat(drafts, drafts[:g]), jnp.int32), jnp.full((n + g,), 3, jnp.int32),
        jnp.asarray(cat(np.full(n, temp), np.zeros(g)), jnp.float32), jnp.full((n + g,), topk, jnp.int32),
        jnp.ones((n + g,)), keys)
    n_acc, nxt = np.asarray(acc_all)[:n], np.asarray(nxt_all)[:n]
    want_acc = greedy_acceptance(drafts[:g], target[:g].argmax(-1), np.full(g, 3))
    assert np.asarray(acc_all)[n:].tolist() == want_acc.tolist() and set(want_acc) >= {0, 1}
    assert np.asarray(nxt_all)[n:].tolist() == target[:g].argmax(-1)[np.arange(g), want_acc].tolist()
    n_acc, nxt = np.asarray(n_acc), np.asarray(nxt)
    assert set(np.unique(n_acc)) == {0, 1, 2}  # every acceptance path taken
    y = np.zeros((n, 3), int)
    y[:, 0] = np.where(n_acc == 0, nxt, x1)
    y[:, 1] = np.where(n_acc == 1, nxt, x2)
    y[:, 2] = nxt
    # positions the step did not reach are what the next steps sample from the target
    p2, p3 = dist(t2), dist(t3).reshape(v, v, v)
    y[n_acc == 0, 1] = draw(p2[y[n_acc == 0, 0]])
    late = n_acc < 2
    y[late, 2] = draw(p3[y[late, 0], y[late, 1]])
    expected = dist(t1)[0][:, None, None] * p2[:, :, None] * p3 * n
    counts = np.zeros((v, v, v))
    np.add.at(counts, (y[:, 0], y[:, 1], y[:, 2]), 1)
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing outside the target's top-k support
    stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    assert float(chi2.sf(stat, keep.sum() - 1)) > 1e-3, stat


def test_unfiltered_speculative_sampling_equals_the_filtered_form_without_filters():
    """top_k / top_p None (the sampler without the vocabulary sort, chosen when no sampled row filters) accepts and
    draws exactly what top-k 0 / top-p 1 through ``filter_logits`` do; one of them None alone is an error."""
    from dsv41_jax.inference.sampling import SamplingError, sampling_logits
    from dsv41_jax.inference.speculative import speculative_accept

    b, k, v = 16, 3, 11
    rng = np.random.default_rng(5)
    target = jnp.asarray(rng.standard_normal((b, k + 1, v)) * 2, jnp.float32)
    draft_logits = jnp.asarray(rng.standard_normal((b, k, v)) * 2, jnp.float32)
    drafts = jnp.asarray(rng.integers(0, v, (b, k)), jnp.int32)
    temp = jnp.asarray(rng.choice([0.0, 0.7, 1.0], b), jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(2), b)
    n_valid = jnp.full((b,), k + 1, jnp.int32)
    acc = jax.jit(speculative_accept)
    filtered = acc(target, draft_logits, drafts, n_valid, temp, jnp.zeros((b,), jnp.int32), jnp.ones((b,)), keys)
    unfiltered = acc(target, draft_logits, drafts, n_valid, temp, None, None, keys)
    for f, u in zip(filtered, unfiltered):
        np.testing.assert_array_equal(np.asarray(f), np.asarray(u))
    with pytest.raises(SamplingError, match="both None"):
        sampling_logits(target[:, 0], temp, None, jnp.ones((b,)))


def test_speculative_sampling_in_the_engine_keeps_greedy_rows_exact():
    """A batch mixing a greedy row and sampled rows: the greedy row reproduces plain greedy decoding token for
    token, the sampled rows produce valid tokens (deterministic per seed) and the acceptance paths run; the device
    loop (speculative_chain, read back every 3 steps) draws what the host loop draws: the same tokens and steps."""
    eng = _engine(True)
    prompts = [_prompt(3, 10), _prompt(11, 11), _prompt(20, 12)]
    plain = _plain(eng, prompts, 20)
    reqs = [Request(prompts[0], max_new_tokens=20, stop_tokens=()),
            Request(prompts[1], max_new_tokens=20, temperature=0.7, top_k=20, seed=3, stop_tokens=()),
            Request(prompts[2], max_new_tokens=20, temperature=1.0, top_p=0.9, seed=4, stop_tokens=())]
    spec = SpeculativeDecoder(eng, chain_every=3)
    a = spec.generate(reqs)
    assert a[0].tokens == plain[0]
    assert all(r.ok and len(r.tokens) == 20 and all(0 <= t < 259 for t in r.tokens) for r in a)
    d = spec.stats
    assert d.device_steps == d.steps > 0 and d.rollbacks > 0  # on the device, with rejections
    host = SpeculativeDecoder(eng, chain_every=0)
    assert [r.tokens for r in host.generate(reqs)] == [r.tokens for r in a]
    h = host.stats
    assert h.device_steps == 0
    assert (h.steps, h.drafted, h.accepted, h.emitted, h.rollbacks) == (d.steps, d.drafted, d.accepted, d.emitted,
                                                                        d.rollbacks)
    # no row filters: the device loop samples without the vocabulary sort (top-k / top-p None), still seeded
    unfiltered = [reqs[0], Request(prompts[1], max_new_tokens=20, temperature=0.7, seed=3, stop_tokens=()),
                  Request(prompts[2], max_new_tokens=20, temperature=1.0, seed=4, stop_tokens=())]
    u = spec.generate(unfiltered)
    assert spec.sampling[1] is None and spec.sampling[2] is None
    assert u[0].tokens == plain[0] and all(r.ok and len(r.tokens) == 20 for r in u)
    assert spec.stats.device_steps == spec.stats.steps > 0
    assert [r.tokens for r in spec.generate(unfiltered)] == [r.tokens for r in u]  # seeded


def test_confidence_schedules():
    from dsv41_jax.inference.speculative import prefix_schedule, prefix_survival, threshold_lengths

    logit = lambda p: np.log(p / (1 - p))  # noqa: E731
    conf = logit(np.array([[0.9, 0.8, 0.5, 0.9], [0.4, 0.9, 0.9, 0.9]]))
    a = prefix_survival(conf)
    np.testing.assert_allclose(a[0], [0.9, 0.72, 0.36, 0.324])
    assert threshold_lengths(conf, 0.5).tolist() == [2, 0]
    assert threshold_lengths(conf, 0.3).tolist() == [4, 3]
    # flat step rate: every admission with a > 0 pays off; a step rate halving past 3 tokens stops after one draft
    assert prefix_schedule(a, lambda n: 1.0).tolist() == [4, 4]
    assert prefix_schedule(a, lambda n: 1.0 if n <= 3 else 0.5).tolist() == [1, 0]
    # against brute force over every length vector, for a smooth (unimodal) step-time curve
    rng = np.random.default_rng(0)
    sps = lambda n: 1.0 / (1.0 + 0.08 * n)  # noqa: E731
    for _ in range(20):
        a = prefix_survival(rng.normal(1.0, 1.5, (3, 3)))
        got = prefix_schedule(a, sps)
        value = lambda l: (3 + sum(a[r, :l[r]].sum() for r in range(3))) * sps(3 + sum(l))  # noqa: E731
        best = max(value((i, j, k)) for i in range(4) for j in range(4) for k in range(4))
        assert value(got) == pytest.approx(best, rel=1e-12)


def test_scheduled_speculation_stays_lossless():
    eng = _engine(True)
    prompts = [_prompt(3, 10), _prompt(11, 11), _prompt(20, 12)]
    plain = _plain(eng, prompts, 20)
    for kw in (dict(schedule="threshold", threshold=0.3),
               dict(schedule="prefix", steps_per_s=lambda n: 1.0 / (1.0 + 0.1 * n), early_stop=False)):
        spec = SpeculativeDecoder(eng, **kw)
        assert [r.tokens for r in spec.generate(prompts, max_new_tokens=20, stop_tokens=())] == plain
        assert spec.stats.drafted < 3 * 4 * spec.stats.steps  # fewer drafts verified than proposed
    with pytest.raises(EngineError, match="steps_per_s"):
        SpeculativeDecoder(eng, schedule="prefix")
    # unscheduled and threshold-scheduled greedy speculation run on the device (speculative_chain, read back every
    # 3 steps): the same tokens and the same verification steps as the host loop
    runs = {}
    for every in (0, 3):
        for sched in (None, "threshold"):
            spec = SpeculativeDecoder(eng, chain_every=every, schedule=sched, threshold=0.3)
            runs[every, sched] = ([r.tokens for r in spec.generate(prompts, max_new_tokens=20, stop_tokens=())],
                                  spec.stats)
    h, d = runs[0, "threshold"][1], runs[3, "threshold"][1]
    assert runs[0, "threshold"][0] == runs[3, "threshold"][0] == plain
    assert (h.steps, h.drafted, h.accepted, h.emitted) == (d.steps, d.drafted, d.accepted, d.emitted)
    assert h.device_steps == 0 and d.device_steps == d.steps > 0 and d.drafted < 3 * 4 * d.steps
    runs = {every: runs[every, None] for every in (0, 3)}
    # a decoder's second run seeds the rings its steps returned with the program its first run compiled (fresh
    # rings are committed like the returned ones)
    seeded = _seed_jit._cache_size()
    spec.generate(prompts[:1], max_new_tokens=2, stop_tokens=())
    assert _seed_jit._cache_size() == seeded
    assert runs[0][0] == runs[3][0] == plain
    h, d = runs[0][1], runs[3][1]
    assert (h.steps, h.drafted, h.accepted, h.emitted, h.rollbacks) == (d.steps, d.drafted, d.accepted, d.emitted,
                                                                        d.rollbacks)
    assert h.device_steps == 0 and d.device_steps == d.steps > 0


@pytest.mark.slow
def test_training_forward_equals_drafting_and_the_loss_trains():
    """train_forward at an anchor reproduces an inference drafting step over the same features (ring seeded with
    the positions before the anchor, labels = the drafted tokens so teacher forcing = the sampled predecessors),
    and a few gradient steps on the DSpark objective lower it."""
    from dsv41_jax.inference.speculative import _draft_jit, _seed_jit, init_dspark_rings
    from dsv41_jax.train.dspark import anchor_targets, dspark_loss

    config, params = _setup()
    rng = np.random.default_rng(1)
    t, s, p = 20, config.dspark_block_size, 11
    feats = jnp.asarray(rng.standard_normal((1, t, 3 * config.hidden_size)), jnp.float32)
    tokens = rng.integers(3, 259, (1, t))
    rings = _seed_jit(params, init_dspark_rings(config, 1), feats[:, :p], jnp.zeros((1,), jnp.int32),
                      jnp.asarray([p], jnp.int32), config=config, quant_on=True)
    d = _draft_jit(params, rings, jnp.asarray([p], jnp.int32), jnp.zeros((1,), jnp.int32),
                   jnp.asarray(tokens[:, p], jnp.int32), config=config, quant_on=True, moe_impl="dense")
    tokens[0, p + 1:p + 1 + s] = np.asarray(d.tokens[0])
    anchors = jnp.asarray([[p, 3, 0, t - 2]], jnp.int32)
    run = jax.jit(functools.partial(dspark.train_forward, config=config, quant_on=True))
    logits, conf, labels, valid = run(params, feats, jnp.asarray(tokens, jnp.int32), anchors)
    np.testing.assert_allclose(np.asarray(logits[0, 0]), np.asarray(d.logits[0]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(conf[0, 0]), np.asarray(d.confidence[0]), rtol=1e-4, atol=1e-4)
    assert np.asarray(labels[0, 0]).tolist() == np.asarray(d.tokens[0]).tolist()
    assert np.asarray(valid[0]).sum(-1).tolist() == [s, s, s, 1]  # the last anchor has one label left
    assert bool(jnp.isfinite(logits).all())

    target = jnp.asarray(rng.standard_normal((1, t, config.vocab_size)), jnp.float32)
    tgt = anchor_targets(target, anchors, s)
    np.testing.assert_array_equal(np.asarray(tgt[0, 1, 2]), np.asarray(target[0, 5]))

    def objective(dp):
        lg, cf, lb, vd = dspark.train_forward(dict(params, dspark=dp), feats, jnp.asarray(tokens, jnp.int32),
                                              anchors, config=config, quant_on=False)
        return dspark_loss(lg, cf, lb, vd, tgt)[0]

    step = jax.jit(jax.value_and_grad(objective))
    descend = jax.jit(lambda dp, g: jax.tree.map(lambda w, gw: w - 0.5 * gw, dp, g))  # one program, not one a leaf
    dp = params["dspark"]
    losses = []
    for _ in range(4):
        loss, g = step(dp)
        losses.append(float(loss))
        dp = descend(dp, g)
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
    _, m = dspark_loss(logits, conf, labels, valid)
    assert 0.0 <= float(m["accept_rate"]) <= 1.0


def test_dspark_loss_per_slot_acceptance_recombines_to_the_weighted_mean():
    """accept_{k}: slot k's mean of 1 - TV / 2 over its valid entries; with the loss's decay weights and the
    per-slot counts they give back accept_rate. A slot whose drafter distribution equals the target's scores 1."""
    from dsv41_jax.train.dspark import dspark_loss

    rng = np.random.default_rng(0)
    b, a, s, v, decay = 2, 3, 4, 11, 4.0
    target = rng.standard_normal((b, a, s, v)).astype(np.float32)
    logits = rng.standard_normal((b, a, s, v)).astype(np.float32)
    logits[..., 0, :] = target[..., 0, :]  # slot 0 drafts exactly the target's distribution
    valid = rng.random((b, a, s)) < 0.7
    valid[0, 0] = True
    labels = rng.integers(0, v, (b, a, s))
    _, m = dspark_loss(jnp.asarray(logits), jnp.zeros((b, a, s)), jnp.asarray(labels), jnp.asarray(valid),
                       jnp.asarray(target), decay=decay)
    per = np.array([float(m[f"accept_{k}"]) for k in range(s)])
    assert abs(per[0] - 1.0) < 1e-5 and (per[1:] < 0.99).all()
    counts = valid.reshape(-1, s).sum(0)
    w = np.exp(-np.arange(s) / decay) * counts
    np.testing.assert_allclose(np.sum(w * per) / np.sum(w), float(m["accept_rate"]), rtol=1e-5)


def test_bad_drafter_output_and_options_are_clear_errors():
    eng = _engine(True)
    dec = SpeculativeDecoder(eng, drafter=lambda *a: None)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        dec.verify_greedy(np.zeros(3, np.int64), np.full((3, 4), 999), np.ones(3, bool))
    with pytest.raises(EngineError, match="need pending"):
        dec.verify_greedy(np.zeros(2, np.int64), np.zeros((3, 4), np.int64), np.ones(3, bool))
    with pytest.raises(EngineError, match="rollback"):
        SpeculativeDecoder(eng, rollback="undo")
    with pytest.raises(EngineError, match="confidences"):
        SpeculativeDecoder(eng, drafter=lambda *a: None, schedule="threshold")
    config, params = _setup()
    with pytest.raises(dspark.DSparkError, match="width"):
        dspark.project_context(params["dspark"], jnp.zeros((1, 2, 5)), config)
    with pytest.raises(dspark.DSparkError, match="no DSpark"):
        dspark.check_dspark(params, config.replace(num_nextn_predict_layers=0))


def test_prefix_schedule_over_a_step_time_table_narrows_the_step():
    """With a step-time table in which one token per row is far cheaper than any wider step, the prefix scheduler
    verifies no draft and the step shrinks to a chunk of one token: plain decoding's tokens, one per step."""
    eng = _engine(True)
    prompts = [_prompt(5, 30), _prompt(9, 31)]
    plain = _plain(eng, prompts, 6)
    spec = SpeculativeDecoder(eng, schedule="prefix", step_times={1: 1e-3, 5: 1.0})
    assert [r.tokens for r in spec.generate(prompts, max_new_tokens=6, stop_tokens=())] == plain
    assert spec.stats.drafted == 0 and spec.stats.steps == 5 and spec.stats.mean_accepted_length == 1.0
    with pytest.raises(EngineError, match="step_times needs"):
        SpeculativeDecoder(eng, schedule="prefix", step_times={0: 1.0})


def test_drafter_init_from_the_target_copies_its_last_layers_and_rejects_mismatches():
    """--drafter-init target: draft block i of n holds the target's layer L - n + i's norms, mHC, attention and
    shared expert, and its first routed experts / router rows; main_proj is the identity on the last captured layer
    (so main_x = RMSNorm(that layer's features) x the copied attn_norm); heads without a counterpart keep the random
    initialisers of the same seed. Bad shapes / too few target experts are clear errors at construction."""
    from dsv41_jax.train.config import TrainConfig
    from dsv41_jax.train.dspark import DSparkTrainError, DSparkTrainOptions, DSparkTrainStep

    config, params = _setup()
    c = config.replace(dspark_n_routed_experts=4)
    target = {k: v for k, v in params.items() if k != "dspark"}
    tc = TrainConfig(seq_len=16, batch_size=1, compute_dtype="float32", quant_sim=False)
    opts = DSparkTrainOptions(anchors=2, drafter_init="target")
    dp = jax.device_get(DSparkTrainStep(c, tc, target, opts).init_state()["params"]["dspark"])
    rand = jax.device_get(DSparkTrainStep(c, tc, target, DSparkTrainOptions(anchors=2)).init_state()[
        "params"]["dspark"])
    n, nl, d = c.num_nextn_predict_layers, len(target["layers"]), c.hidden_size
    assert n == 2 and nl == 6
    same = lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))  # noqa
    for i in range(n):
        blk, lay = dp["blocks"][i], target["layers"][nl - n + i]
        for k in ("attn_norm", "ffn_norm"):
            same(blk[k], lay[k])
        for site in ("hc_attn", "hc_ffn"):
            for k in ("fn", "base", "scale"):
                same(blk[site][k], lay[site][k])
        for k in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b", "attn_sink"):
            same(blk["attn"][k], lay["attn"][k])
        for k in ("w1", "w2", "w3"):
            same(blk["ffn"]["shared_experts"][k], lay["ffn"]["shared_experts"][k])
            same(blk["ffn"]["experts"][k], np.asarray(lay["ffn"]["experts"][k])[:4])
        for k in ("weight", "bias"):
            same(blk["ffn"]["gate"][k], np.asarray(lay["ffn"]["gate"][k])[:4])
        assert set(blk["attn"]) == {"wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b", "attn_sink"}
    same(dp["norm"], target["norm"])
    for k in ("markov_embed", "markov_head", "confidence"):
        same(dp[k], rand[k])
    assert not np.array_equal(np.asarray(dp["blocks"][0]["attn"]["wkv"]), np.asarray(rand["blocks"][0]["attn"]["wkv"]))
    feats = jnp.asarray(np.random.default_rng(0).standard_normal((1, 3, 3 * d)), jnp.float32)
    want = dspark.rms_norm(feats[..., 2 * d:], target["layers"][nl - n]["attn_norm"], c.rms_norm_eps)
    np.testing.assert_allclose(np.asarray(dspark.project_context(dp, feats, c)), np.asarray(want), rtol=1e-5,
                               atol=1e-6)

    with pytest.raises(DSparkTrainError, match="16 routed experts, the target only 8"):
        DSparkTrainStep(config.replace(dspark_n_routed_experts=16), tc, target, opts)
    bad = jax.tree.map(lambda x: x, target)
    bad["layers"][5]["attn"]["wkv"] = np.zeros((3, d), np.float32)
    with pytest.raises(DSparkTrainError, match="block 1's attn/wkv has shape"):
        DSparkTrainStep(c, tc, bad, opts)
    DSparkTrainStep(c, tc, bad, DSparkTrainOptions(anchors=2))  # the random init does not read the target's layers
    with pytest.raises(ValueError, match="drafter init must be one of"):
        DSparkTrainOptions(drafter_init="copy")
    from dsv41_jax.cli import build_parser
    from dsv41_jax.train.cli import _dspark_options

    args = build_parser().parse_args(["train", "--dspark", "--drafter-init", "target", "--data", "x"])
    assert _dspark_options(args).drafter_init == "target"
    args = build_parser().parse_args(["train", "--dspark", "--data", "x"])
    assert _dspark_options(args).drafter_init == "random"  # the default is unchanged
