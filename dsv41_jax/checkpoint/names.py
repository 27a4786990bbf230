"""Checkpoint tensor names and storage formats, written once, as data.

Two namings of the same tensors exist (SPEC §12):

* **release** — the official inference module tree (``inference/model.py`` of DeepSeek-V4.1-Flash): ``embed.weight``,
  ``layers.{i}.attn.wq_a.weight``, ``layers.{i}.ffn.experts.{e}.w1.weight``, ``norm.weight``, ``head.weight``,
  ``mtp.{j}.…`` for the DSpark drafter, ``vision.* / aligner.* / image_*`` for the vision tower.
* **hf** — HF transformers ``deepseek_v41`` (and our golden fixtures / exports): the same tree below the top level,
  under ``model.``, with the head named ``lm_head.weight``. This is :attr:`ParamSpec.hf_name`, our canonical name.

The official ``convert.py`` also accepts a few HF-transformers spellings (``self_attn``, ``mlp``,
``weight_scale_inv``, ``e_score_correction_bias``); :data:`ALIASES` folds them onto the canonical spelling so a
checkpoint written with them reads the same.

Storage formats of the release (``config.json`` ``quantization_config``: fp8 e4m3, 32×32 weight blocks, ue8m0
scales, ``expert_dtype`` fp4): a quantised weight ``<module>.weight`` has a sibling ``<module>.scale``.

Sources (read, not copied): the official ``inference/model.py`` (``Linear``: FP8 ``[out, in]`` + e8m0
``[ceil(out/32), ceil(in/32)]``, FP4 ``[out, in/2]`` + e8m0 ``[out, in/32]``; ``ParallelEngramEmbedding``: e4m3
``[rows, dim]`` + e8m0 ``[rows, dim/32]``; ``wo_a``, compressor, indexer ``wk`` / ``weights_proj`` bf16 at run time),
its ``convert.py`` (experts stored as int8 and viewed as ``float4_e2m1fn_x2``, low nibble first; ``wo_a`` stored FP8
and dequantised at conversion; ``mtp.*.embed`` / ``head`` tied; the HF-style aliases above), HF transformers
``deepseek_v41`` (``model.`` prefix, ``lm_head``, ``mtp.* / vision.* / aligner.* / image_*`` ignored on load), vLLM's
V4 quantisation config (``quant_method`` fp8, ``weight_block_size`` [32, 32], ``scale_fmt`` ue8m0, ``expert_dtype``
fp4 for the released experts, float32 scales for the FP8-expert Base checkpoints — both accepted here).
"""

from __future__ import annotations

import re

RELEASE = "release"
HF = "hf"

