"""The generation engine: cache accounting, batched generation (determinism, seeds, stop tokens, limits,
streaming), bad input, sampling filters, and the ``dsv41 generate`` command."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import Engine, load_config
from dsv41_jax.cli import main
from dsv41_jax.inference import (FAST_COMPILE, EngineError, InferenceOptions, Request, cache_footprint, decode_step,
                                 init_cache)
from dsv41_jax.inference.cache import abstract_cache, tree_bytes, visible_state
from dsv41_jax.inference.decode import _decode_opts, decode_chain_program
from dsv41_jax.inference.prefill import DEFAULT_PREFILL_CHUNK, PrefillError, default_prefill_chunk
from dsv41_jax.inference.sampling import SamplingError, SamplingParams, filter_logits, sample, sampler_for
from dsv41_jax.inference.weights import host_random_params
from dsv41_jax.tokenizer import ByteTokenizer
from dsv41_jax.train.testing import every_role_config

# One xdist worker runs this module's tests (tests/conftest.py): they share the engine (_engine), built once instead of
# once in each worker
pytestmark = pytest.mark.xdist_group("test_inference_engine")

MAX_LEN = 40


def test_cache_bytes_per_token_reproduce_the_release():
    flash = load_config("flash")
    rel = cache_footprint(flash, "release")
    assert rel.entries_per_token == 2.5  # three ratio-2 sources + one ratio-1 source
    assert all((kv, k) == (288, 68) for _, kv, k in rel.per_source.values())  # FP4 main / FP4 indexer K + scales
    assert rel.per_token == 890.0
    assert cache_footprint(flash, "bfloat16").per_token == 2.5 * (512 + 128) * 2  # 3200 B
    assert cache_footprint(flash, "float32").per_token == 2.5 * (512 + 128) * 4  # 6400 B
    # allocated bytes = what init_cache really holds (rings, partial groups, lengths; no Engram history there)
    tiny = load_config("tiny")
    for dtype in ("float32", "bfloat16"):
        fp = cache_footprint(tiny, dtype, batch=3, max_len=101)
        held = tree_bytes(abstract_cache(tiny, 3, 101, jnp.dtype(dtype)))
        engram = 3 * (tiny.engram_max_ngram_size - 1) * 4  # kept on the host with the hasher
        assert fp.allocated == held + engram
    # and it grows linearly with the context
    a = cache_footprint(flash, "release", batch=1, max_len=1 << 16).allocated
    b = cache_footprint(flash, "release", batch=1, max_len=1 << 17).allocated
    assert b - a == 890 * (1 << 16)


@functools.lru_cache(maxsize=None)
def _engine():
    config = every_role_config(quant_sim=False)
    params = host_random_params(config, 3, std=0.1)
    opts = InferenceOptions(compiler_options=FAST_COMPILE)
    return Engine(config, params, max_batch=3, max_len=MAX_LEN, tokenizer=ByteTokenizer(), prefill_chunk=16,
                  options=opts)


def _prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


def test_generation_is_deterministic_streamed_and_batch_independent():
    eng = _engine()
    prompts = [_prompt(5, 0), _prompt(23, 1), "Hi there"]
    streamed = {i: [] for i in range(3)}
    a = eng.generate(prompts, max_new_tokens=6, stop_tokens=(), on_token=lambda i, t: streamed[i].append(t))
    b = eng.generate(prompts, max_new_tokens=6, stop_tokens=())
    for i in range(3):
        assert a[i].ok and a[i].finish_reason == "length" and len(a[i].tokens) == 6
        assert a[i].tokens == b[i].tokens == streamed[i]  # greedy is deterministic; the stream is the result
    assert a[2].prompt_len == len("Hi there") + 1 and a[2].text is not None  # text prompts use the tokenizer (+bos)
    alone = eng.generate([prompts[1]], max_new_tokens=6, stop_tokens=())
    assert alone[0].tokens == a[1].tokens  # a mixed-length batch gives each sequence what it gets alone
    st = eng.last_stats
    assert st.new_tokens == 6 and st.prompt_tokens == 23 and st.decode_s > 0


def test_sampling_seeds_stop_tokens_and_limits():
    eng = _engine()
    p = _prompt(9, 2)
    kw = dict(max_new_tokens=8, stop_tokens=())
    s1 = eng.generate([Request(p, temperature=1.0, seed=1, **kw), Request(p, temperature=1.0, seed=1, **kw),
                       Request(p, temperature=1.0, seed=2, **kw)])
    assert s1[0].tokens == s1[1].tokens != s1[2].tokens  # explicit seeds: same seed, same sample
    again = eng.generate([Request(p, temperature=1.0, seed=2, **kw)])
    assert again[0].tokens == s1[2].tokens  # ... independent of the slot and of the other requests
    greedy = eng.generate([p], **kw)[0].tokens
    assert eng.generate([Request(p, temperature=0.7, top_k=1, seed=5, **kw)])[0].tokens == greedy
    assert eng.generate([Request(p, temperature=1.0, top_p=1e-6, seed=5, **kw)])[0].tokens == greedy
    # stop tokens end a sequence (the stop token is returned), max_new_tokens and max_len too
    stop = eng.generate([p], max_new_tokens=8, stop_tokens=(greedy[2],))[0]
    assert stop.finish_reason == "stop" and stop.tokens == greedy[:3]
    near_full = _prompt(MAX_LEN - 2, 4)
    full = eng.generate([near_full], max_new_tokens=10, stop_tokens=())[0]
    assert full.finish_reason == "max_len" and len(full.tokens) == 3  # fed at positions 38, 39; the 3rd has no room


def test_device_decode_loop_equals_the_host_loop():
    """generate's decode loop with the Engram hash on the device and tokens read back in runs (default) gives
    the tokens of the loop that reads every step back and hashes on the host, with the same ends, the same cache and
    the same Engram look-back afterwards; pipelined (the next run dispatched before this one is read back, the
    default) or not."""
    eng = _engine()
    p = [_prompt(9, 2), _prompt(21, 7), _prompt(MAX_LEN - 4, 4)]
    greedy = eng.generate([p[0]], max_new_tokens=6, stop_tokens=())[0].tokens
    reqs = [Request(p[0], max_new_tokens=9, stop_tokens=(greedy[4],)),  # ends by a stop token inside a run
            Request(p[1], temperature=1.0, top_k=20, seed=3, max_new_tokens=11, stop_tokens=()),
            Request(p[2], max_new_tokens=10, stop_tokens=())]  # ends by max_len
    # the whole batch ends on a stop token inside the second run (k = 3: steps 2..4), far from its length limit: the
    # pipelined loop has dispatched the third run by then and must discard it (top_k 1: greedy, through the sampler
    # the runs above compiled)
    lone = [Request(p[0], temperature=1.0, top_k=1, max_new_tokens=30, stop_tokens=(greedy[3],))]
    got = {}
    chain = decode_chain_program(_decode_opts(eng.options)).jitted
    # the filtered sampler's k = 8 step (a top-k row: sampling.sampler_for), with another run length and no stop
    # token, so that the counts below see whether the runs reuse it; the greedy call above ran the greedy sampler's
    eng.generate([Request(p[1], temperature=1.0, top_k=20, seed=5, max_new_tokens=2, stop_tokens=())])
    programs = {}
    snapshot = functools.partial(jax.tree.map, np.asarray)
    try:
        for loop, every in (("host", 1), ("device", 3), ("device", 8)):  # the device loop pipelined (default)
            eng.decode_loop, eng.readback_every = loop, every
            res = eng.generate(reqs)
            programs[loop, every] = chain._cache_size()
            hist = [a.copy() for a in (eng._hist.tokens, eng._hist.segments, eng._hist.num_positions,
                                       eng._hist.num_valid)]
            got[loop, every] = ([(r.tokens, r.finish_reason) for r in res], hist,
                                visible_state(eng.cache, eng.config), eng.last_stats.decode_steps)
        for pipe in (False, True):
            eng.decode_loop, eng.readback_every, eng.decode_pipeline = "device", 3, pipe
            res = eng.generate(lone)[0]
            got["lone", pipe] = (res.tokens, res.finish_reason, eng.last_stats.decode_steps, snapshot(eng.cache))
    finally:
        eng.decode_loop, eng.readback_every, eng.decode_pipeline = "device", 8, True
    # One compiled step per read-back interval (the ring's shape) and sampler, whatever the run lengths and the number
    # of stop tokens (bucketed): a run dispatches the same program k times. The generates above ran k = 8 with no
    # stop, greedy and filtered.
    assert programs["device", 3] == programs["device", 8] == programs["host", 1] + 1
    eng.generate([Request(p[0], max_new_tokens=3, stop_tokens=(1, 2, 3))])  # k = 8, three stop tokens
    assert chain._cache_size() == programs["device", 8]
    want_tokens, want_hist, want_cache, want_steps = got["host", 1]
    assert [r for _, r in want_tokens] == ["stop", "length", "max_len"]
    for key in (("device", 3), ("device", 8)):
        assert got[key][0] == want_tokens, key
        for a, b in zip(got[key][1], want_hist):
            np.testing.assert_array_equal(a, b)
        # what later steps can read (an ended slot's unfed steps write its partial group's unfilled rows from the
        # token fed, which the host loop and the device loop choose differently; never read)
        assert got[key][2].keys() == want_cache.keys()
        for name, v in want_cache.items():
            np.testing.assert_array_equal(got[key][2][name], v, name)
        # the last sequence ends by its limits: the pipelined loop dispatches no step past them
        assert got[key][3] == want_steps, key
    (off_tokens, off_reason, off_steps, off_cache), (on_tokens, on_reason, on_steps, on_cache) = \
        got["lone", False], got["lone", True]
    stop_at = greedy.index(greedy[3])
    assert on_reason == off_reason == "stop" and on_tokens == off_tokens == greedy[:stop_at + 1]
    assert on_steps == off_steps + 3  # one more run of k = 3 dispatched, its tokens discarded ...
    jax.tree.map(np.testing.assert_array_equal, on_cache, off_cache)  # ... and the cache bit for bit as without it
    with pytest.raises(EngineError, match="decode_loop"):
        Engine(eng.config, eng.params, max_batch=1, max_len=8, decode_loop="gpu")
    with pytest.raises(EngineError, match="readback_every"):
        Engine(eng.config, eng.params, max_batch=1, max_len=8, readback_every=0)
    with pytest.raises(EngineError, match="decode_pipeline"):
        Engine(eng.config, eng.params, max_batch=1, max_len=8, decode_pipeline="yes")


def test_decode_steps_hash_engram_ngrams_on_the_device_like_the_host_hasher():
    """decode_step, the host loop and serve hash each step's tokens on the device (Engine._engram_step): the row ids
    and the look-back equal the host hasher's step, active slots advanced, inactive ones kept."""
    eng = _engine()
    eng.prefill([_prompt(5, 11), _prompt(13, 12)], [0, 2])
    rng = np.random.default_rng(5)
    for active in (np.array([True, False, True]), np.array([True, True, True])):
        tokens = rng.integers(0, eng.config.vocab_size, 3)
        before = eng._hist
        want, after = eng.hasher.step(np.where(active, tokens, 0)[:, None], before)
        got = eng._engram_step(tokens, active)
        assert isinstance(got, jax.Array)  # computed on the device, nothing hashed on the host
        np.testing.assert_array_equal(np.asarray(got)[active], want[active, 0])
        for field in ("tokens", "segments", "num_positions", "num_valid"):
            a, b, new = getattr(after, field), getattr(before, field), getattr(eng._hist, field)
            np.testing.assert_array_equal(new, np.where(active if a.ndim == 1 else active[:, None], a, b), field)


