"""The GPU (Triton-lowered) decode kernels reading the packed, release-format KV cache directly (Pallas interpret
mode on CPU): the sparse attention over packed FP4 compressed KV and the indexer over packed FP4 keys equal the same
kernels run on ``packed_cache.read`` of the buffer, bit for bit (the in-register dequantisation gives exactly the
unpacked values, and everything after it is the same kernel)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import compiled
from dsv41_jax import kernels as KN
from dsv41_jax.inference import packed_cache as PC
from dsv41_jax.kernels import pallas_gpu as G

GPU = "pallas_gpu_interpret"


def _bits(x):
    return np.asarray(jnp.asarray(x, jnp.float32)).view(np.uint32)


def test_in_register_decoders_equal_the_unpacker():
    byte = jnp.arange(256, dtype=jnp.int32)
    want = jax.lax.bitcast_convert_type(byte.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)
    finite = ~np.isnan(np.asarray(want))  # 0x7f / 0xff: NaN, never packed
    assert finite.sum() == 254
    np.testing.assert_array_equal(_bits(G.e4m3_from_bits(byte))[finite], _bits(want)[finite])  # -0.0 included
    code = jnp.arange(16, dtype=jnp.int32)
    np.testing.assert_array_equal(_bits(G.e2m1_from_code(code)), _bits(PC._fp4_values(code.astype(jnp.uint8))))
    s = np.arange(1, 255, dtype=np.int32)
    np.testing.assert_array_equal(_bits(G.ue8m0_from_bits(jnp.asarray(s))), _bits(np.ldexp(np.float32(1), s - 127)))
    # the tile loads' bit-placement decoders (float16 patterns): every e4m3 byte, both nibbles of every FP4 byte
    f16 = G._f16_pattern
    np.testing.assert_array_equal(_bits(f16(byte, 0x80, 8, 0x7F, 7) * 2.0 ** 8)[finite], _bits(want)[finite])
    nib = PC._fp4_values(PC._unpack_nibbles(byte.astype(jnp.uint8)))
    np.testing.assert_array_equal(_bits(f16(byte, 0x08, 12, 0x07, 9) * 2.0 ** 14), _bits(nib[0::2]))
    np.testing.assert_array_equal(_bits(f16(byte, 0x80, 8, 0x70, 5) * 2.0 ** 14), _bits(nib[1::2]))
    for fmt in G.PACKED_FORMATS:
        assert fmt in PC.FORMATS and PC.FORMATS[fmt] == G.PACKED_FORMATS[fmt][:2]


def _packed(rng, shape, fmt, dtype):
    """Random vectors with a wide spread of block magnitudes, packed (lossy for off-grid values: the point here is
    the kernel reading whatever the buffer holds)."""
    x = rng.normal(size=shape) * np.exp2(rng.integers(-12, 6, size=shape[:-1] + (1,)))
    v, s = jax.jit(PC.pack, static_argnums=1)(jnp.asarray(x, jnp.float32), fmt)
    return PC.PackedRows(v, s, fmt, shape[-1], str(jnp.dtype(dtype)))


@pytest.mark.parametrize("dtype,d,tuning", [(jnp.float32, 64, {"block_d": 32, "num_splits": 2}),  # value-dim blocks
                                            (jnp.bfloat16, 48, {}),  # head dim padded to 64
                                            (jnp.bfloat16, 64, {"packed_load": "gather"}),  # the first read
                                            # compressed rows loaded a block ahead, decoded once for both dots
                                            (jnp.bfloat16, 64, {"packed_ahead": True, "block_k": 16})])
def test_sparse_attention_on_packed_compressed_kv_equals_unpacked(dtype, d, tuning):
    rng = np.random.default_rng(d)
    b, c, h, n, k, w = 2, 1, 4, 37, 24, 8
    q = jnp.asarray(rng.normal(size=(b, c, h, d)), dtype)
    win = jnp.asarray(rng.normal(size=(b, w, d)), dtype)
    wpos = jnp.asarray(rng.integers(-1, 30, size=(b, w)), jnp.int32)
    qpos = jnp.full((b, c), 29, jnp.int32)
    ckv = _packed(rng, (b, n, d), PC.FP4_E4M3_16, dtype)
    topk = rng.integers(-1, n, size=(b, c, k))
    topk[..., 1::4] = topk[..., 0::4][..., : topk[..., 1::4].shape[-1]]  # duplicates
    topk = jnp.asarray(topk, jnp.int32)
    sink = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    kw = dict(window=w, backend=GPU, tuning=tuning)
    got, want = compiled(lambda q, qpos, win, wpos, ckv, topk, sink, floor: (
        KN.sparse_attention(q, qpos, win, wpos, ckv, topk, sink, floor=floor, **kw),
        KN.sparse_attention(q, qpos, win, wpos, PC.read(ckv), topk, sink, floor=floor, **kw)),
        q, qpos, win, wpos, ckv, topk, sink, jnp.asarray([0, 3], jnp.int32))
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(_bits(got), _bits(want))
    assert np.isfinite(np.asarray(got, np.float32)).all()


def test_decode_split_rules():
    """The split of the key list: "fill" is the rule before the rules were named (ceil(132 / programs), at most half
    the key blocks; 4 for 1-4 16-bit rows), "wave" keeps the programs to one wave of the 132 multiprocessors,
    "few_wave" (the default) is "wave" for 1-4 16-bit rows and "fill" above; an explicit ``num_splits`` wins."""
    cases = {  # (programs, key blocks, few 16-bit rows): (fill, wave, few_wave)
        (64, 21, False): (3, 2, 3),  # bench40 decode at batch 32: 64 heads in 32-head tiles
        (4, 21, True): (4, 10, 10),  # batch 1: 16-head tiles, 5 window + 16 compressed key blocks
        (4, 5, True): (4, 2, 2),  # batch 1 without compressed rows
        (200, 21, False): (1, 1, 1),  # more than one wave already
        (50, 4, False): (2, 2, 2),  # capped at half the key blocks
        (8, 21, False): (10, 10, 10),
    }
    for (progs, nblk, few), want in cases.items():
        assert tuple(KN.decode_splits(progs, nblk, few, r) for r in KN.SPLIT_RULES) == want, (progs, nblk, few)
    assert KN.SPLIT_RULE == "few_wave"
    with pytest.raises(ValueError, match="split rule"):
        KN.decode_splits(4, 21, True, "half")
    q = jnp.zeros((32, 1, 64, 512), jnp.bfloat16)
    cfg = KN._AttnCfg("pallas_gpu", "explicit", 128, 1.0, 129, 0, (("split_rule", "wave"),))
    topk = jnp.zeros((32, 1, 512), jnp.int32)
    assert KN._gpu_tuning(cfg, q, topk)["num_splits"] == 2
    assert "split_rule" not in KN._gpu_tuning(cfg, q, topk)
    default = dataclasses.replace(cfg, tuning=())
    assert KN._gpu_tuning(default, q, topk)["num_splits"] == 3  # batch 32: "fill"
    assert KN._gpu_tuning(default, q[:1], topk[:1])["num_splits"] == 10  # batch 1: "wave"
    # float32 tiles (16 heads x 256 values, 16-row key blocks: 8 programs, 41 blocks) keep "fill" at one row
    assert KN._gpu_tuning(default, q[:1].astype(jnp.float32), topk[:1])["num_splits"] == 17
    cfg1 = dataclasses.replace(cfg, tuning=(("num_splits", 5), ("split_rule", "wave")))
    assert KN._gpu_tuning(cfg1, q[:1], topk[:1])["num_splits"] == 5


@pytest.mark.parametrize("rule", KN.SPLIT_RULES)
def test_packed_attention_equals_unpacked_under_each_split_rule(rule):
    """Both caches take the same split rule, so the packed kernel stays bit-equal to unpack-then-kernel under each
    (7 key blocks of 16 rows: "fill" 4 splits, "wave" / "few_wave" 3)."""
    rng = np.random.default_rng(11)
    b, c, h, d, n, k, w = 1, 1, 4, 64, 120, 96, 16
    q = jnp.asarray(rng.normal(size=(b, c, h, d)), jnp.bfloat16)
    win = jnp.asarray(rng.normal(size=(b, w, d)), jnp.bfloat16)
    wpos = jnp.asarray(100 - w + np.arange(w)[None, :], jnp.int32)
    qpos = jnp.full((b, c), 100, jnp.int32)
    ckv = _packed(rng, (b, n, d), PC.FP4_E4M3_16, jnp.bfloat16)
    topk = jnp.asarray(np.sort(rng.choice(n, size=(b, c, k), replace=False), axis=-1), jnp.int32)
    sink = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    kw = dict(window=w, backend=GPU, tuning={"split_rule": rule, "block_k": 16, "packed_ahead": True})
    got, want = compiled(lambda q, qpos, win, wpos, ckv, topk, sink: (
        KN.sparse_attention(q, qpos, win, wpos, ckv, topk, sink, **kw),
        KN.sparse_attention(q, qpos, win, wpos, PC.read(ckv), topk, sink, **kw)), q, qpos, win, wpos, ckv, topk, sink)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def _ring_case(rng, dtype, b, c, h, n, d=64, r=24):
    """A decode chunk over a packed cache: queries q [b, c, h, d] at positions pos0 + 0..c-1 (pos0 5 in row 0: a
    partly empty ring; 40 in row 1: wrapped), a packed FP8 window ring of r slots + the chunk's own rows (their
    positions wpos), packed FP4 compressed KV of n rows. Returns (q, pos, new, wpos, ring, base, ckv)."""
    ring = _packed(rng, (b, r, d), PC.FP8_UE8M0_32, dtype)
    base = jnp.asarray([5, 40], jnp.int32)
    new = jnp.asarray(rng.normal(size=(b, c, d)), dtype)
    pos = base[:, None] + jnp.arange(c)[None, :]
    ring_pos = base[:, None] - r + jnp.arange(r)[None, :]
    wpos = jnp.concatenate([jnp.where(ring_pos >= 0, ring_pos, -1), pos], axis=1)
    q = jnp.asarray(rng.normal(size=(b, c, h, d)), dtype)
    ckv = _packed(rng, (b, n, d), PC.FP4_E4M3_16, dtype)
    return q, pos, new, wpos, ring, base, ckv


@pytest.mark.parametrize("dtype,tuning", [(jnp.bfloat16, {}), (jnp.float32, {"block_d": 32, "block_k": 16})])
def test_sparse_attention_on_a_packed_window_ring_equals_unpacked(dtype, tuning):
    """The window's ring read from its packed FP8 slots in window order (wrapping around the ring), followed by the
    chunk's own rows, with packed compressed KV too; rows of the ring before the window / floor masked as usual."""
    rng = np.random.default_rng(7)
    b, c, h, n, k = 2, 2, 4, 20, 12
    q, pos, new, wpos, ring, base, ckv = _ring_case(rng, dtype, b, c, h, n)
    topk = jnp.asarray(rng.integers(-1, n, size=(b, c, k)), jnp.int32)
    sink = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    kw = dict(window=16, backend=GPU, tuning=tuning)

    def run(q, pos, new, wpos, ring, base, ckv, topk, sink, floor):
        got = KN.sparse_attention(q, pos, new, wpos, ckv, topk, sink, win_ring=(ring, base), floor=floor, **kw)
        win = jnp.concatenate([KN.ring_rows(PC.read(ring), base).astype(dtype), new], axis=1)
        want = KN.sparse_attention(q, pos, win, wpos, PC.read(ckv), topk, sink, floor=floor, **kw)
        # the materialising fallback (reference backend) reads the same window
        ref = KN.sparse_attention(q, pos, new, wpos, ckv, topk, sink, win_ring=(ring, base), floor=floor,
                                  **dict(kw, backend="reference"))
        return got, want, ref

    got, want, ref = compiled(run, q, pos, new, wpos, ring, base, ckv, topk, sink, jnp.asarray([0, 30], jnp.int32))
    np.testing.assert_array_equal(_bits(got), _bits(want))
    np.testing.assert_allclose(np.asarray(ref, np.float32), np.asarray(want, np.float32),
                               rtol=0, atol=1e-5 if dtype == jnp.float32 else 2e-2)


