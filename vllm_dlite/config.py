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
* ``target_layer_ids`` are the authors' ids: 0-based decoder layers of the target, chosen by
  :func:`build_target_layer_ids` (and required to equal it). Id ``j`` is the residual stream after
  ``j+1`` layers, i.e. **vLLM aux id j+1**; the last id ``N-1`` is taken **after the target's final
  norm** (the drafter applies that norm to vLLM's pre-norm aux id N). :attr:`aux_layer_ids` gives
  the ids vLLM must serve.
* ``K`` (:attr:`DLiteConfig.num_draft_tokens` = B-1) is the number of tokens one round drafts; it
  is the one name for that number in this package (vLLM calls it ``num_speculative_tokens``).
* Every check raises ``ValueError`` with ONE message naming the field and the fix. Checkpoints in
  the earlier vllm-dlite format (before ``dlite_v1``) are refused with a message saying so.

No vLLM or torch import here: this module is safe to import anywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

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


def is_dlite_config(cfg: Any) -> bool:
    """Whether a ``config.json`` dict or an HF config object belongs to a DLite checkpoint (of any
    format; :meth:`DLiteConfig.from_checkpoint_config` then says whether it can be served). The one
    test for "is this a DLite checkpoint" in the package."""
    block = cfg.get("dlite_config") if isinstance(cfg, dict) else getattr(cfg, "dlite_config", None)
    return isinstance(block, dict)


def build_target_layer_ids(num_target_layers: int, num_layers: int) -> list[int]:
    """The authors' layer-id rule (DLITE_V1.md section 2): ``{0, N-1}`` plus
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
        if not isinstance(self.rope_theta, (int, float)) or not self.rope_theta > 0:
            fail("rope_theta", "it must be > 0", "copy the target's rope_theta")
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
        missing += [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                "intermediate_size", "vocab_size", "num_target_layers",
                                "block_size") if k not in cfg]
        if missing:
            raise ValueError(f"config.json lacks the dlite_v1 keys {missing}; re-export the "
                             "checkpoint with DLiteDrafter.save_pretrained")
        mask = block.get("mask_token_id", cfg.get("mask_token_id"))
        if mask is None:
            raise ValueError("config.json has no mask_token_id (in dlite_config or at top level): "
                             "add the target tokenizer's mask token id to dlite_config")
        if block["chs_num_layers"] != len(block["target_layer_ids"] or []):
            raise ValueError(f"dlite_config.chs_num_layers = {block['chs_num_layers']} but "
                             f"target_layer_ids has {len(block['target_layer_ids'] or [])} ids: "
                             "make them agree (target_layer_ids = build_target_layer_ids(N, L))")
        scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
        if rope_type not in (None, "default"):
            raise ValueError(f"config.json asks for RoPE scaling {rope_type!r}: DLite's local "
                             "positions stay below 64, so only default RoPE is supported; remove "
                             "rope_scaling from the draft config")
        theta = cfg.get("rope_theta")
        if theta is None and isinstance(cfg.get("rope_parameters"), dict):
            theta = cfg["rope_parameters"].get("rope_theta")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        config = cls(
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim"),
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=1_000_000.0 if theta is None else theta,
            attention_bias=bool(cfg.get("attention_bias", False)),
            vocab_size=cfg["vocab_size"],
            num_target_layers=cfg["num_target_layers"],
            target_layer_ids=block["target_layer_ids"],
            block_size=cfg["block_size"],
            anchor_group_size=block["anchor_group_size"],
            mask_token_id=mask,
            sequential_rank=block["sequential_rank"],
        ).validate()
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act = {cfg['hidden_act']!r}: the Qwen3 draft "
                             "layers use SwiGLU ('silu')")
        if window is not None and window < config.num_feature_layers + config.anchor_group_size + config.num_draft_tokens:
            raise ValueError(f"config.json sets sliding_window = {window}, smaller than one round's "
                             "context + query: set use_sliding_window to false")
        return config

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
            hidden_act="silu",
            attention_bias=self.attention_bias,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=None,
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
        base.setdefault("max_position_embeddings", 32768)
        return base

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def for_target(cls, target_hf_config: dict[str, Any], *, num_feature_layers: int,
                   mask_token_id: int, **overrides: Any) -> "DLiteConfig":
        """Default drafter for a Qwen3 target with the authors' sizing: width, heads, MLP, eps,
        rope_theta and vocab copied; depth ``round(0.14 N)`` (>= 1); rank ``hidden_size // 8``;
        ``L`` layers by :func:`build_target_layer_ids`; B = 8, G = 1. Any field may be overridden."""
        t = target_hf_config
        n = t["num_hidden_layers"]
        theta = t.get("rope_theta") or (t.get("rope_parameters") or {}).get("rope_theta") or 1_000_000.0
        values: dict[str, Any] = dict(
            hidden_size=t["hidden_size"],
            num_hidden_layers=max(1, round(0.14 * n)),
            num_attention_heads=t["num_attention_heads"],
            num_key_value_heads=t.get("num_key_value_heads", t["num_attention_heads"]),
            head_dim=t.get("head_dim"),
            intermediate_size=t["intermediate_size"],
            rms_norm_eps=t.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
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
    "GREEDY_EPS",
    "DLiteConfig",
    "build_target_layer_ids",
    "is_dlite_config",
]
