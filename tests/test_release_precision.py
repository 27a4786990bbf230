"""Serving in the release's precision (SPEC §5, §10, §12): FP8 / FP4 weights kept as QuantizedTensor leaves and
dequantised at use, the release's FP8 rounding of every FP8 / FP4 GEMM's input, and the KV cache packed in the
release's formats. The release-precision engine equals the fake-quantised training forward on the dequantised
weights; the packed cache equals the unpacked one bit for bit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import ForwardOptions, forward
from dsv41_jax.checkpoint import names as N
from dsv41_jax.checkpoint.quantized import QuantizedTensor
from dsv41_jax.inference import Engine, packed_cache as PC
from dsv41_jax.inference.cache import abstract_cache, cache_footprint, init_cache, tree_bytes
from dsv41_jax.inference.decode import decode_step
from dsv41_jax.inference.prefill import prefill
from dsv41_jax.inference.step import FAST_COMPILE, InferenceOptions
from dsv41_jax.inference.weights import host_random_params
from dsv41_jax.model import release_weights as RW
from dsv41_jax.model.model import default_hasher
from dsv41_jax.train.testing import every_role_config
from dsv41_jax.ops import quant as Q
from dsv41_jax.ops.engram import table_rows
from dsv41_jax.ops.linear import Fp8GemmInput, linear, select_expert

MAX_LEN = 32


@functools.lru_cache(maxsize=None)
def _model():
    # tiny cut to 6 layers, every layer kind once (SWA, Full ratio 2 + Engram, Reuse, the decoder's Full ratio 1 /
    # HSI candidate source, Reuse, Reindex): about half the compile time. quant_sim on (the release's fake
    # quantisation of window KV, compressed KV and indexer q / keys).
    config = every_role_config()
    params = host_random_params(config, 0, std=0.1, perturb_constants=0.2)
    qparams = RW.quantize_params(params, config)
    return config, qparams, RW.dequantize_params(qparams), default_hasher(config)


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


# ----------------------------------------------------------------------------------------------------------------
# packed KV formats
# ----------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, fake_quant", [
    (PC.FP8_UE8M0_32, lambda x: Q.fake_quant_fp8_e4m3_block(x, 32)),
    (PC.FP4_E4M3_16, lambda x: Q.fake_quant_fp4_e2m1_block(x, 16, scale_format="e4m3")),
    (PC.FP4_UE8M0_32, lambda x: Q.fake_quant_fp4_e2m1_block(x, 32, scale_format="ue8m0")),
])
def test_packing_is_lossless_on_the_fake_quantised_grids(fmt, fake_quant):
    """Values the fake quantiser produces pack and unpack bit for bit (zeros, -0.0, magnitudes over 2^±11 included);
    values off the grid are quantised exactly as the release's quantiser does."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 9, 64)).astype(np.float32) * np.exp2(rng.integers(-11, 12, (3, 9, 1)))
    x[0, 0, :32] = 0.0
    x[0, 1, :16] = -0.0
    x[1, 2, 5] = 1e-30  # a tiny value under a block's amax floor
    x = jnp.asarray(x.astype(np.float32))

    @jax.jit
    def run(x):
        y = fake_quant(x)
        values, scales = PC.pack(y, fmt)
        return y, values, scales, PC.unpack(values, scales, fmt), PC.unpack(*PC.pack(x, fmt), fmt)

    y, values, scales, back, quantised = run(x)
    vshape, sshape = PC.packed_shapes(y.shape, fmt)
    assert values.dtype == scales.dtype == jnp.uint8 and values.shape == vshape and scales.shape == sshape
    np.testing.assert_array_equal(_bits(back), _bits(y))
    np.testing.assert_array_equal(_bits(quantised), _bits(y))
    assert np.signbit(np.asarray(y)[0, 1, :16]).all() == (fmt == PC.FP8_UE8M0_32)  # -0.0 survives where it exists