def _gather_case(rng, dtype, n):
    """A verification-sized decode case on a packed cache: 2 batch rows x 3 queries, a packed FP8 window ring
    (partly empty in row 0, wrapped in row 1) + the chunk's own rows, packed FP4 compressed KV, top-k lists with -1
    entries, duplicates, a partly empty list and an index past the buffer's rows (clipped, as the kernels clip)."""
    b, c, h, k = 2, 3, 4, 12
    q, pos, new, wpos, ring, base, ckv = _ring_case(rng, dtype, b, c, h, n)
    topk = rng.integers(-1, n, size=(b, c, k))
    topk[0, 1, 4:] = -1  # a partial list
    topk[1, 2, 1::3] = topk[1, 2, 0]  # duplicates
    topk[1, 0, 5] = n + 3  # past the buffer: row n - 1
    sink = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    return q, pos, new, wpos, ring, base, ckv, jnp.asarray(topk, jnp.int32), sink


@pytest.mark.parametrize("dtype,n,tuning", [(jnp.bfloat16, 40, {}),  # 36 selected rows gathered out of 40
                                            (jnp.bfloat16, 40, {"num_splits": 3, "block_k": 16}),
                                            (jnp.float32, 40, {"block_d": 32, "block_k": 16, "num_splits": 2}),
                                            (jnp.bfloat16, 20, {"num_splits": 2})])  # 36 > 20: the whole buffer
