"""The decode step is one device program with nothing that hands control back to the host between kernels (no
loop whose trip count depends on data, no conditional, no callback), updates its cache in place (every cache
buffer aliased to an output), and copies or concatenates no cache-sized buffer (dsv41_jax.inference.audit)."""

from dsv41_jax.inference.audit import audit_decode_step, hlo_counts
from dsv41_jax.inference.step import FAST_COMPILE, InferenceOptions
from dsv41_jax.plan import FULL
from dsv41_jax.train.testing import every_role_config

BATCH, MAX_LEN = 4, 256


def test_gpu_decode_graph_has_no_host_round_trip_and_no_cache_sized_copy():
    config = every_role_config()
    # the program a GPU runs (Pallas kernels for attention, the indexer and the routed experts; their loops run
    # inside the kernels); batch 1 picks fewer experts than exist (the slot kernels), BATCH picks every expert
    # (batched GEMMs over the stacked experts): neither leaves a rolled loop or a per-expert weight slice
    assert 1 * config.num_experts_per_tok < config.n_routed_experts <= BATCH * config.num_experts_per_tok
    for batch, chained in ((1, False), (BATCH, False), (1, True)):  # chained: decode_chain, Engine.generate's step
        audit = audit_decode_step(config, batch, MAX_LEN, chained=chained,
                                  opts=InferenceOptions(kernel_backend="pallas_gpu_interpret"))
        assert audit.dynamic_loops == [] and audit.conds == 0 and audit.callbacks == 0, audit.summary()
        assert audit.big_concats == [] and audit.big_copies == [], (audit.big_concats, audit.big_copies)
        assert audit.kernels > 0
        assert [n for n, unrolled in audit.scans if not unrolled] == [], audit.scans


def test_cpu_decode_graph_and_compiled_program():
    config = every_role_config()
    audit = audit_decode_step(config, BATCH, MAX_LEN)
    # the plain-JAX indexer (the CPU backend) streams over the visible entries with a data-dependent loop, one per
    # layer that scores the whole cache (Full layers; Reindex layers score the gathered HSI pool): cheap on a CPU,
    # which is its own host; GPUs and TPUs take the kernel path above
    assert len(audit.dynamic_loops) == sum(s.mode == FULL for s in config.plan.layers), audit.dynamic_loops
    assert audit.conds == 0 and audit.callbacks == 0 and audit.big_concats == [] and audit.big_copies == []
    hlo = hlo_counts(config, BATCH, MAX_LEN, opts=InferenceOptions(compiler_options=FAST_COMPILE))
    assert hlo["aliased_outputs"] == hlo["cache_leaves"], hlo  # the donated cache is updated in place
    assert hlo["big_copies"] == 0 and hlo["big_concatenates"] == 0 and hlo["conditionals"] == 0, hlo
    assert hlo["while_loops"] - hlo["while_known_trip"] == len(audit.dynamic_loops), hlo
