"""The released checkpoint format: exact FP8 / FP4 / Engram dequantisation pinned by hand-built bytes (these fail if
the nibble order or a scale is wrong), a release-format writer round trip (bit-exact against an independent
reference and equal logits through the HF path), both namings, the quantised leaf type, sharded == unsharded on 8
fake CPU devices, clear errors for bad input, and ``dsv41 convert`` / ``dsv41 inspect``."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dsv41_jax
from dsv41_jax import CheckpointError, ForwardOptions
from dsv41_jax.checkpoint import names as N
from dsv41_jax.checkpoint import quantized as QZ
from dsv41_jax.checkpoint import safetensors_io as stio
from dsv41_jax.checkpoint.release import ReleaseCheckpoint, load_safetensors_checkpoint
from dsv41_jax.checkpoint.release_writer import write_release_checkpoint
from dsv41_jax.model.model import default_hasher


def _e4m3(byte: int) -> float:
    """e4m3fn byte -> value, from the format's definition (independent of ml_dtypes)."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 0x7
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


# ------------------------------------------------------------------------------------------------------------------
# formats, from hand-built bytes
# ------------------------------------------------------------------------------------------------------------------

def test_fp4_nibble_order_and_e2m1_table():
    packed = np.zeros((2, 16), np.uint8)  # 2 rows x 32 values
    packed[0, 0] = 0x21  # element 0 = code 1 (+0.5) in the LOW nibble, element 1 = code 2 (+1.0) in the high nibble
    packed[0, 1] = 0xF9  # element 2 = code 9 (-0.5), element 3 = code 15 (-6.0)
    packed[1, 15] = 0x7C  # element 30 = code 12 (-2.0), element 31 = code 7 (+6.0)
    scale = np.array([[128], [125]], np.uint8).view(ml_dtypes.float8_e8m0fnu)  # 2^1, 2^-2
    want = np.zeros((2, 32), np.float32)
    want[0, :4] = [1.0, 2.0, -1.0, -12.0]
    want[1, 30:] = [-0.5, 1.5]
    np.testing.assert_array_equal(QZ.dequant_fp4_rows(packed.view(np.int8), scale), want)
    qt = QZ.QuantizedTensor(jnp.asarray(packed), jnp.asarray(scale.view(np.uint8)), N.FP4_ROWS, (2, 32))
    np.testing.assert_array_equal(np.asarray(qt.dequantize(jnp.float32)), want)
    # the quantiser packs the same way
    codes, s = QZ.quantize_fp4_rows(want)
    np.testing.assert_array_equal(QZ.dequant_fp4_rows(codes, s), want)
    assert codes[0, 0] == 0x21 and codes[0, 1] == 0xF9


def test_fp8_block_and_engram_row_scales():
    v = np.full((33, 40), 0x38, np.uint8)  # 1.0 everywhere; 33 x 40 -> scale blocks [2, 2]
    v[32, 39] = 0xC4  # -3.0
    v[0, 0] = 0x01  # 2^-9 (smallest subnormal)
    s = np.array([[127, 130], [120, 100]], np.uint8)  # 1, 8 / 2^-7, 2^-27
    w = QZ.dequant_fp8_block(v.view(ml_dtypes.float8_e4m3fn), s.view(ml_dtypes.float8_e8m0fnu))
    assert w[0, 0] == 2.0 ** -9 and w[0, 32] == 8.0 and w[32, 0] == 2.0 ** -7 and w[32, 39] == -3.0 * 2.0 ** -27
    # rows taken from the middle of a block use that block's scale
    w2 = QZ.dequant_fp8_block(v[31:33].view(ml_dtypes.float8_e4m3fn), s.view(ml_dtypes.float8_e8m0fnu), row0=31)
    np.testing.assert_array_equal(w2, w[31:33])
    qt = QZ.QuantizedTensor(jnp.asarray(v), jnp.asarray(s), N.FP8_BLOCK, (33, 40))
    np.testing.assert_array_equal(np.asarray(qt.dequantize()), w)  # exact on device, subnormals included
    # Engram: one scale per 32 values of a row
    table = np.array([[0x38] * 32 + [0x40] * 32, [0xB8] * 64], np.uint8)  # 1.0 / 2.0 / -1.0
    scale = np.array([[130, 126], [127, 133]], np.uint8)
    got = QZ.dequant_engram_rows(table, scale.view(ml_dtypes.float8_e8m0fnu))
    np.testing.assert_array_equal(got[:, [0, 31, 32, 63]], [[8, 8, 1, 1], [-1, -1, -64, -64]])