def test_gather_form_equals_the_packed_kernel_and_unpack_then_kernel(dtype, n, tuning, monkeypatch):
    """``packed_attention="gather"``: the selected rows' bytes + scales gathered and unpacked, the ring unpacked in
    window order, then the bf16-cache kernel over them with the top-k remapped (query c's entry j -> row c * K + j).
    The kernel then reads the same values in the same key blocks (the top-k keeps its length K and the window its
    span, so the same blocks and splits; the split count is also pinned here), so its float32 sums are the same: bit
    for bit the unpack-then-kernel result and the packed kernel's, and the reference's within the kernels' bounds."""
    rng = np.random.default_rng(n)
    q, pos, new, wpos, ring, base, ckv, topk, sink = _gather_case(rng, dtype, n)
    b, c, k = topk.shape
    kw = dict(window=16, backend=GPU)
    calls = []
    fwd = G.attention_fwd
    monkeypatch.setattr(G, "attention_fwd", lambda *a, **k_: calls.append((jax.tree.leaves(a[6])[0].shape,
                                                                           k_.get("ckv_fmt"), k_.get("ring")))
                        or fwd(*a, **k_))
    n_calls = []  # the kernel calls made so far, after each form (all five forms are traced into one program)

    def run(q, pos, new, wpos, ring, base, ckv, topk, sink, floor):
        attend = lambda tuning_, **o: KN.sparse_attention(q, pos, new, wpos, ckv, topk, sink, win_ring=(ring, base),
                                                          tuning=tuning_, floor=floor, **kw, **o)
        got = attend(dict(tuning, packed_attention="gather"))
        n_calls.append(len(calls))
        kernel = attend(dict(tuning, packed_attention="kernel"))
        default = attend(tuning)  # the default form at these 6 query rows
        # the gathers by XLA instead of the fused Pallas gathers
        xla = attend(dict(tuning, packed_attention="gather_xla"))
        n_calls.append(len(calls))
        win = jnp.concatenate([KN.ring_rows(PC.read(ring), base).astype(dtype), new], axis=1)
        want = KN.sparse_attention(q, pos, win, wpos, PC.read(ckv), topk, sink, tuning=tuning, floor=floor, **kw)
        ref = KN.sparse_attention(q, pos, win, wpos, PC.read(ckv), topk, sink, floor=floor,
                                  **dict(kw, backend="reference"))
        return got, kernel, default, xla, want, ref

    got, kernel, default, xla, want, ref = compiled(run, q, pos, new, wpos, ring, base, ckv, topk, sink,
                                                    jnp.asarray([0, 30], jnp.int32))
    assert n_calls == [1, 4]
    (shape, fmt, ring_arg) = calls[0]  # the bf16-cache kernel over the selected rows (or the whole buffer)
    assert fmt is None and ring_arg is None and shape == (b, min(c * k, n), 64)
    assert calls[1][1] == PC.FP4_E4M3_16 and calls[1][2] is not None
    # the default at these 6 query rows: the gather form where the 36 selected rows fit in the buffer (40 rows)
    assert calls[2][1] == (None if c * k <= n else PC.FP4_E4M3_16)
    # the gathers by XLA instead of the fused Pallas gathers: the same rows, so the same output bits
    assert calls[3][1] is None and calls[3][2] is None and calls[3][0] == shape
    np.testing.assert_array_equal(_bits(got), _bits(xla))
    np.testing.assert_array_equal(_bits(default), _bits(want))
    assert got.dtype == dtype
    np.testing.assert_array_equal(_bits(got), _bits(want))
    np.testing.assert_array_equal(_bits(got), _bits(kernel))
    # the relative L2 bounds of tests/test_kernels.py's sparse-attention checks (float32 1e-5, bf16 2e-2)
    g64, r64 = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(g64).all()
    assert np.linalg.norm(g64 - r64) / np.linalg.norm(r64) < (1e-5 if dtype == jnp.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fused_gathers_equal_the_plain_jax_gathers(dtype):
    """``packed_gather_gpu``: the selected rows (-1 entries, duplicates, an index past the buffer, a last block of
    rows only partly used) and the window (a wrapped ring, a base past R, a negative base read as floor mod, the
    chunk's own rows after it) equal the plain-JAX gathers + unpack bit for bit, -0.0 and never-written (all-zero)
    rows included."""
    from dsv41_jax.kernels import packed_gather_gpu as PG

    rng = np.random.default_rng(11)
    buf = _packed(rng, (2, 13, 64), PC.FP4_E4M3_16, dtype)
    vals = buf.values.at[0, 3, :4].set(jnp.asarray([0x08, 0x80, 0x88, 0x8F], jnp.uint8))  # -0.0 nibbles
    buf = dataclasses.replace(buf, values=vals.at[1, 7].set(0), scales=buf.scales.at[1, 7].set(0))  # never written
    topk = jnp.asarray([[[3, -1, 12, 3, 0], [20, 7, 7, -1, 5]], [[7, 7, -1, -1, -1], [1, 2, 3, 13, 12]]], jnp.int32)
    (want, remap), (got, remap2), direct = compiled(lambda buf, topk: (
        KN.selected_rows(buf, topk, dtype), KN.selected_rows(buf, topk, dtype, fused=True, interpret=True),
        PG.selected_rows(buf.values, buf.scales, topk.reshape(2, 10), fmt=buf.fmt, dim=64, dtype=dtype,
                         block_rows=4, interpret=True)), buf, topk)  # three programs a batch row, the last half used
    assert got.shape == (2, 10, 64) and got.dtype == dtype
    np.testing.assert_array_equal(_bits(got), _bits(want))
    np.testing.assert_array_equal(np.asarray(remap2), np.asarray(remap))
    np.testing.assert_array_equal(_bits(direct), _bits(want))
    ring = _packed(rng, (2, 6, 64), PC.FP8_UE8M0_32, jnp.float32)
    ring = dataclasses.replace(ring, values=ring.values.at[0, 2, 0].set(0x80))  # -0.0
    new = jnp.asarray(rng.normal(size=(2, 3, 64)), dtype)
    base = jnp.asarray([15, -2], jnp.int32)  # wrapped past R; a negative base, read as floor mod
    want, got, fused = compiled(lambda ring, base, new: (
        KN.window_rows(ring, base, new),
        PG.window_rows(ring.values, ring.scales, base, new, fmt=ring.fmt, ring_dtype=jnp.float32, block_rows=4,
                       interpret=True),
        KN.window_rows(ring, base, new, fused=True, interpret=True)), ring, base, new)
    assert got.shape == (2, 9, 64) and got.dtype == dtype
    np.testing.assert_array_equal(_bits(got), _bits(want))
    np.testing.assert_array_equal(_bits(fused), _bits(want))
    # rows that are not one power-of-two tile: the plain-JAX gathers (the fused kernel refuses them)
    odd = _packed(rng, (1, 5, 48), PC.FP4_E4M3_16, dtype)
    assert not PG.fits(48, PC.FP4_E4M3_16) and PG.fits(512, PC.FP4_E4M3_16) and PG.fits(512, PC.FP8_UE8M0_32)
    with pytest.raises(ValueError, match="power-of-two tile"):
        PG.selected_rows(odd.values, odd.scales, topk[:1, 0], fmt=odd.fmt, dim=48, dtype=dtype, interpret=True)
    one = topk[:1, :1]  # 5 selected rows of 5: gathered, not the whole buffer
    np.testing.assert_array_equal(_bits(KN.selected_rows(odd, one, dtype, fused=True, interpret=True)[0]),
                                  _bits(KN.selected_rows(odd, one, dtype)[0]))


def test_selected_rows_and_the_form_option():
    """The gathered rows are the buffer's unpacked rows at the clipped indices; the remapped lists point at them and
    keep every -1; an unknown form is refused; the step's options reach the kernel as tuning entries."""
    rng = np.random.default_rng(2)
    buf = _packed(rng, (2, 9, 32), PC.FP4_E4M3_16, jnp.bfloat16)
    topk = jnp.asarray([[[3, -1, 8], [12, 0, -1]], [[-1, -1, -1], [5, 5, 1]]], jnp.int32)
    rows, remap = KN.selected_rows(buf, topk, jnp.bfloat16)
    assert rows.shape == (2, 6, 32) and rows.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(remap), [[[0, -1, 2], [3, 4, -1]], [[-1, -1, -1], [3, 4, 5]]])
    full = np.asarray(PC.read(buf), np.float32)
    rows_, remap_, topk_ = np.asarray(rows, np.float32), np.asarray(remap), np.asarray(topk)  # indexed on the host
    for bi in range(2):
        for ci in range(2):
            for j in range(3):
                if topk_[bi, ci, j] >= 0:
                    np.testing.assert_array_equal(rows_[bi, remap_[bi, ci, j]], full[bi, min(int(topk_[bi, ci, j]), 8)])
    # the default: a gather form at every row count (from kernels.PACKED_GATHER_MIN_ROWS = 1), its gathers fused
    # from kernels.PACKED_FUSED_GATHER_MIN_ROWS = 32 rows
    assert [KN.packed_attention_form(r) for r in (1, 4, 31, 32, 64)] == ["gather_xla"] * 3 + ["gather"] * 2
    assert KN.packed_attention_form(1, "gather") == "gather" and KN.packed_attention_form(32, "kernel") == "kernel"
    assert KN.packed_attention_form(32, fits=False) == "kernel"  # a long chunk: more selected rows than the buffer
    assert KN.packed_attention_form(32, "gather", fits=False) == "gather"
    assert KN.packed_attention_form(32, "gather_xla") == "gather_xla" and KN.packed_attention_form(1, "gather") == \
        "gather"
    q = jnp.zeros((1, 1, 2, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="packed attention form 'dense'"):
        KN.sparse_attention(q, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 4, 32), jnp.bfloat16),
                            jnp.zeros((1, 4), jnp.int32), buf, topk[:1, :1], jnp.zeros((2,)), window=4, backend=GPU,
                            tuning={"packed_attention": "dense"})
    from dsv41_jax.inference import step as S

    assert S.attention_tuning(S.InferenceOptions()) is None
    assert S.attention_tuning(S.InferenceOptions(packed_attention="gather", attention_split_rule="wave")) == {
        "packed_attention": "gather", "split_rule": "wave"}