def test_bad_input_is_a_clear_error_and_the_rest_is_served():
    eng = _engine()
    good = _prompt(7, 5)
    want = eng.generate([good], max_new_tokens=4, stop_tokens=())[0].tokens
    bad = [
        ([], "empty prompt"),
        (_prompt(MAX_LEN + 1, 6), "longer than max_len"),
        ([5, 300, 7], "token id 300 at prompt position 1 is outside the vocabulary"),
        ([5, -1], "token id -1"),
        (Request(good, temperature=-1.0), "temperature"),
        (Request(good, temperature=float("nan")), "temperature"),
        (Request(good, top_p=0.0), "top_p"),
        (Request(good, top_k=-2), "top_k"),
        (Request(good, max_new_tokens=0), "max_new_tokens"),
        (Request(good, stop_tokens=(999,)), "stop token 999"),
        ([1.5, 2.0], "integer token ids"),
    ]
    for prompt, message in bad:
        res = eng.generate([prompt, good], max_new_tokens=4, stop_tokens=())
        assert res[0].finish_reason == "error" and message in res[0].error, (prompt, res[0].error)
        assert res[1].ok and res[1].tokens == want  # the valid request in the same batch is served as usual
    with pytest.raises(EngineError, match="max_batch=3"):
        eng.generate([good] * 4)
    no_tok = Engine(eng.config, eng.params, max_batch=1, max_len=8, options=eng.options)
    assert "needs a tokenizer" in no_tok.generate(["text"])[0].error
    # the default prompt chunk: 512 off a Hopper GPU, and the batcher's refill chunk 512 too
    assert (no_tok.prefill_chunk, no_tok.refill_chunk) == (DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_CHUNK) == (512, 512)
    with pytest.raises(EngineError, match="max_len"):
        Engine(eng.config, eng.params, max_batch=1, max_len=0)
    with pytest.raises(EngineError, match="prefill_chunk must be a positive integer or None, got 0"):
        Engine(eng.config, eng.params, max_batch=1, max_len=8, prefill_chunk=0)
    with pytest.raises(ValueError, match="vocabulary"):
        decode_step(eng.params, init_cache(eng.config, 1, 8), np.array([400]), np.zeros((1, 2, 6), np.int32),
                    config=eng.config)
    with pytest.raises(SamplingError, match="top_p"):
        SamplingParams(top_p=1.5).validate()