# ------------------------------------------------------------------------------------------------------------------
# a release-format checkpoint of a small model
# ------------------------------------------------------------------------------------------------------------------

def _config():
    from dsv41_jax.train.testing import small_config

    # 6 layers with every layer role; vocabulary, heads and output groups that 8 devices divide
    return small_config().replace(vocab_size=264, num_attention_heads=8, o_groups=8)


# session scope (read-only for its tests): a shuffled order interleaves modules, and a module-scoped fixture is
# then built again each time its module comes back
@pytest.fixture(scope="session")
def release(tmp_path_factory):
    cfg = _config()
    params = dsv41_jax.init_params(cfg, jax.random.PRNGKey(3), std=0.1)
    # perturb the constants the init leaves at 0 / 1 so every path is exercised
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(4), len(leaves))
    leaves = [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    params = jax.tree.unflatten(treedef, leaves)
    d = str(tmp_path_factory.mktemp("release") / "ckpt")
    ref = write_release_checkpoint(d, params, cfg, n_shards=3)
    return cfg, params, ref, d


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_release_layout_as_published(release):
    cfg, _, _, d = release
    files = stio.SafetensorsDir(d)
    assert len(files.files) >= 3 and os.path.exists(os.path.join(d, stio.INDEX_FILE))
    t = files.tensors
    assert t["embed.weight"].dtype == "BF16" and t["head.weight"].dtype == "BF16"
    assert t["layers.2.attn.wq_a.weight"].dtype == "F8_E4M3"
    assert t["layers.2.attn.wq_a.scale"].dtype == "F8_E8M0" and t["layers.2.attn.wq_a.scale"].shape == (1, 2)
    e = t["layers.0.ffn.experts.5.w2.weight"]
    assert e.dtype == "I8" and e.shape == (cfg.hidden_size, cfg.moe_intermediate_size // 2)
    assert t["layers.0.ffn.experts.5.w2.scale"].shape == (cfg.hidden_size, cfg.moe_intermediate_size // 32)
    assert t["layers.1.engram.embed.weight"].dtype == "F8_E4M3"
    assert t["layers.1.engram.embed.scale"].shape == (cfg.engram_num_embeddings[0], cfg.engram_head_dim // 32)
    assert t["layers.0.hc_attn_fn"].dtype == "F32" and t["layers.0.ffn.gate.bias"].dtype == "F32"
    assert t["layers.2.attn.compressor.wkv.weight"].dtype == "BF16"
    raw = json.load(open(os.path.join(d, "config.json")))
    assert raw["quantization_config"]["weight_block_size"] == [32, 32] and raw["expert_dtype"] == "fp4"


@pytest.mark.slow
def test_release_load_is_exact_and_matches_the_hf_path(release, tmp_path):
    cfg, params, ref, d = release
    c, p, rep = load_safetensors_checkpoint(d, config=cfg, return_report=True)
    assert rep.naming == "release" and rep.formats[N.FP4_ROWS] > 0 and rep.formats[N.ENGRAM_ROWS] == 1
    assert _leaves_equal(p, ref)  # bit-exact against the independent reference
    _, pd = load_safetensors_checkpoint(d, config=cfg, dequantize_on="device")  # stored bytes dequantised by XLA
    assert _leaves_equal(pd, ref)
    # close to the unquantised weights (FP4: < 1/4 of its block scale per value, i.e. <= 1/6 of the block max)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(params)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= 0.17 * np.abs(b).max() + 1e-6
    # the dequantised values through the HF path (float32 safetensors, HF names) give identical logits
    from dsv41_jax.checkpoint.hf import save_hf_checkpoint

    save_hf_checkpoint(str(tmp_path / "hf"), jax.tree.map(np.asarray, ref), cfg)
    c2, p2, rep2 = load_safetensors_checkpoint(str(tmp_path / "hf"), config=cfg, return_report=True)
    assert rep2.naming == "hf" and _leaves_equal(p, p2)
    toks = np.random.RandomState(0).randint(3, 259, (1, 24)).astype(np.int32)
    from dsv41_jax.train.testing import small_config

    eids = default_hasher(small_config()).row_ids(toks)  # row ids depend on the byte tokens only
    fwd = jax.jit(lambda pp: dsv41_jax.forward(pp, toks, config=cfg, engram_ids=eids,
                                               options=ForwardOptions(quant_sim=False)))
    np.testing.assert_array_equal(np.asarray(fwd(p)), np.asarray(fwd(p2)))


def test_engram_scales_applied(release):
    cfg, _, _, d = release
    files = stio.SafetensorsDir(d)
    v = files.read("layers.1.engram.embed.weight").view(np.uint8)
    s = files.read("layers.1.engram.embed.scale").view(np.uint8)
    assert len(np.unique(s)) > 1 and (s != 127).any()  # non-unit scales: ignoring them would be caught
    _, p = load_safetensors_checkpoint(d, config=cfg)
    table = np.asarray(p["layers"][1]["engram"]["embed"])
    for r in (0, 7, table.shape[0] - 1):
        for c in (0, 5, 31):
            assert table[r, c] == _e4m3(int(v[r, c])) * 2.0 ** (int(s[r, c // 32]) - 127)


def test_bf16_load_rounds_once(release):
    cfg, _, ref, d = release
    _, p = load_safetensors_checkpoint(d, config=cfg, dtype=jnp.bfloat16)
    want = jax.tree.map(lambda r, x: r.astype(np.asarray(x).dtype), ref, p)
    assert _leaves_equal(p, want)
    assert p["layers"][0]["hc_attn"]["fn"].dtype == jnp.float32 and p["embed"].dtype == jnp.bfloat16


def test_hf_naming_with_quantised_tensors(release, tmp_path):
    """The same stored tensors under HF names (and HF-transformers spellings) load identically."""
    cfg, _, ref, d = release
    files = stio.SafetensorsDir(d)
    renamed = {}
    for name in files.names():
        hf = N.to_hf(name).replace(".attn.", ".self_attn.").replace(".scale", ".weight_scale_inv")
        renamed[hf] = files.read(name)
    out = tmp_path / "hfq"
    out.mkdir()
    stio.save(str(out / "model.safetensors"), renamed)
    shutil.copy(os.path.join(d, "config.json"), out / "config.json")
    _, p, rep = load_safetensors_checkpoint(str(out), config=cfg, return_report=True)
    assert rep.naming == "hf" and _leaves_equal(p, ref)


def test_keep_quantized_leaves(release):
    cfg, _, ref, d = release
    _, p = load_safetensors_checkpoint(d, config=cfg, keep_quantized=True)
    w = p["layers"][2]["attn"]["wq_a"]
    e = p["layers"][0]["ffn"]["experts"]["w1"]
    t = p["layers"][1]["engram"]["embed"]
    assert isinstance(w, QZ.QuantizedTensor) and w.fmt == N.FP8_BLOCK and w.values.dtype == jnp.uint8
    assert isinstance(e, QZ.QuantizedTensor) and e.fmt == N.FP4_ROWS and e.values.shape[-1] * 2 == e.shape[-1]
    assert isinstance(t, QZ.QuantizedTensor) and t.fmt == N.ENGRAM_ROWS
    deq = jax.tree.map(lambda x: x.dequantize(jnp.float32) if isinstance(x, QZ.QuantizedTensor) else x, p,
                       is_leaf=lambda x: isinstance(x, QZ.QuantizedTensor))
    assert _leaves_equal(deq, ref)
    assert e.nbytes < e.values.size * 2  # ~half a byte per weight + scales
    # the FP4 experts' largest scale byte, noted on the host while loading (the grouped FP4 GEMM picks its decode by
    # it); the other formats leave it unknown
    fp4 = [x for x in jax.tree.leaves(p, is_leaf=lambda x: isinstance(x, QZ.QuantizedTensor))
           if isinstance(x, QZ.QuantizedTensor) and x.fmt == N.FP4_ROWS]
    assert fp4 and all(x.scale_max == int(np.asarray(x.scales).max()) for x in fp4)
    assert w.scale_max is None and t.scale_max is None


@pytest.mark.slow
def test_sharded_load_equals_unsharded(release):
    from dsv41_jax import parallel as par

    cfg, _, ref, d = release
    mesh = par.make_mesh("data=2,expert=2,tensor=2")
    ckpt = ReleaseCheckpoint(d, config=cfg)
    _, p = ckpt.load(jnp.float32, mesh=mesh, rules="tp")
    _, pd = ReleaseCheckpoint(d, config=cfg).load(jnp.bfloat16, mesh=mesh, rules="tp", dequantize_on="device")
    ref_bf16 = jax.tree.map(lambda r, x: r.astype(np.asarray(x).dtype), ref, par.unpad_params(pd, cfg))
    assert _leaves_equal(par.unpad_params(pd, cfg), ref_bf16)
    want_sh = par.param_shardings(cfg, mesh, "tp")
    for x, sh in zip(jax.tree.leaves(p), jax.tree.leaves(want_sh, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))):
        assert x.sharding.is_equivalent_to(sh, x.ndim)
    assert _leaves_equal(par.unpad_params(p, cfg), ref)
    table = p["layers"][1]["engram"]["embed"]
    assert table.shape[0] == par.padded_rows(cfg.engram_num_embeddings[0], mesh, "tp")
    assert not np.asarray(table)[cfg.engram_num_embeddings[0]:].any()  # padding rows are zero
    # with experts over all 8 devices (nothing split along columns) every stored byte is read exactly once
    mesh8 = par.make_mesh("expert=8")
    for on in ("device", "host"):
        ck = ReleaseCheckpoint(d, config=cfg)
        _, p8 = ck.load(jnp.float32, mesh=mesh8, rules="tp", dequantize_on=on)
        assert ck.report.bytes_read == sum(i.nbytes for i in ck.files.tensors.values())
        assert _leaves_equal(par.unpad_params(p8, cfg), ref)


@pytest.mark.slow  # many small slices: one compile per slice shape
def test_loads_streamed_in_slices_equal_whole_blocks(release, monkeypatch):
    """Blocks larger than the slice size are read, sent and written into the device block slice by slice (64 MiB by
    default; 16 KiB here, so most parameters of the tiny model take several slices, FP8 slices a multiple of the
    32-row scale block): the result is bit-identical and every stored byte is still read exactly once."""
    from dsv41_jax import parallel as par
    from dsv41_jax.checkpoint import release as R

    cfg, _, ref, d = release
    monkeypatch.setattr(R, "CHUNK_BYTES", 16 << 10)
    total = sum(i.nbytes for i in stio.SafetensorsDir(d).tensors.values())
    for on in ("device", "host"):
        ck = ReleaseCheckpoint(d, config=cfg)
        _, p = ck.load(jnp.float32, dequantize_on=on)
        assert _leaves_equal(p, ref) and ck.report.bytes_read == total
    ck = ReleaseCheckpoint(d, config=cfg)
    _, q = ck.load(jnp.float32, keep_quantized=True)
    deq = jax.tree.map(lambda x: x.dequantize(jnp.float32) if isinstance(x, QZ.QuantizedTensor) else x, q,
                       is_leaf=lambda x: isinstance(x, QZ.QuantizedTensor))
    assert _leaves_equal(deq, ref) and ck.report.bytes_read == total
    mesh = par.make_mesh("expert=2,tensor=4")
    _, ps = ReleaseCheckpoint(d, config=cfg).load(jnp.float32, mesh=mesh, rules="tp")
    assert _leaves_equal(par.unpad_params(ps, cfg), ref)


def _mid_config():
    from dsv41_jax.train.testing import small_config

    # every layer role of the 6-layer twin at 4x its width: FP8 weights whose rows end mid scale block (q_lora 80,
    # o_lora 48), four FP4 scale groups per expert row (moe_intermediate 128), 16 experts, an Engram table of two
    # scale groups per row whose row count is no multiple of anything
    return small_config().replace(name="mid6", vocab_size=264, hidden_size=256, num_attention_heads=8, head_dim=128,
                                  q_lora_rank=80, qk_rope_head_dim=32, o_groups=4, o_lora_rank=48,
                                  n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                                  index_n_heads=8, index_head_dim=64, engram_head_dim=64,
                                  engram_num_embeddings=(1030,))


def _e2m1(code: int) -> float:
    """e2m1 4-bit code -> value, from the format's definition (sign, 2 exponent bits, 1 mantissa bit)."""
    sign = -1.0 if code & 0x8 else 1.0
    e, m = (code >> 1) & 0x3, code & 0x1
    return sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


@pytest.mark.slow  # a 10M-parameter model quantised, written, loaded twice and run once
def test_mid_size_release_load_matches_the_hf_path(tmp_path):
    from dsv41_jax.checkpoint.hf import save_hf_checkpoint
    from dsv41_jax.model.params import is_spec, param_specs
    from dsv41_jax.train.testing import small_config

    cfg = _mid_config()
    rng = np.random.default_rng(7)
    params = jax.tree.map(lambda s: (rng.standard_normal(s.shape) * 0.1).astype(np.float32), param_specs(cfg),
                          is_leaf=is_spec)
    d = str(tmp_path / "release")
    ref = write_release_checkpoint(d, params, cfg, n_shards=4)
    _, p, rep = load_safetensors_checkpoint(d, config=cfg, return_report=True)
    assert rep.naming == "release" and rep.formats[N.FP4_ROWS] == 6 * 3 and rep.formats[N.ENGRAM_ROWS] == 1
    assert _leaves_equal(p, ref)  # bit-exact against the writer's independent reference

    files = stio.SafetensorsDir(d)
    # FP4 nibble order, from the bytes: element 2j is the low nibble, 2j+1 the high one
    v = files.read("layers.3.ffn.experts.11.w2.weight").view(np.uint8)
    s = files.read("layers.3.ffn.experts.11.w2.scale").view(np.uint8)
    got = np.asarray(p["layers"][3]["ffn"]["experts"]["w2"][11])
    rows, byte_cols = np.nonzero(((v & 0xF) != (v >> 4)) & (v & 0x7 != 0) & (v >> 4 & 0x7 != 0))
    assert len(rows) > 100  # bytes whose two values differ: a swapped nibble order would be caught
    for r, j in list(zip(rows, byte_cols))[::max(1, len(rows) // 40)]:
        scale = 2.0 ** (int(s[r, (2 * j) // 32]) - 127)
        assert got[r, 2 * j] == _e2m1(int(v[r, j]) & 0xF) * scale, (r, j)
        assert got[r, 2 * j + 1] == _e2m1(int(v[r, j]) >> 4) * scale, (r, j)
    # Engram: one e8m0 scale per 32 values of a row, applied (both scale groups, first and last rows)
    v = files.read("layers.1.engram.embed.weight").view(np.uint8)
    s = files.read("layers.1.engram.embed.scale").view(np.uint8)
    assert s.shape == (1030, 2) and len(np.unique(s)) > 2
    table = np.asarray(p["layers"][1]["engram"]["embed"])
    for r in (0, 513, 1029):
        for c in (0, 31, 32, 63):
            assert table[r, c] == _e4m3(int(v[r, c])) * 2.0 ** (int(s[r, c // 32]) - 127)

    # the dequantised values through the HF path (float32 safetensors, HF names) give identical logits
    save_hf_checkpoint(str(tmp_path / "hf"), jax.tree.map(np.asarray, ref), cfg)
    _, p2, rep2 = load_safetensors_checkpoint(str(tmp_path / "hf"), config=cfg, return_report=True)
    assert rep2.naming == "hf" and _leaves_equal(p, p2)
    toks = np.random.RandomState(1).randint(3, 259, (2, 24)).astype(np.int32)
    eids = default_hasher(small_config()).row_ids(toks)
    fwd = jax.jit(lambda pp: dsv41_jax.forward(pp, toks, config=cfg, engram_ids=eids,
                                               options=ForwardOptions(quant_sim=False)))
    logits = np.asarray(fwd(p))
    assert np.isfinite(logits).all() and logits.std() > 0
    np.testing.assert_array_equal(logits, np.asarray(fwd(p2)))


# ------------------------------------------------------------------------------------------------------------------
# skipped tensors and bad input
# ------------------------------------------------------------------------------------------------------------------

@pytest.fixture
def ckpt_copy(release, tmp_path):
    cfg, _, _, d = release
    dst = tmp_path / "copy"
    shutil.copytree(d, dst)
    return cfg, dst


def _add_shard(directory, tensors: dict, fname: str = "model-extra.safetensors"):
    stio.save(str(directory / fname), tensors)
    index = json.load(open(directory / stio.INDEX_FILE))
    index["weight_map"].update({k: fname for k in tensors})
    json.dump(index, open(directory / stio.INDEX_FILE, "w"))


def test_dspark_and_vision_tensors_are_skipped_and_listed(ckpt_copy):
    cfg, d = ckpt_copy
    f8 = np.zeros((32, 96), ml_dtypes.float8_e4m3fn)
    _add_shard(d, {"mtp.0.main_proj.weight": f8, "mtp.0.main_proj.scale": np.zeros((1, 3), ml_dtypes.float8_e8m0fnu),
                   "mtp.2.head.weight": np.zeros((4, 4), ml_dtypes.bfloat16),
                   "vision.blocks.0.attn.qkv.weight": np.zeros((4, 4), ml_dtypes.bfloat16),
                   "image_newline": np.zeros(4, ml_dtypes.bfloat16),
                   "layers.0.ffn.gate.bias_vl": np.zeros(cfg.n_routed_experts, np.float32)})
    _, _, rep = load_safetensors_checkpoint(str(d), config=cfg, return_report=True)
    assert rep.skipped["mtp.0.main_proj.weight"] == N.DSPARK_REASON
    assert "vision" in rep.skipped["vision.blocks.0.attn.qkv.weight"]
    assert "tied" in rep.skipped["mtp.2.head.weight"] and "image" in rep.skipped["image_newline"]
    assert "layers.0.ffn.gate.bias_vl" in rep.skipped
    _add_shard(d, {"layers.0.attn.bogus.weight": np.zeros(3, np.float32)}, "model-bogus.safetensors")
    with pytest.raises(CheckpointError, match=r"unknown tensors: \[layers.0.attn.bogus.weight \(model-bogus"):
        load_safetensors_checkpoint(str(d), config=cfg)


def test_truncated_and_absent_shards(ckpt_copy):
    cfg, d = ckpt_copy
    shard = sorted(p for p in os.listdir(d) if p.startswith("model-0"))[1]
    with open(d / shard, "r+b") as f:
        f.truncate(os.path.getsize(d / shard) - 100)
    with pytest.raises(CheckpointError, match=rf"{shard}: truncated file: tensor \S+ ends at byte"):
        load_safetensors_checkpoint(str(d), config=cfg)
    os.remove(d / shard)
    with pytest.raises(CheckpointError, match=rf"shard {shard} is listed in model.safetensors.index.json .* absent"):
        load_safetensors_checkpoint(str(d), config=cfg)


def _rewrite(d, shard_of: str, fn):
    """Rewrite the shard holding tensor ``shard_of`` with ``fn(dict) -> dict``."""
    files = stio.SafetensorsDir(str(d))
    path = files.tensors[shard_of].file
    tensors = {n: files.read(n) for n, i in files.tensors.items() if i.file == path}
    stio.save(path, fn(tensors))


def test_scale_of_the_wrong_shape(ckpt_copy):
    cfg, d = ckpt_copy
    _rewrite(d, "layers.2.attn.wq_b.scale", lambda t: {**t, "layers.2.attn.wq_b.scale": t["layers.2.attn.wq_b.scale"][:8]})
    with pytest.raises(CheckpointError, match=r"scale layers.2.attn.wq_b.scale has shape \(8, 1\), expected \(16, 1\) "
                                              r"for layers.2.attn.wq_b.weight \(512, 32\) \(fp8_e4m3_block; in model-0"):
        load_safetensors_checkpoint(str(d), config=cfg)


def test_missing_scale(ckpt_copy):
    cfg, d = ckpt_copy

    def drop(t):
        t = dict(t)
        t.pop("layers.3.ffn.experts.1.w3.scale")
        return t
    _rewrite(d, "layers.3.ffn.experts.1.w3.scale", drop)
    index = json.load(open(d / stio.INDEX_FILE))
    index["weight_map"].pop("layers.3.ffn.experts.1.w3.scale")
    json.dump(index, open(d / stio.INDEX_FILE, "w"))
    with pytest.raises(CheckpointError, match=r"quantised tensor layers.3.ffn.experts.1.w3.weight \(I8, in model-\S+\) "
                                              r"has no layers.3.ffn.experts.1.w3.scale"):
        load_safetensors_checkpoint(str(d), config=cfg)


def test_fp8_without_quantization_config(ckpt_copy):
    cfg, d = ckpt_copy
    raw = json.load(open(d / "config.json"))
    raw.pop("quantization_config")
    json.dump(raw, open(d / "config.json", "w"))
    with pytest.raises(CheckpointError, match=r"tensor layers.0.attn.wq_a.weight is stored F8_E4M3 \(in model-\S+\) but "
                                              r"config.json has no quantization_config"):
        load_safetensors_checkpoint(str(d), config=cfg)


def test_config_that_disagrees_with_the_tensors(ckpt_copy):
    cfg, d = ckpt_copy
    with pytest.raises(CheckpointError, match=r"tensor layers.0.attn.wq_a.weight has shape \(32, 64\) \(F8_E4M3\), "
                                              r"expected \(48, 64\) for logical \(48, 64\) from the config \(in model-"):
        load_safetensors_checkpoint(str(d), config=cfg.replace(q_lora_rank=48))
    with pytest.raises(CheckpointError, match=r"missing tensor layers.6.attn_norm.weight .*\n(.|\n)*the checkpoint has "
                                              r"layers 0-5 but the config says num_hidden_layers=7"):
        load_safetensors_checkpoint(str(d), config=cfg.replace(
            num_hidden_layers=7, compress_ratios=(0, 0, 2, 2, 1, 1, 1)))


# ------------------------------------------------------------------------------------------------------------------
# dsv41 convert / inspect
# ------------------------------------------------------------------------------------------------------------------

def test_convert_is_verified_atomic_and_resumable(release, tmp_path, monkeypatch, capsys):
    from dsv41_jax.checkpoint import convert as conv
    from dsv41_jax.checkpoint.release import ReleaseCheckpoint as RC
    from dsv41_jax.cli import main

    cfg, _, ref, d = release
    dst = tmp_path / "orbax"
    monkeypatch.setattr(conv, "STAGE_BLOCK_BYTES", 4096)  # stage parameters in many row blocks
    calls = {"n": 0}
    real = RC.read_block

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 200:
            raise KeyboardInterrupt  # interrupted mid-way
        return real(self, *a, **k)

    monkeypatch.setattr(RC, "read_block", flaky)
    with pytest.raises(KeyboardInterrupt):
        conv.convert(d, str(dst), dtype="float32", config=cfg, log=lambda s: None)
    assert not dst.exists()  # nothing that loads at DST
    with pytest.raises(CheckpointError):
        dsv41_jax.load_checkpoint(str(dst))
    monkeypatch.setattr(RC, "read_block", real)
    lines = []
    summary = conv.convert(d, str(dst), dtype="float32", config=cfg, log=lines.append)
    assert 0 < summary["resumed"] < len(jax.tree.leaves(ref)) and not (tmp_path / "orbax.tmp-convert").exists()
    assert any("GiB" in s and "tensors]" in s for s in lines)
    c, p = dsv41_jax.load_checkpoint(str(dst))
    assert _leaves_equal(p, ref)
    marker = json.load(open(dst / "dsv41_export.json"))
    assert marker["naming"] == "release" and len(marker["checksums"]) == len(jax.tree.leaves(ref))
    # inspect
    assert main(["inspect", d]) == 0
    out = capsys.readouterr().out
    assert "naming: release" in out and "| F8_E8M0 |" in out and "routed experts" in out and "matches" in out
    assert main(["inspect", d, "--config", "tiny"]) == 0
    assert "does NOT match the given config" in capsys.readouterr().out
