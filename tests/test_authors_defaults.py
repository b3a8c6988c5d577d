"""A drafter config.json that leaves keys out means what it means in the authors' code (issue 36).

The authors' config class is transformers 4.57's ``Qwen3Config`` (``docs/dlite_v1.md`` §1.1): a key left
out takes that class's default, not the target's value and not a value derived from other keys.
``rope_scaling`` and ``hidden_act`` are applied as transformers applies them; a sliding window
that would cut one round's keys is refused (the authors' code applies it only under
FlashAttention-2). Where the model changes, it is compared bit for bit with transformers' own
modules (``Qwen3RotaryEmbedding``, ``ACT2FN``) built from the same config.
"""

from __future__ import annotations

import copy
import json
import logging
import types

import pytest
import torch

from vllm_dlite.config import (
    ACTIVATIONS,
    QWEN3_CONFIG_DEFAULTS,
    DLiteConfig,
    authors_defaults_taken,
    build_target_layer_ids,
    target_default_warning,
)
from vllm_dlite.model import CheckpointError, DLiteDrafter, check_checkpoint, load_drafter, save_pretrained

N, L, V, H = 6, 4, 97, 64


def full_config(**top) -> dict:
    """A complete small config.json in the authors' layout (every Qwen3 key present)."""
    cfg = {"architectures": ["DLiteDraftModel"], "model_type": "qwen3", "hidden_size": H,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5,
           "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960,
           "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
           "max_window_layers": 28, "vocab_size": V, "num_target_layers": N, "block_size": 5,
           "dlite_config": {"architecture_version": "dlite_v1", "model_role": "pivot_q_student",
                            "anchor_group_size": 1, "chs_num_layers": L,
                            "target_layer_ids": build_target_layer_ids(N, L), "sequential_head": "rnn",
                            "sequential_rank": 8, "mask_token_id": 3}}
    cfg.update(top)
    return cfg


def without(key: str, **top) -> dict:
    cfg = full_config(**top)
    del cfg[key]
    return cfg


# =========================================================================== the defaults
def test_default_table_is_transformers_qwen3config():
    """QWEN3_CONFIG_DEFAULTS = the Qwen3Config defaults (4.57.1, read from its wheel; the installed
    transformers gives the same values for every key both versions have)."""
    from transformers import Qwen3Config

    hf = Qwen3Config()
    for key, value in QWEN3_CONFIG_DEFAULTS.items():
        if key in ("rope_theta", "rope_scaling", "sliding_window", "layer_types"):
            continue  # stored differently by transformers 5 (rope_parameters; window only when used)
        assert getattr(hf, key) == value, key
    assert hf.rope_parameters["rope_theta"] == QWEN3_CONFIG_DEFAULTS["rope_theta"] == 10000.0
    assert hf.rope_parameters["rope_type"] == "default" and QWEN3_CONFIG_DEFAULTS["rope_scaling"] is None


@pytest.mark.parametrize("key, field, expected", [
    ("rope_theta", "rope_theta", 10000.0),  # not 1e6 (the target's), not the dataclass default
    ("head_dim", "head_dim", 128),  # not hidden_size / heads (= 16 here)
    ("num_key_value_heads", "num_key_value_heads", 32),  # not the query heads (4 here)
    ("rms_norm_eps", "rms_norm_eps", 1e-6),
    ("hidden_act", "hidden_act", "silu"),
    ("attention_bias", "attention_bias", False),
    ("max_position_embeddings", "max_position_embeddings", 32768),
    ("rope_scaling", "rope_scaling", None),
    ("vocab_size", "vocab_size", 151936),
    ("hidden_size", "hidden_size", 4096),
    ("intermediate_size", "intermediate_size", 22016),
    ("num_hidden_layers", "num_hidden_layers", 32),
])
def test_a_left_out_key_takes_the_authors_default(key, field, expected):
    cfg = without(key, **({"num_attention_heads": 32} if key == "num_key_value_heads" else {}))
    config = DLiteConfig.from_checkpoint_config(cfg)
    assert getattr(config, field) == expected
    assert authors_defaults_taken(cfg)[key] == expected