def test_default_prefill_chunk_doubles_within_the_grouped_gemm_row_budget():
    # grouped expert GEMM (a Hopper GPU): max_batch x chunk kept within 4096 rows, never under 512; elsewhere 512
    assert [default_prefill_chunk(b, True) for b in (1, 2, 3, 4, 5, 8, 64)] == [4096, 2048, 1024, 1024, 512, 512, 512]
    assert [default_prefill_chunk(b, False) for b in (1, 2, 8)] == [512, 512, 512]
    with pytest.raises(PrefillError, match="max_batch must be a positive integer, got 0"):
        default_prefill_chunk(0, True)


def test_verification_programs_turn_the_dot_merger_off_on_the_gpu_only():
    # XLA's dot merger copies the weights of GEMMs sharing an input into one matrix every step: off in the
    # speculative verification programs on the GPU backend (kept with decode_dot_merger=True), on in plain decode
    # unless asked off, untouched elsewhere; idempotent
    off = ("xla_disable_hlo_passes", "dot-merger")
    triton = ("xla_gpu_enable_triton_gemm", True)
    gpu = InferenceOptions(kernel_backend="pallas_gpu", verification_compiler_options=())
    verify = functools.partial(_decode_opts, verification=True)
    assert verify(gpu).compiler_options == (off,)
    assert verify(verify(gpu)).compiler_options == (off,)
    assert verify(dataclasses.replace(gpu, decode_dot_merger=True)).compiler_options == ()
    assert _decode_opts(gpu).compiler_options == ()
    assert _decode_opts(dataclasses.replace(gpu, decode_dot_merger=False)).compiler_options == (off,)
    both = dataclasses.replace(gpu, compiler_options=(("xla_disable_hlo_passes", "cse"), ("a", 1)))
    assert verify(both).compiler_options == (("a", 1), ("xla_disable_hlo_passes", "cse,dot-merger"))
    assert verify(InferenceOptions(kernel_backend="reference")).compiler_options == ()
    # verification_compiler_options: added to the speculative programs only, once
    tg = dataclasses.replace(gpu, verification_compiler_options=(triton,))
    assert verify(tg).compiler_options == (triton, off)
    assert verify(verify(tg)).compiler_options == (triton, off)
    assert _decode_opts(tg).compiler_options == ()
    # by default (None) XLA's Triton GEMMs in the speculative programs on the GPU backend only, never in plain decode
    auto = InferenceOptions(kernel_backend="pallas_gpu")
    assert auto.verification_compiler_options is None
    assert verify(auto).compiler_options == (triton, off)
    assert verify(verify(auto)).compiler_options == (triton, off)
    assert _decode_opts(auto).compiler_options == ()
    assert verify(InferenceOptions(kernel_backend="reference")).compiler_options == ()


