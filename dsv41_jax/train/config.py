"""Training hyper-parameters: one frozen, validated dataclass (saved with every checkpoint).

The model architecture is a :class:`dsv41_jax.ModelConfig`; this object only says how to train it. Invalid values
fail at construction with a message naming the field (like the model config).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

from dsv41_jax.ops.moe import MOE_IMPLS


class TrainConfigError(ValueError):
    """An invalid training configuration; the message names the field."""


class TrainWarning(UserWarning):
    """A valid but suspicious training setting (``TrainConfig.warnings``); ``dsv41 train`` prints it."""


OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "linear", "constant", "wsd")
PACKING = ("concat", "pad", "segments")
REMAT = ("none", "full", "dots", "dots_no_batch")
REMAT_SCOPES = ("forward", "layer")
ZERO_STAGES = (0, 1, 3)
INDEXER_LOSS = ("off", "dense", "sparse")
DTYPES = ("float32", "bfloat16")
# LoRA's default targets: the attention projections that are plain GEMMs (queries wq_a / wq_b, the K=V latent wkv,
# the output's second projection wo_b; the grouped wo_a is not a single GEMM). See dsv41_jax.train.lora.
DEFAULT_LORA_TARGETS = r"/attn/(wq_a|wq_b|wkv|wo_b)$"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # --- batch ------------------------------------------------------------------------------------
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 1000
    packing: str = "concat"  # concat: one token stream cut into rows | pad: one document per row | segments: packed
    seed: int = 0
    # --- optimiser --------------------------------------------------------------------------------
    optimizer: str = "adamw"  # adamw | muon (optax.contrib.muon; non-matrix parameters use its AdamW branch)
    lr: float = 3e-4
    schedule: str = "cosine"  # cosine | linear | constant | wsd (warmup-stable-decay, last `decay_frac` decays)
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    decay_frac: float = 0.2  # wsd only
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # decoupled; matrices only (norms, biases, sinks, mHC base/scale are not decayed)
    grad_clip: float = 1.0  # global norm over the trainable parameters; 0 disables
    # --- what trains ------------------------------------------------------------------------------
    trainable: tuple[str, ...] = ()  # regexes over parameter paths ("layers/3/attn/wq_a"); empty = everything
    frozen: tuple[str, ...] = ()  # regexes; applied after `trainable`
    # --- numerics ---------------------------------------------------------------------------------
    compute_dtype: str = "bfloat16"  # forward/backward dtype; master weights and optimiser state stay float32
    # Keep the compute-dtype copy of the weights in the state ("compute"), written by the optimiser update from the
    # new masters, so that the next step reads it instead of casting every float32 master again (a read of 4 B and
    # a write of 2 B per weight less, one write of 2 B more: the same gradients and update, + 2 B per weight held).
    compute_copy: bool = False
    quant_sim: bool | None = None  # None -> the model config's (release fake quantisation, straight-through grads)
    remat: str = "none"  # none | full | dots | dots_no_batch (jax.checkpoint policy)
    # where the policy applies: "forward" (one checkpoint around the whole forward: its backward holds every layer's
    # recomputed residuals at once) | "layer" (one checkpoint per decoder layer: one layer's at a time)
    remat_scope: str = "forward"
    moe_impl: str = "auto"  # ops.moe.MOE_IMPLS; auto: grouped GEMM kernels on GPUs, ragged_dot elsewhere
    # dsv41_jax.kernels backend of sparse attention and the indexer ("auto": Pallas on GPU / TPU, the reference on
    # CPU). An ahead-of-time compile for TPU on a CPU host names "pallas_tpu"; on a mesh the kernels run per shard
    # (shard_map over the batch and head axes).
    kernel_backend: str = "auto"
    # --- sharding over a mesh (full fine-tuning; ignored without a mesh) -------------------------------
    # 0: optimiser moments split like their parameters; 1 (ZeRO-1): the moments further split over the batch axes
    # (data x expert) their parameter is replicated on; 3 (ZeRO-3): the float32 masters and their gradients too,
    # each layer's weights gathered for use inside the layer (all-gather in the forward and again in the backward
    # under per-layer remat, gradients reduce-scattered back to the split).
    zero: int = 0
    query_chunk: int = 256
    # --- MoE balance ------------------------------------------------------------------------------
    bias_update_rate: float = 1e-3  # DeepSeekMoE noaux: bias += rate * sign(mean load - load); 0 disables
    aux_loss_coef: float = 0.0  # sequence-wise balance loss (DeepSeek-V3 form); 0 disables
    # --- indexer (KL objective of the DSA lineage; the indexer input is detached) ------------------
    indexer_loss: str = "off"  # off | dense (warm-up: all visible entries) | sparse (the selected top-k only)
    indexer_loss_coef: float = 1.0
    # --- LoRA (dsv41_jax.train.lora): adapters on a frozen base instead of full fine-tuning ------------
    lora: bool = False
    lora_rank: int = 8
    lora_alpha: float = 16.0  # the adapter's output is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0  # dropout on the adapter's input
    lora_targets: str = DEFAULT_LORA_TARGETS  # regex over parameter paths

    def __post_init__(self):
        for name in ("trainable", "frozen"):
            v = getattr(self, name)
            if isinstance(v, str):
                v = (v,)
            object.__setattr__(self, name, tuple(v))
        self._validate()

    def _validate(self) -> None:
        def err(name, msg):
            return TrainConfigError(f"train config field `{name}`: {msg}")

        for name in ("seq_len", "batch_size", "steps", "query_chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise err(name, f"must be a positive integer, got {v!r}")
        if self.seq_len < 2:
            raise err("seq_len", f"must be at least 2, got {self.seq_len}")
        if self.warmup_steps < 0:
            raise err("warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        for name, choices in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES), ("packing", PACKING),
                              ("remat", REMAT), ("remat_scope", REMAT_SCOPES), ("indexer_loss", INDEXER_LOSS), ("compute_dtype", DTYPES)):
            if getattr(self, name) not in choices:
                raise err(name, f"must be one of {choices}, got {getattr(self, name)!r}")
        if not self.lr > 0:
            raise err("lr", f"must be > 0, got {self.lr}")
        for name in ("min_lr_ratio", "decay_frac"):
            if not 0 <= getattr(self, name) <= 1:
                raise err(name, f"must be in [0, 1], got {getattr(self, name)}")
        for name in ("weight_decay", "grad_clip", "bias_update_rate", "aux_loss_coef", "indexer_loss_coef", "eps"):
            if getattr(self, name) < 0:
                raise err(name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise err(name, f"must be in [0, 1), got {getattr(self, name)}")
        if self.zero not in ZERO_STAGES:
            raise err("zero", f"must be one of {ZERO_STAGES}, got {self.zero!r}")
        from dsv41_jax.kernels import BACKENDS

        if self.kernel_backend not in BACKENDS:
            raise err("kernel_backend", f"must be one of {BACKENDS}, got {self.kernel_backend!r}")
        if self.moe_impl not in MOE_IMPLS:
            raise err("moe_impl", f"must be one of {MOE_IMPLS}, got {self.moe_impl!r}")
        if not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool) or self.lora_rank <= 0:
            raise err("lora_rank", f"must be a positive integer, got {self.lora_rank!r}")
        if not self.lora_alpha > 0:
            raise err("lora_alpha", f"must be > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise err("lora_dropout", f"must be in [0, 1), got {self.lora_dropout}")
        try:
            re.compile(self.lora_targets)
        except re.error as e:
            raise err("lora_targets", f"invalid regex {self.lora_targets!r}: {e}") from None
        if self.compute_copy and (self.compute_dtype == "float32" or self.lora):
            raise err("compute_copy", "keeps a bfloat16 copy of the float32 masters of full fine-tuning: it needs "
                                      "compute_dtype bfloat16 and no LoRA")
        if self.lora and (self.trainable or self.frozen):
            raise err("lora", "LoRA trains only the adapters chosen by lora_targets; trainable / frozen select "
                              "parameters of full fine-tuning and cannot be combined with it")
        for name in ("trainable", "frozen"):
            for pattern in getattr(self, name):
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise err(name, f"invalid regex {pattern!r}: {e}") from None

    def warnings(self) -> list[str]:
        """Valid but suspicious settings, each a sentence naming the field (``train`` emits them as
        :class:`TrainWarning`): a warm-up as long as the run, a schedule that never reaches or never leaves its peak
        as asked, learning rates far outside the usual range."""
        from dsv41_jax.train.optimizer import lr_at

        out = []
        if self.warmup_steps >= self.steps:
            last = lr_at(self.steps - 1, self)
            out.append(f"warmup_steps {self.warmup_steps} >= steps {self.steps}: the whole run is warm-up and the "
                       f"learning rate never reaches its peak {self.lr:g} (last step {last:.3g}, "
                       f"{last / self.lr:.2g} of the peak); lower --warmup")
        elif self.schedule != "constant" and self.steps - self.warmup_steps < max(2, self.steps // 20):
            out.append(f"only {self.steps - self.warmup_steps} step(s) after warmup_steps {self.warmup_steps}: the "
                       f"{self.schedule} decay is (almost) empty")
        if self.schedule != "constant" and self.min_lr_ratio == 1.0:
            out.append(f"min_lr_ratio 1 makes the {self.schedule} schedule constant")
        if self.optimizer == "adamw" and self.lr > 1e-2:
            out.append(f"lr {self.lr:g} is unusually high for AdamW (typical: 1e-4 to 3e-3)")
        if self.lr < 1e-7:
            out.append(f"lr {self.lr:g} is so small that the parameters will barely change")
        return out

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise TrainConfigError(f"unknown train config fields: {unknown}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
