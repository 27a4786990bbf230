# CPU check: with the drafter train step donating its state (as on a GPU), the drafter parameters the bench hands to
# the engines survive the held-out evaluation steps only when copied
import jax, jax.numpy as jnp, numpy as np, sys
sys.path.insert(0, ".")
from benchmarks.bench_dspark_h200 import target_config, inference_params
from dsv41_jax.model.params import init_from_specs, param_specs
from dsv41_jax.train.config import TrainConfig
from dsv41_jax.train.dspark import DSparkTrainOptions, DSparkTrainStep
c = target_config(True, 7, 8, 6, 4)
p = init_from_specs(param_specs(c, include_dspark=True), jax.random.PRNGKey(0))
tc = TrainConfig(seq_len=64, batch_size=2, steps=10, lr=1e-3, compute_dtype="float32", quant_sim=False)
d = DSparkTrainStep(c, tc, p, DSparkTrainOptions(anchors=4))
d._jitted = jax.jit(d.step_fn, donate_argnums=(0,))
st = d.init_state()
batch = dict(tokens=np.ones((2, 64), np.int32), targets=np.ones((2, 64), np.int32), loss_mask=np.ones((2, 64), np.float32),
             valid=np.ones((2, 64), bool))
dev = jax.devices()[0]
for copy in (False, True):
    st = d.init_state()
    dp = jax.device_put(inference_params({"dspark": st["params"]["dspark"]}, c)["dspark"], dev)
    if copy:
        dp = jax.tree.map(lambda x: jnp.array(x, copy=True), dp)
    st, m = d(st, batch, 0.0)
    jax.block_until_ready(m)
    dead = [x.shape for x in jax.tree.leaves(dp) if x.is_deleted()]
    print("copy" if copy else "no copy", "deleted leaves:", len(dead), dead[:3])