def test_sampling_filters():
    logits = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1], [0.1, 0.2, 0.3, 0.4]]))
    one = jnp.ones((2,))
    # top-k 2: two survivors per row
    z = filter_logits(logits, one, jnp.array([2, 2]), one)
    assert (np.isfinite(np.asarray(z)).sum(-1) == 2).all()
    # top-p 0.6: the smallest prefix reaching 0.6 (row 0: 0.5 + 0.25; row 1: 0.4 + 0.3)
    z = filter_logits(logits, one, jnp.zeros((2,), jnp.int32), jnp.array([0.6, 0.6]))
    np.testing.assert_array_equal(np.isfinite(np.asarray(z)), [[1, 1, 0, 0], [0, 0, 1, 1]])
    # empirical frequencies follow the filtered, temperature-scaled distribution
    n = 4000
    lg = jnp.broadcast_to(logits[0], (n, 4))
    draws = jax.jit(sample)(lg, jnp.full((n,), 1.0), jnp.zeros((n,), jnp.int32), jnp.full((n,), 0.8),
                            jnp.arange(n), jnp.zeros((n,), jnp.int32))
    freq = np.bincount(np.asarray(draws), minlength=4) / n
    np.testing.assert_allclose(freq, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0], atol=0.03)
    assert math.isclose(float(np.asarray(sample(logits, jnp.zeros((2,)), jnp.zeros((2,), jnp.int32), one,
                                                jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32)))[1]), 3)



