"""The configuration of a DLite draft checkpoint, format ``dlite_v1`` (the authors' layout).

Contract
--------
* A checkpoint's ``config.json`` is the authors' layout: the Qwen3 fields of the draft backbone
  (``hidden_size``, ``num_hidden_layers`` = draft depth n, heads, ``head_dim``,
  ``intermediate_size``, ``rms_norm_eps``, ``rope_theta``, ``vocab_size``, ...), two custom fields
  ``num_target_layers`` (N) and ``block_size`` (B, **counting the anchor**: B-1 drafted tokens),
  and a ``dlite_config`` block::

      {"architecture_version": "dlite_v1", "model_role": "pivot_q_student",
       "anchor_group_size": G, "chs_num_layers": L, "target_layer_ids": [...],
       "sequential_head": "rnn", "sequential_rank": r, "mask_token_id": m}

  :meth:`DLiteConfig.from_checkpoint_config` reads it (tolerant of what the authors' code ignores:
  extra keys, the ``architectures`` string, ``rope_theta`` at top level or in
  ``rope_parameters``); :meth:`DLiteConfig.to_checkpoint_config` writes it.
* **A Qwen3 key that config.json leaves out means what it means in the authors' code**, whose
  config class is transformers 4.57's ``Qwen3Config``: :data:`QWEN3_CONFIG_DEFAULTS` (e.g. a
  missing ``rope_theta`` is 10,000, ``head_dim`` 128, ``num_key_value_heads`` 32), not the target's
  value. :func:`target_default_warning` says when such a default differs from the target's.
  ``rope_scaling`` (default, linear, dynamic, yarn, llama3) and ``hidden_act`` are applied as the
  authors' transformers applies them; what this package cannot reproduce (``longrope``, a
  sliding window that would cut one round's keys) is refused with one message.
* ``target_layer_ids`` are the authors' ids: 0-based decoder layers of the target, chosen by
  :func:`build_target_layer_ids` (and required to equal it). Id ``j`` is the residual stream after
  ``j+1`` layers, i.e. **vLLM aux id j+1**; the last id ``N-1`` is taken **after the target's final
  norm** (the drafter applies that norm to vLLM's pre-norm aux id N). :attr:`aux_layer_ids` gives
  the ids vLLM must serve.
* ``K`` (:attr:`DLiteConfig.num_draft_tokens` = B-1) is the number of tokens one round drafts; it
  is the one name for that number in this package (vLLM calls it ``num_speculative_tokens``). Its
  one default is the checkpoint's own K: :func:`resolve_k` (the CLIs' ``--k`` defaults to None).
* Every check raises ``ValueError`` with ONE message naming the field and the fix. Checkpoints in
  the earlier vllm-dlite format (before ``dlite_v1``) are refused with a message saying so.

No vLLM or torch import here: this module is safe to import anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

ARCHITECTURE_VERSION = "dlite_v1"
MODEL_ROLE = "pivot_q_student"
SEQUENTIAL_HEAD = "rnn"
# What we write as ``architectures`` (the authors' class name). vLLM is always handed
# DRAFT_ARCHITECTURE instead (see vllm_dlite.vllm.plugin): its name must start with "DFlash"
# because vLLM renames every other architecture of a "dflash" draft.
CHECKPOINT_ARCHITECTURE = "DLiteDraftModel"
DRAFT_ARCHITECTURE = "DFlashDLiteDraftModel"
GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS; the authors' too)

_OLD_FORMAT_KEYS = ("head_rank", "feature_mode", "target_hidden_size")
_FIX_OLD = (
    "it was written by vllm-dlite before the authors' dlite_v1 format was adopted and cannot be "
    "converted (different head and block layout): retrain it with `python -m vllm_dlite.train "
    "--config configs/dlite-tiny.yaml` or use a dlite_v1 checkpoint (e.g. "
    "models/dlite-qwen3-tiny-stdlib, or the authors' SJTU-DAI-Sys/Qwen3-8B-DLite)"
)

# What a key left out of config.json means in the authors' code: the defaults of transformers
# 4.57.1 ``Qwen3Config.__init__`` (their config class, docs/dlite_v1.md §1.1; TFc). ``num_key_value_heads``
# given as null means ``num_attention_heads`` there (backward compatibility), absent means 32.
QWEN3_CONFIG_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "layer_types": None,
}
# The activations of transformers' ACT2FN that the draft MLP applies (``act(gate) * up``).
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_python",
               "gelu_python_tanh", "quick_gelu", "relu", "relu2", "sigmoid", "tanh")
# RoPE types applied as transformers 4.57's ROPE_INIT_FUNCTIONS does for positions below
# max_position_embeddings (one round's local positions are < 64), and their required keys.
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# Keys whose default cannot be caught by a tensor shape, so a disagreement with the target is silent.
_SILENT_DEFAULT_KEYS = ("rope_theta", "rms_norm_eps", "hidden_act")


def _rope_fields(cfg: dict[str, Any]) -> tuple[Any, Optional[dict[str, Any]]]:
    """``(rope_theta or None if absent, rope_scaling dict or None)`` of a config dict: top-level
    ``rope_theta`` / ``rope_scaling`` (transformers 4.x, the authors'), else transformers 5's
    ``rope_parameters``. ``rope_scaling`` is normalised to carry ``rope_type``; default -> None."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    theta = cfg.get("rope_theta")
    if theta is None:
        theta = params.get("rope_theta")
    scaling = cfg.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if isinstance(scaling, dict):
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.get("rope_type", scaling.pop("type", "default"))
        scaling.pop("type", None)
        if scaling["rope_type"] == "default":
            scaling = None
    return theta, scaling


def _target_value(target: Any, key: str) -> Any:
    """``key`` of a target config (a dict or an HF config object; rope_theta also from transformers
    5's ``rope_parameters``); None when it does not say."""
    get = (lambda k: target.get(k)) if isinstance(target, dict) else (lambda k: getattr(target, k, None))
    value = get(key)
    if value is None and key == "rope_theta":
        params = get("rope_parameters")
        if isinstance(params, dict):
            value = params.get("rope_theta")
    return value


def authors_defaults_taken(cfg: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3 keys a checkpoint's config.json leaves out, with the value the authors' code
    (transformers 4.57 ``Qwen3Config``) gives them: what :meth:`DLiteConfig.from_checkpoint_config`
    uses for them."""
    theta, _ = _rope_fields(cfg)
    taken = {k: v for k, v in QWEN3_CONFIG_DEFAULTS.items() if k not in cfg}
    if theta is not None:
        taken.pop("rope_theta", None)
    if isinstance(cfg.get("rope_parameters"), dict):
        taken.pop("rope_scaling", None)
    return taken


def target_default_warning(cfg: dict[str, Any], target: Any, where: str = "the DLite drafter") -> Optional[str]:
    """One line when a key the drafter's config.json leaves out takes the authors' default but the
    target's config says otherwise (e.g. a drafter without ``rope_theta``, which the authors' code
    runs at 10,000, beside a target at 1e6); None when nothing disagrees. ``target``: the target's
    config.json dict or HF config object. Shape-bearing keys are not listed: the checkpoint's
    tensor shapes already check them."""
    taken = authors_defaults_taken(cfg)
    differ = []
    for key in _SILENT_DEFAULT_KEYS:
        if key not in taken:
            continue
        theirs = _target_value(target, key)
        if theirs is not None and theirs != taken[key]:
            differ.append((key, taken[key], theirs))
    if not differ:
        return None
    said = "; ".join(f"{k} = {mine!r} (config.json leaves it out; the authors' Qwen3Config default) "
                     f"but the target's {k} = {theirs!r}" for k, mine, theirs in differ)
    adds = ", ".join(f'"{k}": {json.dumps(theirs)}' for k, _, theirs in differ)
    return (f"{where} runs with {said}: this is what the authors' code does with this config.json; "
            f"if the drafter was trained with the target's value{'s' if len(differ) > 1 else ''}, "
            f"add {adds} to its config.json")


def resolve_k(k: Optional[int], checkpoint: Union[str, os.PathLike]) -> int:
    """Draft tokens per round: ``k`` when given, else the DLite checkpoint's own K (from the
    ``config.json`` of the local ``checkpoint`` directory). The one default for K: the CLIs take
    ``--k`` defaulting to None and resolve it here. ``ValueError`` naming the fix."""
    if k is not None:
        return int(k)
    path = Path(os.path.expanduser(str(checkpoint))) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"k defaults to the DLite checkpoint's own K, read from {path}, which cannot be "
                         f"read ({type(exc).__name__}: {exc}): pass a local checkpoint directory, or k "
                         "(--k) explicitly") from None
    return DLiteConfig.from_checkpoint_config(raw).num_draft_tokens


def is_dlite_config(cfg: Any) -> bool:
    """Whether a ``config.json`` dict or an HF config object belongs to a DLite checkpoint (of any
    format; :meth:`DLiteConfig.from_checkpoint_config` then says whether it can be served). The one
    test for "is this a DLite checkpoint" in the package."""
    block = cfg.get("dlite_config") if isinstance(cfg, dict) else getattr(cfg, "dlite_config", None)
    return isinstance(block, dict)


def build_target_layer_ids(num_target_layers: int, num_layers: int) -> list[int]:
    """The authors' layer-id rule (``docs/dlite_v1.md`` §2): ``{0, N-1}`` plus
    ``1 + round(f_i * (N-3))`` for ``i = 0..L-3``, ``f_i = 0.5`` if ``L == 3`` else ``i/(L-3)``
    (Python's round: half to even), sorted. E.g. ``N=36, L=14 -> [0,1,4,7,...,31,34,35]``.
    Raises ``ValueError`` when the rule does not give ``L`` distinct ids."""
    N, L = num_target_layers, num_layers
    if isinstance(N, bool) or not isinstance(N, int) or N < 2:
        raise ValueError(f"num_target_layers must be an integer >= 2, got {N!r}")
    if isinstance(L, bool) or not isinstance(L, int) or not 2 <= L <= N:
        raise ValueError(
            f"chs_num_layers must be an integer in 2..{N} (the target's layer count), got {L!r}"
        )
    ids = {0, N - 1}
    for i in range(L - 2):
        f = 0.5 if L == 3 else i / (L - 3)
        ids.add(1 + round(f * (N - 3)))
    out = sorted(ids)
    if len(out) != L:
        raise ValueError(
            f"the layer-id rule gives {len(out)} distinct ids {out} for N={N}, L={L}, not {L}: "
            "choose another chs_num_layers"
        )
    return out


@dataclass(kw_only=True)
class DLiteConfig:
    """Everything the drafter needs (the checkpoint's ``config.json``, flattened)."""

    # draft backbone (Qwen3 decoder layers)
    hidden_size: int
    num_hidden_layers: int  # n: draft depth (paper: 5 for a 36-layer target)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: Optional[int] = None  # None -> hidden_size // num_attention_heads
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # RoPE on the local positions of one round
    rope_scaling: Optional[dict[str, Any]] = None  # HF rope_scaling (with rope_type); None = default
    max_position_embeddings: int = 32768  # read by the dynamic/yarn RoPE types only
    hidden_act: str = "silu"  # the MLP's activation: act(gate) * up (Qwen3: SwiGLU)
    attention_bias: bool = False
    vocab_size: int  # V: the target's vocabulary (the head's own [V, r] tables)
    # target coupling
    num_target_layers: int  # N
    target_layer_ids: list[int]  # = build_target_layer_ids(N, L), 0-based target layers
    # block layout
    block_size: int = 8  # B, counting the anchor: K = B-1 drafted tokens
    anchor_group_size: int = 1  # G: real tokens in the query (x_{a-G+1}..x_a)
    mask_token_id: int
    # sequential head (gated rank-r RNN)
    sequential_rank: int  # r

    def __post_init__(self) -> None:
        self.target_layer_ids = list(self.target_layer_ids)
        if (
            self.head_dim is None
            and isinstance(self.hidden_size, int)
            and isinstance(self.num_attention_heads, int)
            and self.num_attention_heads > 0
        ):
            self.head_dim = self.hidden_size // self.num_attention_heads

    # ------------------------------------------------------------------ derived
    @property
    def num_draft_tokens(self) -> int:
        """K = B - 1: tokens one round drafts (the most vLLM may verify)."""
        return self.block_size - 1

    @property
    def num_feature_layers(self) -> int:
        """L = chs_num_layers: target layers read per round."""
        return len(self.target_layer_ids)

    @property
    def aux_layer_ids(self) -> list[int]:
        """vLLM aux-hidden-state ids to serve: ``j + 1`` for each target layer id ``j`` (aux N
        is pre-norm; the drafter applies the target's final norm to it)."""
        return [j + 1 for j in self.target_layer_ids]

    # ------------------------------------------------------------------ validation
    def validate(self) -> "DLiteConfig":
        """Raise ``ValueError`` naming the first invalid field and the fix; return self."""

        def fail(name: str, problem: str, fix: str) -> None:
            raise ValueError(f"DLite config {name} = {getattr(self, name)!r} is invalid: {problem}; {fix}")

        def positive_int(name: str, fix: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(name, "it must be a positive integer", fix)

        positive_int("hidden_size", "set the draft width (the authors use the target's hidden_size)")
        positive_int("num_hidden_layers", "set the draft depth n (paper: 5 for a 36-layer target)")
        positive_int("num_attention_heads", "copy the target's num_attention_heads")
        positive_int("num_key_value_heads", "copy the target's num_key_value_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            fail("num_key_value_heads", f"it does not divide num_attention_heads "
                 f"({self.num_attention_heads}) (GQA)", "copy the target's head counts")
        positive_int("head_dim", "set an even head_dim (e.g. 128)")
        if self.head_dim % 2:
            fail("head_dim", "RoPE (rotate-half) needs an even head_dim", "use an even head_dim")
        positive_int("intermediate_size", "copy the target's intermediate_size")
        positive_int("vocab_size", "set it to the target's vocab_size")
        positive_int("sequential_rank", "set the head rank r >= 1 (paper: hidden_size / 8)")
        if self.block_size is None or isinstance(self.block_size, bool) or not isinstance(
            self.block_size, int
        ) or self.block_size < 2:
            fail("block_size", "it must be an integer >= 2 (it counts the anchor: K = B-1 drafts)",
                 "use e.g. 8 for K = 7")
        positive_int("anchor_group_size", "use 1 (anchor only) or 2 (x_{a-1} and the anchor)")
        if not isinstance(self.attention_bias, bool):
            fail("attention_bias", "it must be a bool", "use false (Qwen3)")
        if not isinstance(self.rms_norm_eps, (int, float)) or not self.rms_norm_eps > 0:
            fail("rms_norm_eps", "it must be > 0", "copy the target's rms_norm_eps")
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) \
                or not self.rope_theta > 0:
            fail("rope_theta", "it must be > 0", "copy the target's rope_theta")
        if self.hidden_act not in ACTIVATIONS:
            fail("hidden_act", f"the draft MLP applies one of {list(ACTIVATIONS)}",
                 "use the activation the drafter was trained with (Qwen3: 'silu')")
        positive_int("max_position_embeddings", "copy the target's max_position_embeddings")
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            kind = rs.get("rope_type", rs.get("type")) if isinstance(rs, dict) else None
            if kind == "longrope":
                fail("rope_scaling", "longrope (Phi-3's per-dimension factors) is not implemented "
                     "in vllm-dlite (Qwen3 extends its context with 'yarn')",
                     "remove rope_scaling or use a drafter trained with default or yarn RoPE")
            if kind not in ROPE_TYPES:
                fail("rope_scaling", f"its rope_type must be one of {list(ROPE_TYPES)} (the types "
                     "transformers 4.57 applies)", "copy the rope_scaling the drafter was trained with")
            absent = [k for k in ROPE_TYPES[kind] if rs.get(k) is None]
            if absent:
                fail("rope_scaling", f"rope_type {kind!r} needs {absent}",
                     "copy the rope_scaling the drafter was trained with")
            if kind != "default" and not (isinstance(rs["factor"], (int, float)) and rs["factor"] > 0):
                fail("rope_scaling", "its factor must be a number > 0",
                     "copy the rope_scaling the drafter was trained with")
        n = self.num_target_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            fail("num_target_layers", "it must be an integer >= 2", "set the target's num_hidden_layers")
        ids = self.target_layer_ids
        if len(ids) < 2 or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            fail("target_layer_ids", "it must be a list of at least 2 integers",
                 f"use build_target_layer_ids({n}, L)")
        if len(ids) > n:
            fail("target_layer_ids", f"it lists {len(ids)} layers but the target has {n}",
                 f"use build_target_layer_ids({n}, L) with L <= {n}")
        expected = build_target_layer_ids(n, len(ids))
        if ids != expected:
            fail("target_layer_ids", f"dlite_v1 requires the authors' layer-id rule, which gives "
                 f"{expected} for N={n}, L={len(ids)}", f"set target_layer_ids to {expected}")
        if (isinstance(self.mask_token_id, bool) or not isinstance(self.mask_token_id, int)
                or not 0 <= self.mask_token_id < self.vocab_size):
            fail("mask_token_id", f"it must be a token id in 0..{self.vocab_size - 1} (a row of the "
                 "target's embedding)", "use a reserved token of the target's tokenizer")
        return self

    def check_target(self, *, hidden_size: Optional[int], vocab_size: Optional[int],
                     num_layers: Optional[int], where: str = "the target") -> None:
        """Raise ``ValueError`` (naming the fix) unless this drafter fits the target's sizes.
        ``None`` skips a check. ``vocab_size`` may be the target's padded vocabulary (>= V)."""
        fix = "use a DLite drafter trained for this target (or serve the target it was trained for)"
        if hidden_size is not None and hidden_size != self.hidden_size:
            raise ValueError(f"the DLite drafter has hidden_size={self.hidden_size} but {where} has "
                             f"hidden_size={hidden_size} (dlite_v1 reads the target's features and "
                             f"embedding at the draft width): {fix}")
        if vocab_size is not None and vocab_size != self.vocab_size:
            raise ValueError(f"the DLite drafter has vocab_size={self.vocab_size} but {where} has "
                             f"vocab_size={vocab_size}: {fix}")
        if num_layers is not None and num_layers != self.num_target_layers:
            raise ValueError(f"the DLite drafter was trained for num_target_layers="
                             f"{self.num_target_layers} (layer ids {self.target_layer_ids}) but "
                             f"{where} has {num_layers} layers: {fix}")

    # ------------------------------------------------------------------ checkpoint config.json
    @classmethod
    def from_checkpoint_config(cls, cfg: dict[str, Any]) -> "DLiteConfig":
        """Read (and validate) a checkpoint's ``config.json`` dict in the authors' layout."""
        if not isinstance(cfg, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(cfg).__name__}")
        if not is_dlite_config(cfg):
            raise ValueError("config.json has no 'dlite_config' object: not a DLite checkpoint "
                             "(a dlite_v1 checkpoint has dlite_config.architecture_version = "
                             f"'{ARCHITECTURE_VERSION}')")
        block = cfg["dlite_config"]
        version = block.get("architecture_version")
        if version is None and any(k in block for k in _OLD_FORMAT_KEYS):
            raise ValueError(f"config.json is in the old vllm-dlite format: {_FIX_OLD}")
        if version != ARCHITECTURE_VERSION:
            raise ValueError(f"dlite_config.architecture_version = {version!r} is not supported: "
                             f"this vllm-dlite serves '{ARCHITECTURE_VERSION}' checkpoints; use a "
                             f"'{ARCHITECTURE_VERSION}' checkpoint or a vllm-dlite release that "
                             "supports this version")
        role = str(block.get("model_role", "")).lower()
        if role != MODEL_ROLE:
            raise ValueError(f"dlite_config.model_role = {block.get('model_role')!r}: only "
                             f"'{MODEL_ROLE}' (the drafter) can be served; the teacher is a "
                             "training-time model")
        head = str(block.get("sequential_head", "")).lower()
        if head != SEQUENTIAL_HEAD:
            raise ValueError(f"dlite_config.sequential_head = {block.get('sequential_head')!r}: "
                             f"only '{SEQUENTIAL_HEAD}' (the gated low-rank RNN head) is defined")
        missing = [k for k in ("anchor_group_size", "chs_num_layers", "target_layer_ids",
                               "sequential_rank") if k not in block]
        # the two custom top-level keys have no default in the authors' code (it reads them as
        # config attributes); every Qwen3 key has one (QWEN3_CONFIG_DEFAULTS)
        missing += [k for k in ("num_target_layers", "block_size") if k not in cfg]
        if missing:
            raise ValueError(f"config.json lacks the dlite_v1 keys {missing}; re-export the "
                             "checkpoint with vllm_dlite.model.save_pretrained")
        mask = block.get("mask_token_id", cfg.get("mask_token_id"))
        if mask is None:
            raise ValueError("config.json has no mask_token_id (in dlite_config or at top level): "
                             "add the target tokenizer's mask token id to dlite_config")
        if block["chs_num_layers"] != len(block["target_layer_ids"] or []):
            raise ValueError(f"dlite_config.chs_num_layers = {block['chs_num_layers']} but "
                             f"target_layer_ids has {len(block['target_layer_ids'] or [])} ids: "
                             "make them agree (target_layer_ids = build_target_layer_ids(N, L))")
        # a Qwen3 key left out means the authors' (transformers 4.57 Qwen3Config) default
        qwen3 = {k: cfg.get(k, default) for k, default in QWEN3_CONFIG_DEFAULTS.items()}
        theta, scaling = _rope_fields(cfg)
        if theta is None and "rope_theta" not in cfg:
            theta = QWEN3_CONFIG_DEFAULTS["rope_theta"]
        for key in ("head_dim", "rope_theta", "rms_norm_eps", "hidden_act", "hidden_size",
                    "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
            if key == "rope_theta" and theta is not None:
                continue  # null at top level, given in transformers 5's rope_parameters
            if key in cfg and cfg[key] is None:
                raise ValueError(f"config.json sets {key} to null, which the authors' code cannot "
                                 f"run with: set {key} (remove it for the authors' default "
                                 f"{QWEN3_CONFIG_DEFAULTS[key]!r})")
        if qwen3["num_key_value_heads"] is None:  # Qwen3Config: explicit null -> the query heads
            qwen3["num_key_value_heads"] = qwen3["num_attention_heads"]
        factor = cfg.get("partial_rotary_factor")
        if factor is not None and factor != 1.0:
            raise ValueError(f"config.json sets partial_rotary_factor = {factor!r}: Qwen3 rotates "
                             "the whole head_dim (the authors' attention fails on a partial "
                             "rotary table); remove partial_rotary_factor")
        config = cls(
            hidden_size=qwen3["hidden_size"],
            num_hidden_layers=qwen3["num_hidden_layers"],
            num_attention_heads=qwen3["num_attention_heads"],
            num_key_value_heads=qwen3["num_key_value_heads"],
            head_dim=qwen3["head_dim"],
            intermediate_size=qwen3["intermediate_size"],
            rms_norm_eps=qwen3["rms_norm_eps"],
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=qwen3["max_position_embeddings"],
            hidden_act=qwen3["hidden_act"],
            attention_bias=bool(qwen3["attention_bias"]),
            vocab_size=qwen3["vocab_size"],
            num_target_layers=cfg["num_target_layers"],
            target_layer_ids=block["target_layer_ids"],
            block_size=cfg["block_size"],
            anchor_group_size=block["anchor_group_size"],
            mask_token_id=mask,
            sequential_rank=block["sequential_rank"],
        ).validate()
        config._check_sliding_window(cfg)
        return config

    def _check_sliding_window(self, cfg: dict[str, Any]) -> None:
        """Refuse a sliding window that would cut one round's keys. The authors' Qwen3Config makes
        layer i a sliding layer when ``use_sliding_window`` and i >= ``max_window_layers`` (or as
        ``layer_types`` says); their attention then passes ``sliding_window`` on, which only
        FlashAttention-2 applies (a two-sided band) while SDPA ignores it. A window at least one
        round's keys (L + G + K) long changes nothing in either, so it is accepted."""
        n = self.num_hidden_layers
        window = cfg.get("sliding_window", QWEN3_CONFIG_DEFAULTS["sliding_window"]) \
            if cfg.get("use_sliding_window", False) else None
        types = cfg.get("layer_types")
        if types is not None:
            if not isinstance(types, list) or len(types) != n or not all(
                    t in ("full_attention", "sliding_attention") for t in types):
                raise ValueError(f"config.json layer_types = {types!r} must list 'full_attention' "
                                 f"or 'sliding_attention' for each of the {n} draft layers (as the "
                                 "authors' Qwen3Config requires): fix or remove layer_types")
        else:
            first = cfg.get("max_window_layers", QWEN3_CONFIG_DEFAULTS["max_window_layers"])
            types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                     for i in range(n)]
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        keys = self.num_feature_layers + self.anchor_group_size + self.num_draft_tokens
        if window is not None and sliding and window < keys:
            raise ValueError(
                f"config.json makes draft layers {sliding} sliding-window layers with sliding_window "
                f"= {window}, shorter than one round's {keys} keys (L + G + K): the authors' code "
                "applies such a window only under FlashAttention-2 and ignores it under SDPA, so "
                "the drafts it was trained for are not defined by the config; set "
                f"use_sliding_window to false (or sliding_window >= {keys})")

    def to_checkpoint_config(self, target_hf_config: Optional[dict[str, Any]] = None,
                             torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """The checkpoint's ``config.json`` dict in the authors' layout (a copy of the target's
        config with the draft fields changed, as their training builder writes it)."""
        self.validate()
        base = {k: v for k, v in (target_hf_config or {}).items()
                if k not in ("architectures", "auto_map", "layer_types", "rope_parameters",
                             "transformers_version", "dtype", "torch_dtype", "dlite_config")}
        base.update(
            architectures=[CHECKPOINT_ARCHITECTURE],
            model_type=base.get("model_type", "qwen3"),
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            hidden_act=self.hidden_act,
            attention_bias=self.attention_bias,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None,
            use_sliding_window=False,
            sliding_window=None,
            vocab_size=self.vocab_size,
            num_target_layers=self.num_target_layers,
            block_size=self.block_size,
            torch_dtype=torch_dtype,
            dlite_config={
                "architecture_version": ARCHITECTURE_VERSION,
                "model_role": MODEL_ROLE,
                "anchor_group_size": self.anchor_group_size,
                "chs_num_layers": self.num_feature_layers,
                "target_layer_ids": list(self.target_layer_ids),
                "sequential_head": SEQUENTIAL_HEAD,
                "sequential_rank": self.sequential_rank,
                "mask_token_id": self.mask_token_id,
            },
        )
        if self.rope_scaling:  # the scaled RoPE types read it
            base["max_position_embeddings"] = self.max_position_embeddings
        base.setdefault("max_position_embeddings", self.max_position_embeddings)
        return base

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def for_target(cls, target_hf_config: dict[str, Any], *, num_feature_layers: int,
                   mask_token_id: int, **overrides: Any) -> "DLiteConfig":
        """Default drafter for a Qwen3 target with the authors' sizing: width, heads, MLP, eps,
        RoPE (theta, scaling), activation and vocab copied, as the authors' training builder
        copies the target's config; depth ``round(0.14 N)`` (>= 1); rank ``hidden_size // 8``;
        ``L`` layers by :func:`build_target_layer_ids`; B = 8, G = 1. Any field may be overridden.
        A key the target's config leaves out means the Qwen3Config default
        (:data:`QWEN3_CONFIG_DEFAULTS`), as it does for the target itself."""
        t = target_hf_config
        d = QWEN3_CONFIG_DEFAULTS
        n = t["num_hidden_layers"]
        theta, scaling = _rope_fields(t)
        kv = t.get("num_key_value_heads", d["num_key_value_heads"])
        values: dict[str, Any] = dict(
            hidden_size=t["hidden_size"],
            num_hidden_layers=max(1, round(0.14 * n)),
            num_attention_heads=t["num_attention_heads"],
            num_key_value_heads=t["num_attention_heads"] if kv is None else kv,
            head_dim=t.get("head_dim", d["head_dim"]),
            intermediate_size=t["intermediate_size"],
            rms_norm_eps=t.get("rms_norm_eps", d["rms_norm_eps"]),
            rope_theta=float(d["rope_theta"] if theta is None else theta),
            rope_scaling=scaling,
            max_position_embeddings=t.get("max_position_embeddings") or d["max_position_embeddings"],
            hidden_act=t.get("hidden_act") or d["hidden_act"],
            vocab_size=t["vocab_size"],
            num_target_layers=n,
            target_layer_ids=build_target_layer_ids(n, num_feature_layers),
            mask_token_id=mask_token_id,
            sequential_rank=max(1, t["hidden_size"] // 8),
        )
        values.update(overrides)
        return cls(**values).validate()


__all__ = [
    "ARCHITECTURE_VERSION",
    "CHECKPOINT_ARCHITECTURE",
    "DRAFT_ARCHITECTURE",
    "ACTIVATIONS",
    "GREEDY_EPS",
    "QWEN3_CONFIG_DEFAULTS",
    "ROPE_TYPES",
    "DLiteConfig",
    "authors_defaults_taken",
    "target_default_warning",
    "build_target_layer_ids",
    "is_dlite_config",
    "resolve_k",
]