def test_release_cache_footprint_equals_the_packed_bytes():
    config = _model()[0]
    fp = cache_footprint(config, "release", batch=3, max_len=101)
    held = tree_bytes(abstract_cache(config, 3, 101, jnp.float32, packed=True))
    engram_history = 3 * (config.engram_max_ngram_size - 1) * 4  # host-side, counted by the footprint
    assert fp.allocated == held + engram_history
    swa = abstract_cache(config, 1, 8, packed=True)["swa"][0]
    assert isinstance(swa, PC.PackedRows) and swa.shape == (1, config.sliding_window, config.head_dim)
    assert tree_bytes(swa) == config.sliding_window * (config.head_dim + config.head_dim // 32)


# ----------------------------------------------------------------------------------------------------------------
# weight forms
# ----------------------------------------------------------------------------------------------------------------

def test_weight_forms_dequantise_at_use_and_round_gemm_inputs():
    config, qparams, dparams, _ = _model()
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, config.hidden_size), jnp.float32)
    wq = qparams["layers"][0]["attn"]["wq_a"]
    assert isinstance(wq, QuantizedTensor) and wq.fmt == N.FP8_BLOCK
    dq = dparams["layers"][0]["attn"]["wq_a"]
    np.testing.assert_array_equal(linear(x, wq), linear(x, dq))
    rounded = Q.fake_quant_gemm_input_fp8(x, 32)
    np.testing.assert_array_equal(linear(x, Fp8GemmInput(wq)), linear(rounded, dq))
    # stacked FP4 experts: one expert's own packed bytes
    e = qparams["layers"][3]["ffn"]["experts"]["w2"]
    assert e.fmt == N.FP4_ROWS and e.values.shape[-1] * 2 == e.shape[-1]
    np.testing.assert_array_equal(select_expert(e, 5).dequantize(), dparams["layers"][3]["ffn"]["experts"]["w2"][5])
    # Engram tables gather the stored rows only
    t = qparams["layers"][1]["engram"]["embed"]
    assert t.fmt == N.ENGRAM_ROWS
    ids = jnp.array([[3, 0, 659], [7, 7, 1]])
    np.testing.assert_array_equal(table_rows(t, ids, jnp.float32), dparams["layers"][1]["engram"]["embed"][ids])
    # which GEMMs round their input: the release's FP8 / FP4 ones, not wo_a (dequantised to bf16 by the release)
    marked = RW.fp8_gemm_paths(config)
    assert "layers/0/attn/wq_a" in marked and "layers/3/ffn/experts/w1" in marked
    assert "layers/1/engram/wkv" in marked and "layers/0/attn/wo_a" not in marked
    assert not any(p.endswith(("compressor/wkv", "indexer/wk", "weights_proj", "gate/weight")) or p == "lm_head"
                   for p in marked)
    assert RW.weight_bytes(qparams) < RW.weight_bytes(dparams) / 2.5
    # the shape-only accounting (used for the full model) equals the bytes really held by the serving form, which
    # holds wo_a dequantised (as the official code serves it, RW.dequantize_wo_a): the storage form's FP8 wo_a bytes
    # are no longer what the device holds
    served = RW.dequantize_wo_a(qparams, jnp.float32)
    assert sum(RW.weight_footprint(config, "release", jnp.float32).values()) == RW.weight_bytes(served)
    wo_a = [layer["attn"]["wo_a"] for layer in qparams["layers"]]
    assert RW.weight_bytes(served) - RW.weight_bytes(qparams) == sum(4 * np.prod(w.shape) - w.nbytes for w in wo_a)
    assert sum(RW.weight_footprint(config, "bf16", jnp.float32).values()) == RW.weight_bytes(dparams)