def test_indexer_on_packed_keys_equals_unpacked():
    """Both score kernels (the streamed block maxima and the gathered leaves) and the Reindex pool path."""
    rng = np.random.default_rng(3)
    b, t, hi, di, n, ratio, bs = 2, 3, 4, 64, 300, 2, 4
    q = jnp.asarray(rng.normal(size=(b, t, hi, di)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(b, t, hi)), jnp.float32) * hi ** -0.5
    keys = _packed(rng, (b, n, di), PC.FP4_UE8M0_32, jnp.float32)
    qpos = jnp.asarray([[599, 301, 40], [17, 599, 450]], jnp.int32)
    kw = dict(ratio=ratio, topk=12, block_size=bs, backend=GPU)

    def run(q, w, keys, qpos):
        got_sel, got_pool = KN.indexer_topk(q, w, keys, qpos, candidate_topk_blocks=9, **kw)
        want_sel, want_pool = KN.indexer_topk(q, w, PC.read(keys), qpos, candidate_topk_blocks=9, **kw)
        got2, _ = KN.indexer_topk(q, w, keys, qpos, pool=got_pool, **kw)  # Reindex: gathered pool only
        want2, _ = KN.indexer_topk(q, w, PC.read(keys), qpos, pool=want_pool, **kw)
        # the score values themselves
        vis = (qpos + 1) // ratio
        got_bs = G.score_pool(q, w, (keys.values, keys.scales), vis, g1=bs, keys_fmt=keys.fmt, keys_dtype=keys.dtype,
                              interpret=True)
        want_bs = G.score_pool(q, w, PC.read(keys), vis, g1=bs, interpret=True)
        return got_sel, got_pool, want_sel, want_pool, got2, want2, got_bs, want_bs

    got_sel, got_pool, want_sel, want_pool, got2, want2, (got_b, got_s), (want_b, want_s) = compiled(
        run, q, w, keys, qpos)
    np.testing.assert_array_equal(got_sel, want_sel)
    np.testing.assert_array_equal(got_pool, want_pool)
    assert (np.asarray(got_sel) >= 0).sum() > 0
    np.testing.assert_array_equal(got2, want2)
    # the score values themselves, bit for bit
    np.testing.assert_array_equal(_bits(got_b), _bits(want_b))
    np.testing.assert_array_equal(_bits(got_s), _bits(want_s))


