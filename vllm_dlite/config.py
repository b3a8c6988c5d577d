"""The ``dlite_config`` block of a DLite draft checkpoint.

Contract
--------
* :class:`DLiteConfig` holds every hyper-parameter the drafter needs (and nothing about training).
  It is stored verbatim as the ``dlite_config`` block of the checkpoint's ``config.json``; that
  block is the source of truth when loading (the HF-style top-level fields are derived from it).
* ``validate()`` raises ``ValueError`` with ONE message naming the offending field and the fix.
  Construction does not validate (so tests and tools can build partial configs); every consumer
  (``from_dict``, the drafter, the loader) does.
* ``target_layer_ids`` use vLLM's aux-hidden-state ids: id ``i`` is the residual stream after ``i``
  decoder layers, before the final norm (0 = embedding output, N = after the last layer, pre-norm).
  They must be strictly increasing because vLLM sorts and de-duplicates aux ids: the drafter's
  feature ``l`` is the target layer ``target_layer_ids[l]``.
* :func:`make_checkpoint_config` builds the full HF-style ``config.json`` dict
  (``architectures: ["DFlashDLiteDraftModel"]``, ``eagle_aux_hidden_state_layer_ids`` = the layer
  ids as-is, ``mask_token_id``, ...); :meth:`DLiteConfig.from_checkpoint_config` reads it back.

No vLLM or torch import here: this module is safe to import anywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Optional

DRAFT_ARCHITECTURE = "DFlashDLiteDraftModel"
FEATURE_MODES = ("sequence", "feature")


def select_target_layers(num_target_layers: int, num_selected: int) -> list[int]:
    """Pick ``num_selected`` vLLM aux layer ids among ``1..num_target_layers``.

    Rule (paper: "first and last always, the rest evenly spaced"):
    ``round(linspace(1, N, L))``, de-duplicated and sorted. Rounding is Python's ``round`` on exact
    fractions (half to even, no float noise), e.g. ``N=12, L=6 -> [1, 3, 5, 8, 10, 12]``.
    ``L == N`` selects every layer; ``L == 1`` selects the last layer only.
    """
    if not isinstance(num_target_layers, int) or num_target_layers < 1:
        raise ValueError(
            f"num_target_layers must be a positive integer (got {num_target_layers!r}): pass the "
            "target's num_hidden_layers"
        )
    if not isinstance(num_selected, int) or not 1 <= num_selected <= num_target_layers:
        raise ValueError(
            f"num_selected must be in 1..{num_target_layers} (got {num_selected!r}): a target with "
            f"{num_target_layers} layers offers at most {num_target_layers} distinct features"
        )
    if num_selected == 1:
        return [num_target_layers]
    step = Fraction(num_target_layers - 1, num_selected - 1)
    return sorted({round(1 + i * step) for i in range(num_selected)})


@dataclass(kw_only=True)
class DLiteConfig:
    """Hyper-parameters of a DLite drafter (= the ``dlite_config`` block of a checkpoint)."""

    # Which target features the drafter reads (vLLM aux ids, strictly increasing).
    target_layer_ids: list[int]
    # Draft backbone (Qwen3-style layers).
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: Optional[int] = None  # None -> hidden_size // num_attention_heads
    num_layers: int = 2  # draft depth (paper: 5 for a 36-layer target, ~14%)
    block_size: int = 7  # K = num_speculative_tokens
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # RoPE on LOCAL positions 0..K only
    # Low-rank sequential head (paper: rank 320 for width 2560, 512 for width 4096).
    head_rank: int
    # Feature input: "sequence" = one element per target layer (paper), "feature" = the L layer
    # vectors concatenated along the feature dim and projected to ONE element (ablation).
    feature_mode: str = "sequence"
    depth_embedding: bool = True  # learned e_depth[l] added to each feature element
    feature_norm: bool = True  # per-layer RMSNorm norm_l on the raw target features
    # Parallel drafting placeholder token (a token id of the target's vocabulary).
    mask_token_id: int
    # The target this drafter serves.
    target_name: str = ""
    target_hidden_size: int
    target_vocab_size: int
    target_num_layers: int

    def __post_init__(self) -> None:
        self.target_layer_ids = list(self.target_layer_ids)
        if (
            self.head_dim is None
            and isinstance(self.hidden_size, int)
            and isinstance(self.num_attention_heads, int)
            and self.num_attention_heads > 0
            and self.hidden_size % self.num_attention_heads == 0
        ):
            self.head_dim = self.hidden_size // self.num_attention_heads

    # ------------------------------------------------------------------ derived sizes
    @property
    def num_feature_layers(self) -> int:
        """L: number of target layers read."""
        return len(self.target_layer_ids)

    @property
    def num_feature_elements(self) -> int:
        """Context elements per round: L in "sequence" mode, 1 in "feature" mode."""
        return self.num_feature_layers if self.feature_mode == "sequence" else 1

    # ------------------------------------------------------------------ validation
    def validate(self) -> "DLiteConfig":
        """Raise ``ValueError`` naming the first invalid field and how to fix it; return self."""

        def fail(name: str, problem: str, fix: str) -> None:
            raise ValueError(
                f"DLiteConfig.{name} = {getattr(self, name)!r} is invalid: {problem}; {fix}"
            )

        def positive_int(name: str, fix: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(name, "it must be a positive integer", fix)

        positive_int("target_num_layers", "set it to the target's num_hidden_layers")
        ids = self.target_layer_ids
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            fail(
                "target_layer_ids",
                "it must be a non-empty list of integers",
                "use select_target_layers(target_num_layers, L)",
            )
        bad = [i for i in ids if not 0 <= i <= self.target_num_layers]
        if bad:
            fail(
                "target_layer_ids",
                f"ids {bad} are outside 0..{self.target_num_layers} (vLLM aux id i = residual "
                f"stream after i layers; the target has {self.target_num_layers})",
                f"keep ids within 0..{self.target_num_layers}, e.g. "
                f"select_target_layers({self.target_num_layers}, {len(ids)})",
            )
        if any(a >= b for a, b in zip(ids[:-1], ids[1:], strict=True)):
            fail(
                "target_layer_ids",
                "ids must be strictly increasing (vLLM sorts and de-duplicates aux layer ids, "
                "so feature l must be the l-th smallest id)",
                f"use {sorted(set(ids))}",
            )
        positive_int("block_size", "set it to num_speculative_tokens (paper: 7)")
        positive_int("num_layers", "set the draft depth (paper: ~14% of the target's layers)")
        positive_int("hidden_size", "set the draft width (paper: the target's hidden_size)")
        positive_int("num_attention_heads", "set it to e.g. the target's num_attention_heads")
        positive_int("num_key_value_heads", "set it to e.g. the target's num_key_value_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            fail(
                "num_key_value_heads",
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of it (GQA)",
                "choose num_key_value_heads dividing num_attention_heads",
            )
        if self.head_dim is None:
            fail(
                "head_dim",
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}), so it cannot be derived",
                "set head_dim explicitly or change num_attention_heads",
            )
        positive_int("head_dim", "set a positive even head_dim (e.g. 128)")
        if self.head_dim % 2:
            fail("head_dim", "RoPE (rotate-half) needs an even head_dim", "use an even head_dim")
        positive_int("intermediate_size", "set the SwiGLU width (e.g. the target's)")
        positive_int(
            "head_rank",
            "the sequential head needs a rank-r state, r >= 1 (paper: hidden_size/8, 320 or 512)",
        )
        if self.feature_mode not in FEATURE_MODES:
            fail(
                "feature_mode",
                f"unknown mode (known: {', '.join(FEATURE_MODES)})",
                'use "sequence" (one element per target layer, the paper\'s choice) or "feature"',
            )
        for flag in ("depth_embedding", "feature_norm"):
            if not isinstance(getattr(self, flag), bool):
                fail(flag, "it must be a bool", "use true or false")
        positive_int("target_hidden_size", "set it to the target's hidden_size")
        positive_int("target_vocab_size", "set it to the target's vocab_size")
        if (
            isinstance(self.mask_token_id, bool)
            or not isinstance(self.mask_token_id, int)
            or not 0 <= self.mask_token_id < self.target_vocab_size
        ):
            fail(
                "mask_token_id",
                f"it must be a token id in 0..{self.target_vocab_size - 1}",
                "use a reserved/unused token of the target's tokenizer as the placeholder",
            )
        if not isinstance(self.rms_norm_eps, (int, float)) or not self.rms_norm_eps > 0:
            fail("rms_norm_eps", "it must be > 0", "use e.g. 1e-6")
        if not isinstance(self.rope_theta, (int, float)) or not self.rope_theta > 0:
            fail("rope_theta", "it must be > 0", "use e.g. 10000.0")
        if not isinstance(self.target_name, str):
            fail("target_name", "it must be a string", "use the target's model name or path")
        return self

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DLiteConfig":
        """Build and validate; unknown or missing keys raise ``ValueError`` listing them."""
        if not isinstance(data, dict):
            raise ValueError(f"dlite_config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"dlite_config has unknown keys {unknown}; known keys are {sorted(known)} "
                "(remove them, or upgrade vllm-dlite if the checkpoint is newer)"
            )
        required = {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"dlite_config is missing required keys {missing}")
        return cls(**data).validate()

    @classmethod
    def from_checkpoint_config(cls, cfg: dict[str, Any]) -> "DLiteConfig":
        """Read the ``dlite_config`` block of a checkpoint's ``config.json`` dict."""
        if not isinstance(cfg, dict) or "dlite_config" not in cfg:
            raise ValueError(
                "config has no 'dlite_config' block: not a DLite checkpoint (DLite checkpoints are "
                "written by DLiteDrafter.save_pretrained)"
            )
        return cls.from_dict(cfg["dlite_config"])

    @classmethod
    def for_target(
        cls,
        target_hf_config: dict[str, Any],
        *,
        num_feature_layers: int,
        mask_token_id: int,
        target_name: str = "",
        **overrides: Any,
    ) -> "DLiteConfig":
        """Default config for a Qwen3-style target (paper's sizing rules), validated.

        Width, heads and MLP copy the target; depth ~14% of the target's layers (>= 1);
        head rank = hidden_size // 8 (paper: 320 for 2560, 512 for 4096); layers chosen by
        :func:`select_target_layers`. Any field can be overridden by keyword.
        """
        t = target_hf_config
        n = t["num_hidden_layers"]
        hidden = overrides.pop("hidden_size", t["hidden_size"])
        values: dict[str, Any] = dict(
            target_layer_ids=select_target_layers(n, num_feature_layers),
            hidden_size=hidden,
            num_attention_heads=t["num_attention_heads"],
            num_key_value_heads=t.get("num_key_value_heads", t["num_attention_heads"]),
            head_dim=t.get("head_dim"),
            intermediate_size=t["intermediate_size"],
            num_layers=max(1, round(0.14 * n)),
            rms_norm_eps=t.get("rms_norm_eps", 1e-6),
            head_rank=max(1, hidden // 8),
            mask_token_id=mask_token_id,
            target_name=target_name,
            target_hidden_size=t["hidden_size"],
            target_vocab_size=t["vocab_size"],
            target_num_layers=n,
        )
        values.update(overrides)
        return cls(**values).validate()


def make_checkpoint_config(
    dlite: DLiteConfig, target_hf_config: dict[str, Any], torch_dtype: Optional[str] = None
) -> dict[str, Any]:
    """Full HF-style ``config.json`` dict of a DLite draft checkpoint.

    ``target_hf_config`` is the target's ``config.json`` dict; its size fields must agree with the
    ``target_*`` fields of ``dlite``. ``torch_dtype`` names the dtype of the stored weights
    (default: the target's).
    """
    dlite.validate()
    t = target_hf_config
    for dlite_field, hf_key in (
        ("target_hidden_size", "hidden_size"),
        ("target_vocab_size", "vocab_size"),
        ("target_num_layers", "num_hidden_layers"),
    ):
        if hf_key in t and t[hf_key] != getattr(dlite, dlite_field):
            raise ValueError(
                f"DLiteConfig.{dlite_field} = {getattr(dlite, dlite_field)} does not match the "
                f"target config's {hf_key} = {t[hf_key]}: the drafter was built for another "
                "target; pass that target's config (or rebuild the DLiteConfig for this one)"
            )
    return {
        "architectures": [DRAFT_ARCHITECTURE],
        "model_type": t.get("model_type", "qwen3"),
        "hidden_size": dlite.hidden_size,
        "num_hidden_layers": dlite.num_layers,
        "num_attention_heads": dlite.num_attention_heads,
        "num_key_value_heads": dlite.num_key_value_heads,
        "head_dim": dlite.head_dim,
        "intermediate_size": dlite.intermediate_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "vocab_size": dlite.target_vocab_size,
        "max_position_embeddings": t.get("max_position_embeddings", 32768),
        "rms_norm_eps": dlite.rms_norm_eps,
        "rope_theta": dlite.rope_theta,
        "tie_word_embeddings": bool(t.get("tie_word_embeddings", False)),
        "torch_dtype": torch_dtype or t.get("torch_dtype") or t.get("dtype") or "bfloat16",
        "mask_token_id": dlite.mask_token_id,
        "eagle_aux_hidden_state_layer_ids": list(dlite.target_layer_ids),
        "block_size": dlite.block_size,
        "dlite_config": dlite.to_dict(),
    }


__all__ = [
    "DRAFT_ARCHITECTURE",
    "FEATURE_MODES",
    "DLiteConfig",
    "make_checkpoint_config",
    "select_target_layers",
]