def test_num_attention_heads_left_out_is_32():
    config = DLiteConfig.from_checkpoint_config(without("num_attention_heads"))
    assert config.num_attention_heads == 32 and config.num_key_value_heads == 2


def test_null_num_key_value_heads_means_the_query_heads():
    """Qwen3Config's backward-compatibility rule: an explicit null (not an absent key) is MHA."""
    assert DLiteConfig.from_checkpoint_config(full_config(num_key_value_heads=None)).num_key_value_heads == 4


def test_transformers5_rope_parameters_carry_theta_and_scaling():
    cfg = without("rope_theta")
    del cfg["rope_scaling"]
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 2.0,
                              "original_max_position_embeddings": 20480}
    config = DLiteConfig.from_checkpoint_config(cfg)
    assert config.rope_theta == 5e5 and config.rope_scaling["rope_type"] == "yarn"
    assert "rope_theta" not in authors_defaults_taken(cfg)


def test_a_transformers5_dict_with_null_rope_theta_and_partial_factor_reads_rope_parameters():
    """What vLLM hands the plugin: transformers 5's ``to_dict()`` of the draft config."""
    cfg = full_config(rope_theta=None, partial_rotary_factor=None,
                      rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"})
    config = DLiteConfig.from_checkpoint_config(cfg)
    assert config.rope_theta == 1000000.0 and config.rope_scaling is None


@pytest.mark.parametrize("key", ["head_dim", "rope_theta", "hidden_act", "rms_norm_eps"])
def test_null_where_the_authors_code_cannot_run_is_one_error(key):
    with pytest.raises(ValueError, match=f"config.json sets {key} to null.*set {key}"):
        DLiteConfig.from_checkpoint_config(full_config(**{key: None}))


def test_partial_rotary_factor_is_refused():
    with pytest.raises(ValueError, match="partial_rotary_factor = 0.5.*remove partial_rotary_factor"):
        DLiteConfig.from_checkpoint_config(full_config(partial_rotary_factor=0.5))


# =========================================================================== the model follows
def _drafter(cfg: dict, seed: int = 0) -> DLiteDrafter:
    torch.manual_seed(seed)
    model = DLiteDrafter(DLiteConfig.from_checkpoint_config(cfg)).eval()
    g = torch.Generator().manual_seed(1)
    model.bind_target(torch.randn(V, H, generator=g), 1 + 0.1 * torch.randn(H, generator=g), 1e-6)
    return model


def _hf_rope(cfg: dict, positions: torch.Tensor, dtype: torch.dtype):
    """transformers' Qwen3RotaryEmbedding built from the same config (rope_theta/rope_scaling as
    transformers 5 spells them)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    theta = cfg.get("rope_theta", 10000.0)
    params = dict(cfg.get("rope_scaling") or {"rope_type": "default"}, rope_theta=theta)
    hf = Qwen3Config(hidden_size=cfg.get("hidden_size", 4096), num_attention_heads=cfg.get("num_attention_heads", 32),
                     head_dim=cfg.get("head_dim", 128), rope_parameters=params,
                     max_position_embeddings=cfg.get("max_position_embeddings", 32768))
    rotary = Qwen3RotaryEmbedding(hf)
    return rotary(torch.zeros(1, dtype=dtype), positions[None])


def _positions(model: DLiteDrafter, g: int) -> torch.Tensor:
    c = model.config
    return torch.cat([torch.full((c.num_feature_layers,), max(g - 2, 0)), torch.arange(g + c.num_draft_tokens)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_left_out_rope_theta_runs_at_10000_like_transformers(dtype):
    cfg = without("rope_theta")
    model = _drafter(cfg).to(dtype)
    cos, sin = model.rope(1)
    hf_cos, hf_sin = _hf_rope(cfg, _positions(model, 1), dtype)
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])
    # and it matters: the same weights at the target's 1e6 draft other logits
    explicit = _drafter(full_config()).to(dtype)
    feats, group = torch.randn(2, L, H, dtype=dtype), torch.randint(4, V, (2, 1))
    assert not torch.equal(model.draft(feats, group).logits, explicit.draft(feats, group).logits)


def test_left_out_head_dim_and_kv_heads_shape_the_projections():
    model = _drafter(without("num_key_value_heads", **{"num_attention_heads": 32}))
    assert model.layers[0].self_attn.k_proj.weight.shape == (32 * 16, H)
    model = _drafter(without("head_dim"))
    assert model.layers[0].self_attn.q_proj.weight.shape == (4 * 128, H)
    assert model.rope(1)[0].shape[-1] == 128


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize("scaling, max_pos", [
    (YARN, 131072),  # Qwen3's long-context recipe
    ({"rope_type": "yarn", "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0,
      "truncate": False, "original_max_position_embeddings": 4096}, 32768),
    ({"rope_type": "linear", "factor": 2.0}, 32768),
    ({"rope_type": "dynamic", "factor": 2.0}, 32768),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, 131072),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [1, 2])
def test_rope_scaling_is_applied_bit_exactly_as_transformers(scaling, max_pos, dtype, g):
    cfg = full_config(rope_scaling=scaling, max_position_embeddings=max_pos, head_dim=128,
                      num_attention_heads=4, num_key_value_heads=2)
    cfg["dlite_config"]["anchor_group_size"] = 2
    model = _drafter(cfg).to(dtype)
    assert model.config.rope_scaling["rope_type"] == scaling["rope_type"]
    cos, sin = model.rope(g)
    hf_cos, hf_sin = _hf_rope(cfg, _positions(model, g), dtype)
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])


def test_yarn_changes_the_drafts_and_survives_save_and_load(tmp_path):
    plain = _drafter(full_config(head_dim=32))
    yarn = _drafter(full_config(head_dim=32, rope_scaling=YARN, max_position_embeddings=131072))
    yarn.load_state_dict(plain.state_dict())
    feats, group = torch.randn(2, L, H), torch.randint(4, V, (2, 1))
    assert not torch.equal(plain.draft(feats, group).logits, yarn.draft(feats, group).logits)
    d = save_pretrained(yarn, tmp_path / "yarn", dtype=torch.float32)
    written = json.loads((d / "config.json").read_text())
    assert written["rope_scaling"] == YARN and written["max_position_embeddings"] == 131072
    loaded = load_drafter(d)
    loaded.bind_target(yarn.embed_weight, yarn._final_norm_weight, 1e-6)
    assert torch.equal(loaded.draft(feats, group).logits, yarn.draft(feats, group).logits)


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_hidden_act_is_applied_as_transformers_act2fn(act):
    from transformers.activations import ACT2FN

    model = _drafter(full_config(hidden_act=act))
    mlp = model.layers[0].mlp
    x = torch.randn(3, 5, H)
    ref = mlp.down_proj(ACT2FN[act](mlp.gate_proj(x)) * mlp.up_proj(x))
    assert torch.equal(mlp(x), ref)


def test_a_non_silu_act_changes_the_drafts_and_an_unknown_one_is_refused():
    silu, gelu = _drafter(full_config()), _drafter(full_config(hidden_act="gelu_pytorch_tanh"))
    gelu.load_state_dict(silu.state_dict())
    feats, group = torch.randn(2, L, H), torch.randint(4, V, (2, 1))
    assert not torch.equal(silu.draft(feats, group).logits, gelu.draft(feats, group).logits)
    with pytest.raises(ValueError, match="hidden_act = 'xielu' is invalid.*Qwen3: 'silu'"):
        DLiteConfig.from_checkpoint_config(full_config(hidden_act="xielu"))


# =========================================================================== sliding window
@pytest.mark.parametrize("top", [
    dict(use_sliding_window=True, sliding_window=4),  # max_window_layers 28 > n: no sliding layer
    dict(use_sliding_window=True, sliding_window=4, max_window_layers=28, layer_types=None),
    dict(use_sliding_window=False, sliding_window=4, layer_types=["sliding_attention"] * 2),  # window unused
    dict(use_sliding_window=True, sliding_window=L + 1 + 4, max_window_layers=0),  # >= L + G + K keys
])
def test_a_sliding_window_that_cuts_nothing_is_accepted_and_changes_nothing(top):
    base = _drafter(full_config())
    other = _drafter(full_config(**top))
    feats, group = torch.randn(2, L, H), torch.randint(4, V, (2, 1))
    assert torch.equal(base.draft(feats, group).logits, other.draft(feats, group).logits)


@pytest.mark.parametrize("top", [
    dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    dict(use_sliding_window=True, sliding_window=4, layer_types=["full_attention", "sliding_attention"]),
])
def test_a_sliding_window_that_cuts_a_round_is_one_error(top):
    with pytest.raises(ValueError, match=r"makes draft layers \[1\] sliding-window layers with "
                                         r"sliding_window = 4, shorter than one round's 9 keys.*"
                                         r"set use_sliding_window to false"):
        DLiteConfig.from_checkpoint_config(full_config(**top))


def test_layer_types_of_the_wrong_length_is_one_error():
    with pytest.raises(ValueError, match="for each of the 2 draft layers"):
        DLiteConfig.from_checkpoint_config(full_config(layer_types=["full_attention"] * 3))


# =========================================================================== saying so
def test_a_default_that_disagrees_with_the_target_is_said_once():
    cfg = without("rope_theta")
    msg = target_default_warning(cfg, {"rope_theta": 1000000.0, "rms_norm_eps": 1e-6})
    assert msg.count("rope_theta = 10000.0") == 1 and "the target's rope_theta = 1000000.0" in msg
    assert 'add "rope_theta": 1000000.0 to its config.json' in msg and "\n" not in msg
    # two keys, one line
    cfg2 = without("rms_norm_eps")
    del cfg2["rope_theta"]
    msg2 = target_default_warning(cfg2, {"rope_theta": 1e6, "rms_norm_eps": 1e-5})
    assert "rope_theta" in msg2 and "rms_norm_eps" in msg2 and "\n" not in msg2
    # silent when the target agrees, when the key is present, or when the target does not say
    assert target_default_warning(cfg, {"rope_theta": 10000.0}) is None
    assert target_default_warning(full_config(), {"rope_theta": 10000.0}) is None
    assert target_default_warning(cfg, {}) is None


def test_the_warning_reads_a_transformers_target_config_object():
    from transformers import Qwen3Config

    target = Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    assert "the target's rope_theta = 1000000.0" in target_default_warning(without("rope_theta"), target)


def test_the_plugin_logs_it_once_at_config_time(tmp_path, caplog):
    """The warning comes with the checkpoint's validation against the target (config time, in the
    process that builds the config), not when a worker loads the drafter."""
    from vllm_dlite.vllm.plugin import validate_dlite_checkpoint

    model = _drafter(full_config())
    d = save_pretrained(model, tmp_path / "d", dtype=torch.float32)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["rope_theta"]
    (d / "config.json").write_text(json.dumps(cfg))
    target = {"hidden_size": H, "vocab_size": V, "num_hidden_layers": N, "rope_theta": 1000000.0}
    with caplog.at_level(logging.WARNING, logger="vllm.dlite"):
        validate_dlite_checkpoint(str(d), target)
    hits = [r for r in caplog.records if "rope_theta = 10000.0" in r.getMessage()]
    assert len(hits) == 1 and str(d) in hits[0].getMessage()


def test_a_default_the_tensors_contradict_is_named_in_the_shape_error(tmp_path):
    """A config.json without num_key_value_heads (-> 32) beside tensors for 2 KV heads."""
    model = _drafter(full_config(num_attention_heads=32, head_dim=16))
    d = save_pretrained(model, tmp_path / "d", dtype=torch.float32)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["num_key_value_heads"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        check_checkpoint(d)
    msg = str(err.value)
    assert "k_proj.weight' has shape (32, 64), config.json implies (512, 64)" in msg
    assert "config.json leaves out ['num_key_value_heads'], which the authors' code" in msg
    assert "{'num_key_value_heads': 32}" in msg and "\n" not in msg


def test_for_target_copies_rope_scaling_and_reads_left_out_keys_as_qwen3config():
    t = {"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 32, "intermediate_size": 96,
         "vocab_size": V, "rope_scaling": dict(YARN), "max_position_embeddings": 131072}
    cfg = DLiteConfig.for_target(copy.deepcopy(t), num_feature_layers=3, mask_token_id=3)
    assert cfg.rope_theta == 10000.0 and cfg.head_dim == 128 and cfg.num_key_value_heads == 32
    assert cfg.rope_scaling == YARN and cfg.max_position_embeddings == 131072