def test_packed_buffer_shape_errors_name_the_tensor():
    ckv = PC.zeros((1, 5, 32), PC.FP4_E4M3_16)
    q = jnp.zeros((1, 1, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="compressed KV: packed fp4_e2m1_e4m3_16 rows of 64 values"):
        G.attention_fwd(q, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 4, 64)), jnp.zeros((1, 4), jnp.int32),
                        jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32), (ckv.values, ckv.scales),
                        jnp.zeros((1, 1, 2), jnp.int32), jnp.zeros((2,)), window=4, scale=1.0, wspan=4,
                        ckv_fmt=ckv.fmt, interpret=True)
    with pytest.raises(ValueError, match="packed_load must be one of"):
        G.score_pool(jnp.zeros((1, 1, 2, 32)), jnp.zeros((1, 1, 2)), (ckv.values, ckv.scales),
                     jnp.ones((1, 1), jnp.int32), g1=4, keys_fmt=ckv.fmt, packed_load="rows", interpret=True)


@pytest.mark.slow  # two interpret-mode compiles of a Full layer's attention (indexer + sparse attention): ~10 s
@pytest.mark.parametrize("form", ["kernel", "gather"])
def test_decode_attention_step_reads_the_packed_cache_like_the_unpacked_one(monkeypatch, form):
    """A decode step's attention site of the HSI candidate source (emits its compressed entry, scores the packed
    keys, attends over the packed window ring and compressed KV) with the GPU kernels reading the packed cache
    directly == the same step unpacking the cache first (the path the reference / TPU backends take): output,
    top-k, HSI pool and the updated cache, bit for bit. ``form``: the attention's packed-cache form — "kernel" reads
    the ring and the KV packed, "gather" unpacks the ring and only the selected KV rows by the fused Pallas gathers
    (so nothing is unpacked by ``packed_cache.unpack`` either; its plain-JAX twin "gather_xla" is checked against it
    in ``test_gather_form_equals_the_packed_kernel_and_unpack_then_kernel``); the indexer reads its keys packed in
    both."""
    import functools

    from dsv41_jax.inference import step as S
    from dsv41_jax.inference.cache import init_cache
    from dsv41_jax.inference.weights import host_random_params
    from dsv41_jax.train.testing import every_role_config

    config = every_role_config()
    layer = config.plan[config.candidate_source_layer_id]
    assert layer.mode == "full" and layer.candidate_source
    params = host_random_params(config, 0, std=0.1)["layers"][layer.index]["attn"]
    b, rng = 2, np.random.default_rng(0)
    pack = jax.jit(PC.pack, static_argnums=1)

    def fill(buf):  # random contents in every packed buffer (the rows past each slot's length stay invisible)
        if not isinstance(buf, PC.PackedRows):
            return buf
        v, s = pack(jnp.asarray(rng.normal(size=buf.shape) * 0.5, jnp.float32), buf.fmt)
        return PC.PackedRows(v, s, buf.fmt, buf.dim, buf.dtype)

    cache = jax.tree.map(fill, init_cache(config, b, 64, packed=True), is_leaf=lambda x: isinstance(x, PC.PackedRows))
    cache["length"] = jnp.asarray([40, 57], jnp.int32)
    x = jnp.asarray(rng.normal(size=(b, 1, config.hidden_size)), jnp.float32)
    opts = S.InferenceOptions(kernel_backend=GPU, compiler_options=S.FAST_COMPILE, packed_cache_kernels=True,
                              packed_attention=form)

    @functools.partial(jax.jit, static_argnums=0)
    def site(_direct, p, x, cache):  # the flag keys the compile: the patched dispatch is read while tracing
        pos0 = cache["length"]
        y, cache, shared = S.attention_step(p, x, layer, pos0[:, None], pos0, jnp.ones((b,), jnp.int32), cache,
                                            S._Shared(), config, S._rope(config), opts, True, emit=True)
        return y, shared.topk, shared.pool, cache

    unpacked_while_tracing = []
    unpack = PC.unpack
    monkeypatch.setattr(PC, "unpack", lambda v, s, fmt, dtype: unpacked_while_tracing.append(fmt) or
                        unpack(v, s, fmt, dtype))
    assert KN.reads_packed_cache(GPU)
    direct = site(True, params, x, cache)
    # "kernel": window ring, KV and keys all go packed to the kernels; "gather": the keys do, and the ring and the
    # selected KV rows go packed to the fused gathers
    assert unpacked_while_tracing == []
    unpacked_while_tracing.clear()
    monkeypatch.setattr(KN, "reads_packed_cache", lambda backend="auto": False)
    unpacked = site(False, params, x, cache)
    assert sorted(unpacked_while_tracing) == sorted([PC.FP8_UE8M0_32, PC.FP4_E4M3_16, PC.FP4_UE8M0_32])
    assert (np.asarray(direct[1]) >= 0).any()
    for a, b_ in zip(jax.tree.leaves(direct), jax.tree.leaves(unpacked)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))