def test_wo_a_served_from_load_is_exact_and_changes_no_bit():
    """wo_a dequantised once, at load (RW.dequantize_wo_a, as the official code serves it in bf16): with e8m0 scales
    (powers of two) every e4m3 value times its scale is exact in bf16 — checked bit for bit against the float64
    product over all 254 finite codes and the exact exponent range's ends; the attention output from the served
    array equals the per-step dequantising path bit for bit (bf16 and float32); outside the range, and with float
    scales, the product is rounded once to nearest even (the official ``.float() * scale`` then ``.bfloat16()``)."""
    import ml_dtypes

    from dsv41_jax.checkpoint import quantized as QZ
    from dsv41_jax.ops.attention import attention_output

    lo, hi = RW.exact_scale_exponents(jnp.bfloat16)
    assert (lo, hi) == (-117, 119) == RW.exact_scale_exponents(jnp.float32)
    codes = np.array([c for c in range(256) if c & 127 != 127], np.uint8)  # every finite e4m3 code, +-0 included
    rows, cols = np.arange(64)[:, None], np.arange(256)[None, :]
    values = codes[(cols + 37 * rows) % codes.size]  # [64, 256], 2 x 8 blocks of 32 x 32: each block sees every code
    k = np.array([[lo, hi, 0, -8, -20, 3, lo + 1, hi - 1], [-1, 1, -117, 119, -30, 30, -2, 2]], np.int32)
    qt = QuantizedTensor(jnp.asarray(values), jnp.asarray((k + QZ.E8M0_BIAS).astype(np.uint8)), N.FP8_BLOCK,
                         values.shape, QZ.FP8_BLOCK_SHAPE)
    exact = QZ.e4m3_to_f32(values).astype(np.float64) * np.exp2(np.repeat(np.repeat(k, 32, 0), 32, 1))
    got = RW.dequantize_served(qt, jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float64), exact)  # exact: no bit rounded
    assert (np.signbit(np.asarray(got, np.float32)) == np.signbit(exact)).all()  # -0.0 kept
    # out of the exact range (products subnormal in bf16) and float scales: one rounding, as the official code
    e4m3 = QZ.e4m3_to_f32(values)
    for scales, mult in (((k - 10 + QZ.E8M0_BIAS).astype(np.uint8), np.exp2(k - 10).astype(np.float32)),
                         (np.float32(0.3) * np.exp2(k).astype(np.float32),) * 2):
        q2 = QuantizedTensor(jnp.asarray(values), jnp.asarray(scales), N.FP8_BLOCK, values.shape, QZ.FP8_BLOCK_SHAPE)
        want = (e4m3 * np.repeat(np.repeat(mult, 32, 0), 32, 1)).astype(ml_dtypes.bfloat16)  # float32, RNE once
        np.testing.assert_array_equal(np.asarray(RW.dequantize_served(q2, jnp.bfloat16)).view(np.uint16),
                                      want.view(np.uint16))
    with pytest.raises(ValueError, match="layers/3/ffn/experts/w1: expected a 2-D FP8"):
        RW.dequantize_served(_model()[1]["layers"][3]["ffn"]["experts"]["w1"], what="layers/3/ffn/experts/w1")

    # the attention output: served wo_a (from load) == QuantizedTensor wo_a (dequantised per step), bit for bit
    config, qparams, _, _ = _model()
    p = qparams["layers"][0]["attn"]
    b, t = 2, 3
    out = jax.random.normal(jax.random.PRNGKey(1), (b, t, config.num_attention_heads, config.head_dim))
    ang = jax.random.uniform(jax.random.PRNGKey(2), (b, t, config.qk_rope_head_dim // 2)) * 6.0
    run = jax.jit(lambda p, out: attention_output(p, out, jnp.cos(ang), jnp.sin(ang), config))
    for dtype in (jnp.bfloat16, jnp.float32):
        served = dict(p, wo_a=RW.dequantize_wo_a({"layers": [{"attn": p}]}, dtype)["layers"][0]["attn"]["wo_a"])
        assert served["wo_a"].dtype == dtype
        a, b_ = run(p, out.astype(dtype)), run(served, out.astype(dtype))
        np.testing.assert_array_equal(_bits(a), _bits(b_))


def test_quantised_weights_shard_by_the_logical_axis_rules():
    """8 fake CPU devices (expert 4 x tensor 2): stacked FP4 experts split over the expert axis and along K in whole
    scale blocks (values and scales share one spec); a K too short for whole blocks per device stays unsplit; the
    sharded dequantising projection equals the unsharded one; the tiny model's tree places on an 8-way expert mesh."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dsv41_jax.parallel import make_mesh

    mesh = make_mesh("data=1,expert=4,tensor=2")
    rng = np.random.default_rng(0)
    experts = RW._quantize(rng.standard_normal((8, 64, 128)).astype(np.float32), N.FP4_ROWS)  # K = 128: 4 blocks
    spec = RW.quantized_partition_spec(experts, ("experts", "embed", "expert_mlp"), mesh, "tp")
    assert spec == P("expert", None, "tensor")
    # a sharding tree carries the tensor's static fields (scale_max included: the pytree structures must match)
    placed = jax.device_put(experts, QuantizedTensor(NamedSharding(mesh, spec), NamedSharding(mesh, spec),
                                                     experts.fmt, experts.shape, experts.block, experts.scale_max))
    for v, s in zip(placed.values.addressable_shards, placed.scales.addressable_shards):
        assert v.index[:-1] == s.index[:-1] and v.data.shape[-1] * 2 == s.data.shape[-1] * N.FP4_BLOCK
        assert v.index[-1].start * 2 == s.index[-1].start * N.FP4_BLOCK  # the shard starts at a block boundary
    x = jnp.asarray(rng.standard_normal((5, 128)).astype(np.float32))
    got = jax.jit(lambda w, x: linear(x, Fp8GemmInput(select_expert(w, 6))))(placed, x)
    want = linear(Q.fake_quant_gemm_input_fp8(x, 32), experts.dequantize()[6])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    short = RW._quantize(rng.standard_normal((64, 32)).astype(np.float32), N.FP8_BLOCK)  # K = 32: one block
    assert RW.quantized_partition_spec(short, ("embed", "mlp"), mesh, "tp") == P()
    config, qparams, _, _ = _model()
    sh = RW.release_shardings(qparams, config, make_mesh("data=1,expert=8,tensor=1"), "tp")  # vocab 259: no tensor
    w1 = sh["layers"][3]["ffn"]["experts"]["w1"]
    assert isinstance(w1, QuantizedTensor) and w1.values.spec == w1.scales.spec == P("expert")
    jax.device_put(qparams, sh)


# ----------------------------------------------------------------------------------------------------------------
# the release-precision engine vs the fake-quantised forward
# ----------------------------------------------------------------------------------------------------------------

def _run(config, params, hasher, seqs, prompt_lens, n_steps, *, packed: bool):
    """Prefill a mixed-length batch, decode the continuations: per sequence the logits of its replayed prompt
    positions and decode steps, and the first replayed position; plus the final cache."""
    opts = InferenceOptions(quant_sim=True, gemm_input_fp8=True, compiler_options=FAST_COMPILE)
    b, width = len(seqs), max(prompt_lens)
    tokens = np.zeros((b, width), np.int32)
    eids = np.zeros((b, width, len(config.engram_layer_ids), config.n_hash_cols), np.int32)
    hist = []
    for s, (seq, t) in enumerate(zip(seqs, prompt_lens)):
        tokens[s, :t] = seq[:t]
        rows, h = hasher.step(seq[None, :t], hasher.empty_history(1))
        eids[s, :t] = rows[0]
        hist.append(h)
    cache = init_cache(config, b, MAX_LEN, packed=packed)
    _, cache, seg = prefill(params, cache, tokens, np.asarray(prompt_lens), eids, config=config, opts=opts,
                            return_logits=True)
    r = config.sliding_window
    outs = [[np.asarray(seg)[s, :min(r, t)]] for s, t in enumerate(prompt_lens)]
    for i in range(n_steps):
        tok = np.array([seq[t + i] for seq, t in zip(seqs, prompt_lens)], np.int32)
        e = np.zeros((b, len(config.engram_layer_ids), config.n_hash_cols), np.int32)
        for s, (seq, t) in enumerate(zip(seqs, prompt_lens)):
            rows, hist[s] = hasher.step(seq[None, t + i:t + i + 1], hist[s])
            e[s] = rows[0, 0]
        logits, cache = decode_step(params, cache, tok, e, np.ones((b,), bool), config=config, opts=opts)
        for s in range(b):
            outs[s].append(np.asarray(logits)[s][None])
    return [(np.concatenate(o), t - min(r, t)) for o, t in zip(outs, prompt_lens)], cache


_forward_jit = jax.jit(forward, static_argnames=("config", "options"), compiler_options=dict(FAST_COMPILE))


@pytest.mark.slow  # four compiles of a 6-layer model: ~55 s on two CPU cores
@pytest.mark.memory_heavy
def test_release_engine_equals_fake_quantised_forward_and_packed_cache_is_exact():
    """QuantizedTensor weights + GEMM-input rounding + packed cache (prefill of a short and a replay-bounded prompt,
    then 3 decode steps) == the training forward with fake quantisation and GEMM-input rounding on the dequantised
    weights, within float32 accumulation-order noise; the same run on an unpacked cache gives identical logits and
    a cache whose contents the packed one reproduces bit for bit."""
    config, qparams, dparams, hasher = _model()
    r, n_steps = config.sliding_window, 3
    lens = [r - 3, r + 5]
    rng = np.random.default_rng(3)
    seqs = [rng.integers(3, config.vocab_size, t + n_steps).astype(np.int32) for t in lens]
    served = RW.dequantize_wo_a(qparams, jnp.float32)  # what Engine(weights="release") serves: wo_a from load
    got, packed_cache = _run(config, served, hasher, seqs, lens, n_steps, packed=True)
    for seq, t, (logits, first) in zip(seqs, lens, got):
        opts = ForwardOptions(quant_sim=True, gemm_input_fp8=True)
        if t > r:
            opts = ForwardOptions(quant_sim=True, gemm_input_fp8=True, bounded_replay=True, replay_len=r + n_steps)
        ref = _forward_jit(dparams, jnp.asarray(seq[None]), config=config,
                           engram_ids=jnp.asarray(hasher.row_ids(seq[None])), options=opts)
        # measured: 6e-7 (logits up to 3.2)
        np.testing.assert_allclose(logits, np.asarray(ref)[0, first:], rtol=0, atol=1e-5)

    unpacked_got, dense_cache = _run(config, served, hasher, seqs, lens, n_steps, packed=False)
    for (a, _), (b, _) in zip(got, unpacked_got):
        np.testing.assert_array_equal(a, b)
    flat_p = jax.tree.leaves(jax.tree.map(PC.read, packed_cache, is_leaf=lambda x: isinstance(x, PC.PackedRows)))
    flat_d = jax.tree.leaves(dense_cache)
    assert len(flat_p) == len(flat_d)
    for a, b in zip(flat_p, flat_d):
        np.testing.assert_array_equal(_bits(a) if a.dtype == jnp.float32 else a, _bits(b) if b.dtype == jnp.float32 else b)


def test_engine_options_report_release_bytes():
    config, qparams, dparams, _ = _model()
    eng = Engine(config, dparams, max_batch=2, max_len=MAX_LEN, weights="release", cache="release")
    assert eng.weights_format == "release" and eng.options.gemm_input_fp8
    assert isinstance(eng.params["layers"][0]["attn"]["wq_a"], QuantizedTensor)
    # wo_a is served in the model's float dtype from load (as the official code serves it in bf16): exactly the
    # dequantised weight, and counted at its float bytes
    wo_a = eng.params["layers"][0]["attn"]["wo_a"]
    assert not isinstance(wo_a, QuantizedTensor) and wo_a.dtype == dparams["embed"].dtype
    np.testing.assert_array_equal(_bits(wo_a), _bits(dparams["layers"][0]["attn"]["wo_a"]))
    assert eng.weight_bytes() == RW.weight_bytes(RW.dequantize_wo_a(qparams, dparams["embed"].dtype))
    assert eng.footprint().storage == "release" and eng.footprint().allocated == eng.allocated_bytes() + \
        2 * (config.engram_max_ngram_size - 1) * 4
    plain = Engine(config, qparams, max_batch=2, max_len=MAX_LEN, weights="bf16")
    assert plain.weights_format == "bf16" and not plain.options.gemm_input_fp8
    assert plain.weight_bytes() == RW.weight_bytes(dparams)
    with pytest.raises(Exception, match="cache must be"):
        Engine(config, dparams, max_batch=2, max_len=MAX_LEN, cache="fp8")


@pytest.mark.slow  # two forwards of the 6-layer model, the Pallas kernels in interpret mode
def test_quantized_gemm_kernels_equal_the_plain_jax_release_forward():
    """The release-precision forward (QuantizedTensor weights, GEMM-input FP8 rounding, fake quantisation) with the
    quantised-GEMM Pallas kernels (GPU Triton kernels in interpret mode: FP8 dense projections and the FP4 grouped
    routed experts) equals the same forward with the plain-JAX dequantise-then-GEMM, within float32
    accumulation-order noise."""
    config, qparams, _, hasher = _model()
    seq = np.random.default_rng(5).integers(3, config.vocab_size, 9).astype(np.int32)[None]
    eids = jnp.asarray(hasher.row_ids(seq))
    outs = [_forward_jit(qparams, jnp.asarray(seq), config=config, engram_ids=eids,
                         options=ForwardOptions(quant_sim=True, gemm_input_fp8=True, quantized_gemm=gemm))
            for gemm in ("reference", "pallas_gpu_interpret")]
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=1e-5)