# canonical HF name <-> release name: whole-name renames first, then prefix renames
TOP_LEVEL_RENAMES = (
    ("model.embed.weight", "embed.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "head.weight"),
)
PREFIX_RENAMES = (
    ("model.layers.", "layers."),
)
# alternative spellings (either naming) -> canonical spelling
ALIASES = (
    ("model.mtp.", "mtp."),  # an HF-style export that nests the drafter under the model prefix
    (".self_attn.", ".attn."),
    (".mlp.", ".ffn."),
    (".weight_scale_inv", ".scale"),
    (".e_score_correction_bias", ".bias"),
)

# Storage formats. Values of FORMATS are matched against the module name (the tensor name without ".weight") in the
# release naming.
FP8_BLOCK = "fp8_e4m3_block"  # [out, in] e4m3 + e8m0 scale [ceil(out/bo), ceil(in/bi)] (bo = bi = 32 released)
FP4_ROWS = "fp4_e2m1_rows"  # [out, in/2] two e2m1 codes per byte (even element in the low nibble) + e8m0 [out, in/32]
ENGRAM_ROWS = "fp8_e4m3_rows"  # Engram table [rows, head_dim] e4m3 + e8m0 [rows, head_dim/32]
FLOAT = "float"  # bf16 / f32 as stored

FP4_BLOCK = 32  # one e8m0 scale per 32 input elements of a routed expert
ENGRAM_BLOCK = 32  # one e8m0 scale per 32 values of an Engram row

FORMATS = (
    (re.compile(r"^(layers|mtp)\.\d+\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)$"), FP8_BLOCK),
    (re.compile(r"^(layers|mtp)\.\d+\.attn\.indexer\.wq_b$"), FP8_BLOCK),
    (re.compile(r"^(layers|mtp)\.\d+\.ffn\.shared_experts\.w[123]$"), FP8_BLOCK),
    (re.compile(r"^layers\.\d+\.engram\.wkv$"), FP8_BLOCK),
    (re.compile(r"^mtp\.0\.main_proj$"), FP8_BLOCK),
    (re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]$"), FP4_ROWS),
    (re.compile(r"^layers\.\d+\.engram\.embed$"), ENGRAM_ROWS),
)

# Tensors the release ships that this model does not load, with the reason (listed in every load report).
DSPARK = re.compile(r"^mtp\.\d+\.")
TIED_DSPARK = re.compile(r"^mtp\.\d+\.(embed|head)\.weight$")  # tied to the backbone's embed / head (official convert.py)
SKIPPED = (
    (re.compile(r"^(vision|aligner)\."), "vision tower / aligner (out of scope)"),
    (re.compile(r"^image_(start|end|newline)$"), "image-span delimiter embedding (vision, out of scope)"),
    (re.compile(r"\.ffn\.gate\.bias_vl$"), "vision-span router bias (vision, out of scope)"),
    (TIED_DSPARK, "DSpark copy of the backbone's tied embed / head"),
)
DSPARK_REASON = "DSpark drafter (not loaded: pass include_dspark=True to load it)"
DSPARK_ABSENT_REASON = "DSpark drafter (not loaded: the config has no DSpark modules, num_nextn_predict_layers=0)"

# Component of a tensor (for `dsv41 inspect` byte accounting), first match wins, on the release name.
COMPONENTS = (
    (re.compile(r"^mtp\."), "dspark"),
    (re.compile(r"^(vision|aligner|image_)"), "vision"),
    (re.compile(r"\.engram\.embed\."), "engram tables"),
    (re.compile(r"\.engram\."), "engram projection"),
    (re.compile(r"\.ffn\.experts\."), "routed experts"),
    (re.compile(r"\.ffn\.shared_experts\."), "shared experts"),
    (re.compile(r"\.ffn\.gate\."), "router"),
    (re.compile(r"\.attn\.(compressor|indexer)\."), "compressor / indexer"),
    (re.compile(r"\.attn\."), "attention"),
    (re.compile(r"\.hc_"), "mHC"),
    (re.compile(r"^(embed|head)\."), "embed / head"),
    (re.compile(r"norm"), "norms"),
)


def canonical(name: str) -> str:
    """Fold the accepted alternative spellings onto the canonical one (naming unchanged)."""
    for old, new in ALIASES:
        name = name.replace(old, new)
    return name


def to_release(hf_name: str) -> str:
    for hf, rel in TOP_LEVEL_RENAMES:
        if hf_name == hf:
            return rel
    for hf, rel in PREFIX_RENAMES:
        if hf_name.startswith(hf):
            return rel + hf_name[len(hf):]
    return hf_name  # mtp.* and vision names are the same in both namings


def to_hf(release_name: str) -> str:
    for hf, rel in TOP_LEVEL_RENAMES:
        if release_name == rel:
            return hf
    for hf, rel in PREFIX_RENAMES:
        if release_name.startswith(rel):
            return hf + release_name[len(rel):]
    return release_name


def in_naming(hf_name: str, naming: str) -> str:
    """A canonical (HF) name written in ``naming``."""
    return to_release(hf_name) if naming == RELEASE else hf_name


def detect_naming(names) -> str:
    """``release`` or ``hf`` from the tensor names; raises ValueError on a mix or on neither."""
    hf = rel = 0
    for n in names:
        n = canonical(n)
        if n.startswith("model.") or n == "lm_head.weight":
            hf += 1
        elif n.startswith("layers.") or n in ("embed.weight", "head.weight", "norm.weight"):
            rel += 1
    if hf and rel:
        raise ValueError(f"tensor names mix the HF naming ({hf} tensors under 'model.' / 'lm_head') and the release "
                         f"naming ({rel} tensors under 'layers.' / 'embed' / 'head')")
    if not hf and not rel:
        raise ValueError("no backbone tensors found (expected 'layers.*' / 'embed.weight' or 'model.layers.*')")
    return HF if hf else RELEASE


def storage_format(release_module: str) -> str:
    """The release's storage format of a module (tensor name without ``.weight``), or FLOAT."""
    for pattern, fmt in FORMATS:
        if pattern.match(release_module):
            return fmt
    return FLOAT


def skip_reason(release_name: str, include_dspark: bool, config_has_dspark: bool = True) -> str | None:
    """Why a stored tensor is not loaded (None: it must be). ``mtp.*`` is loaded only when asked for
    (``include_dspark``) and the config has DSpark modules; otherwise it is listed as skipped."""
    for pattern, reason in SKIPPED:
        if pattern.search(release_name):
            return reason
    if DSPARK.match(release_name):
        if not config_has_dspark:
            return DSPARK_ABSENT_REASON
        if not include_dspark:
            return DSPARK_REASON
    return None


def component(release_name: str) -> str:
    for pattern, comp in COMPONENTS:
        if pattern.search(release_name):
            return comp
    return "other"


__all__ = ["RELEASE", "HF", "FP8_BLOCK", "FP4_ROWS", "ENGRAM_ROWS", "FLOAT", "canonical", "to_release", "to_hf",
           "in_naming", "detect_naming", "storage_format", "skip_reason", "component"]