def test_packed_kernels_lower_to_triton_for_cuda():
    """The in-register unpack (byte loads, shifts, bit casts) is accepted by Pallas' Triton lowering: the decode
    attention over a packed ring + packed compressed KV and the indexer over packed keys lower for CUDA from this
    CPU-only process (cross-platform export; nothing is compiled to PTX or run here)."""
    from jax import export

    sds = jax.ShapeDtypeStruct
    b, h, d, n, w = 1, 16, 64, 64, 16
    ring = PC.PackedRows(sds((b, w, d), jnp.uint8), sds((b, w, d // 32), jnp.uint8), PC.FP8_UE8M0_32, d, "bfloat16")
    ckv = PC.PackedRows(sds((b, n, d // 2), jnp.uint8), sds((b, n, d // 16), jnp.uint8), PC.FP4_E4M3_16, d,
                        "bfloat16")
    keys = PC.PackedRows(sds((b, n, d // 2), jnp.uint8), sds((b, n, d // 32), jnp.uint8), PC.FP4_UE8M0_32, d,
                         "bfloat16")

    def decode(q, pos, new, wpos, ring, ckv, topk, sink, qi, wi, keys):
        out = KN.sparse_attention(q, pos, new, wpos, ckv, topk, sink, window=w, backend="pallas_gpu",
                                  win_ring=(ring, pos[:, 0]), tuning={"packed_attention": "kernel"})
        sel, pool = KN.indexer_topk(qi, wi, keys, pos, ratio=1, topk=16, block_size=8, candidate_topk_blocks=4,
                                    backend="pallas_gpu")
        return out, sel, pool

    args = (sds((b, 1, h, d), jnp.bfloat16), sds((b, 1), jnp.int32), sds((b, 1, d), jnp.bfloat16),
            sds((b, w + 1), jnp.int32), ring, ckv, sds((b, 1, 16), jnp.int32), sds((h,), jnp.float32),
            sds((b, 1, 4, d), jnp.bfloat16), sds((b, 1, 4), jnp.float32), keys)
    triton = "__gpu$xla.gpu.triton"
    ex = export.export(jax.jit(decode), platforms=["cuda"],
                       disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(*args)
    text = ex.mlir_module()
    assert "csa2_sparse_attention_fwd" in text and "indexer_score_pool" in text and "indexer_gather_score" in text
    # the gather form's fused gathers (selected rows, window) lower too
    gathered = export.export(jax.jit(lambda q, pos, new, wpos, ring, ckv, topk, sink: KN.sparse_attention(
        q, pos, new, wpos, ckv, topk, sink, window=w, backend="pallas_gpu", win_ring=(ring, pos[:, 0]),
        tuning={"packed_attention": "gather"})), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(*args[:8]).mlir_module()
    assert "packed_selected_rows" in gathered and "packed_window_rows" in gathered
    assert "tensor<1x16x64xui8>" in text and "tensor<1x64x32xui8>" in text  # the packed buffers go in as bytes