def test_sampling_filters_match_a_float64_reference():
    """top-k then top-p (one sort per row in filter_logits) keeps exactly the tokens a float64 two-pass reference
    keeps: the k largest logits, then the smallest prefix of the renormalised probabilities reaching top_p."""
    rng = np.random.default_rng(7)
    b, v = 24, 97
    logits = rng.standard_normal((b, v)).astype(np.float32) * 3
    temp = rng.choice([0.5, 1.0, 1.7], b).astype(np.float32)
    top_k = rng.choice([0, 1, 5, 40, v + 3], b).astype(np.int32)
    top_p = rng.choice([0.3, 0.9, 1.0], b).astype(np.float32)
    got = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), jnp.asarray(temp), jnp.asarray(top_k),
                                               jnp.asarray(top_p))))
    for r in range(b):
        z = logits[r].astype(np.float64) / temp[r]
        order = np.argsort(-z)
        k = v if top_k[r] == 0 else min(int(top_k[r]), v)
        kept = order[:k]
        if top_p[r] < 1:
            p = np.exp(z[kept] - z[kept].max())
            p /= p.sum()
            before = np.cumsum(p) - p
            kept = kept[:max(int(np.sum(before < top_p[r])), 1)]
        want = np.zeros(v, bool)
        want[kept] = True
        np.testing.assert_array_equal(got[r], want, err_msg=f"row {r}: top_k {top_k[r]}, top_p {top_p[r]}")


def test_lighter_samplers_give_the_filtered_samplers_tokens():
    """``sampler_for`` picks the least sampler for a batch's rows, and on rows it admits each lighter sampler
    draws exactly the tokens ``"filtered"`` draws (same keys, same logits)."""
    assert sampler_for([0, 0], [5, 0], [0.3, 1]) == "greedy"  # filters on greedy rows do not count
    assert sampler_for([0, 0.7], [5, 0], [0.3, 1]) == "unfiltered"
    assert sampler_for([0, 0.7], [0, 2], [1, 1]) == "filtered"
    assert sampler_for([0.7], [0], [0.9]) == "filtered"
    rng = np.random.default_rng(3)
    b, v = 64, 50
    logits = jnp.asarray(rng.standard_normal((b, v)).astype(np.float32) * 2)
    logits = logits.at[3, 7].set(-jnp.inf)  # a masked vocabulary entry stays masked either way
    seeds, steps = jnp.arange(b), jnp.full((b,), 5)
    for temp, sampler in ((np.zeros(b), "greedy"), (rng.choice([0.0, 0.6, 1.3], b), "unfiltered")):
        args = (logits, jnp.asarray(temp, jnp.float32), jnp.zeros((b,), jnp.int32), jnp.ones((b,)), seeds, steps)
        assert sampler_for(temp, np.zeros(b), np.ones(b)) == sampler
        np.testing.assert_array_equal(np.asarray(sample(*args, sampler)), np.asarray(sample(*args, "filtered")))
    with pytest.raises(SamplingError, match="sampler"):
        sample(*args, "nucleus")


def _every_role_config_json(tmp_path) -> str:
    """The 6-layer every-role cut as a config.json for ``--config``: the CLI's random-weights path loads a path as
    it loads a preset's name (load_config; the name itself is passed below, in the call refused before compiling),
    and its programs compile in about half the time of the 12-layer tiny's; what the test checks (the command's
    output, its accounting lines) does not depend on the depth."""
    from dsv41_jax.checkpoint.orbax_ckpt import write_config_json

    write_config_json(str(tmp_path), every_role_config(quant_sim=False))
    return str(tmp_path / "config.json")


def test_cli_generate(tmp_path, capsys):
    rc = main(["generate", "--config", _every_role_config_json(tmp_path), "--prompt", "Hello", "--max-new-tokens",
               "4", "--seed", "1"])
    assert rc == 0
    out, err = capsys.readouterr()
    assert out.startswith("Hello")
    assert "B/token" in err and "890" not in err and "tok/s" in err and "prefill" in err
    assert "Engram tables in device memory" in err  # auto: the CPU reports no memory limit, so they stay
    assert main(["generate", "--config", "tiny", "--prompt", "Hi", "--max-new-tokens", "0"]) == 2
    assert "max-new-tokens" in capsys.readouterr().err


def test_cli_generate_long_prompt_warns_shortens_its_echo_and_times_separately(tmp_path, capsys):
    """A prompt longer than the rows the weights were trained on (recorded by `dsv41 train --export`) warns; the
    echo of a long prompt is shortened; progress is a few lines off a TTY; compile time, time to first token and the
    steady decode rate are reported apart."""
    from dsv41_jax.checkpoint.orbax_ckpt import export_params
    from dsv41_jax.default_model import DEFAULT_MODEL_DIR, TRAINED_SEQ_LEN

    # the embedded model's record: TRAINING.md's command trained on --seq-len TRAINED_SEQ_LEN rows
    with open(f"{DEFAULT_MODEL_DIR}/TRAINING.md") as f:
        assert f"--seq-len {TRAINED_SEQ_LEN} " in f.read()
    config = every_role_config(quant_sim=False)
    ckpt = export_params(str(tmp_path / "export"), host_random_params(config, 0), config, fmt="safetensors",
                         extra={"train_seq_len": 16})
    prompt = "".join(chr(97 + i % 26) for i in range(700))
    rc = main(["generate", "--checkpoint", ckpt, "--prompt", prompt, "--max-new-tokens", "4", "--prefill-chunk",
               "64", "--temperature", "0"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "warning: the prompt is 701 tokens but the model was trained on rows of 16 tokens" in err
    assert out.startswith(prompt[:120]) and "characters of the prompt not shown" in out and prompt not in out
    assert len(out) < 500
    assert err.count("# prefill") <= 11  # not one line per chunk (12 chunks here), at most one per tenth
    timing = [line for line in err.splitlines() if line.startswith("# compile:")]
    assert len(timing) == 1 and "time to first token:" in timing[0] and "tok/s steady" in timing[0]
    # a short prompt: no warning, the echo in full (the long run's max_len (bos + prompt + 4), chunk and sampling:
    # its compiled programs serve this run too; measured 2.0 against 7.1 CPU-s with the short run's own max_len)
    assert main(["generate", "--checkpoint", ckpt, "--prompt", "abc", "--max-new-tokens", "4", "--prefill-chunk", "64",
                 "--temperature", "0", "--max-len", str(len(prompt) + 1 + 4)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("abc") and "warning" not in err
