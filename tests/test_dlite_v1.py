"""The drafter is the authors' ``dlite_v1`` (``docs/dlite_v1.md`` §§1-4, 7): fidelity and checkpoints.

* An independent per-token reference, written here from the spec with plain loops (no code shared
  with ``vllm_dlite``: its own RMSNorm, RoPE, attention, head), equals the model's logits in fp32
  for G = 1, 2, 3, including anchors near sequence start (g = min(G, a+1) < G).
* Authors' checkpoint layout: parameter counts at Qwen3-8B / Qwen3-4B shapes on the meta device;
  save/load round trip; what the spec leaves open is tolerated (key prefix, sharded safetensors
  with an index, ``architectures`` string, ``rope_parameters``); bad checkpoints fail with one
  message naming the fix (old vllm-dlite format, wrong version, layer ids off the rule, ...).
* The anchor group both vLLM runners hand the drafter (``anchor_group``): this step's input, then
  the token history, shrinking at sequence start.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from vllm_dlite.config import DLiteConfig, build_target_layer_ids
from vllm_dlite.model import CheckpointError, DLiteDrafter, check_checkpoint, load_drafter, save_pretrained
from sparse_safetensors import write_sparse_safetensors

N_TARGET, H, V = 6, 32, 97


def small_config(G: int = 1, **kw) -> DLiteConfig:
    values = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, intermediate_size=48, rms_norm_eps=1e-6, rope_theta=10000.0,
                  vocab_size=V, num_target_layers=N_TARGET,
                  target_layer_ids=build_target_layer_ids(N_TARGET, 4), block_size=5,
                  anchor_group_size=G, mask_token_id=3, sequential_rank=6)
    values.update(kw)
    return DLiteConfig(**values)


def random_drafter(cfg: DLiteConfig, seed: int = 0) -> tuple[DLiteDrafter, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = DLiteDrafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
            else:  # norms around 1, biases around 0
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
    embed = torch.randn(V + 3, H)  # a padded target vocabulary
    norm_w = 1.0 + 0.1 * torch.randn(H)
    model.bind_target(embed, norm_w, 1e-6)
    return model, embed, norm_w


# =========================================================================== the spec, by hand
def _rms(x: list[float], w, eps: float) -> list[float]:
    ms = sum(v * v for v in x) / len(x)
    inv = 1.0 / math.sqrt(ms + eps)
    return [float(w[i]) * x[i] * inv for i in range(len(x))]


def _matvec(W: torch.Tensor, x: list[float], b=None) -> list[float]:
    out = (W.double() @ torch.tensor(x, dtype=torch.float64)).tolist()
    return out if b is None else [o + float(bi) for o, bi in zip(out, b)]


def _rope(x: list[float], pos: int, theta: float) -> list[float]:
    D = len(x)
    half = D // 2
    out = [0.0] * D
    for j in range(half):
        ang = pos * theta ** (-2 * j / D)
        c, s = math.cos(ang), math.sin(ang)
        out[j] = x[j] * c - x[j + half] * s
        out[j + half] = x[j + half] * c + x[j] * s
    return out


def spec_logits(sd: dict, cfg: DLiteConfig, embed, norm_w, feats, tokens, a: int, labels) -> torch.Tensor:
    """``docs/dlite_v1.md`` §§2-4 for ONE anchor at absolute position ``a`` of ``tokens``:
    features ``feats [L, H]`` (pre-norm aux), teacher-forced head fed ``labels``. -> [K, V]."""
    G, B, L, D = cfg.anchor_group_size, cfg.block_size, len(cfg.target_layer_ids), cfg.head_dim
    hq, hkv, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
    g = min(G, a + 1)
    # context: last feature through the target's final norm, + depth embedding, context norm
    ctx = []
    for l, j in enumerate(cfg.target_layer_ids):
        f = feats[l].tolist()
        if l == L - 1:
            f = _rms(f, norm_w, eps)
        f = [f[i] + float(sd["layer_depth_embedding.weight"][j][i]) for i in range(H)]
        ctx.append(_rms(f, sd["context_norm.weight"], eps))
    # query: g real tokens then B-1 masks
    qtok = [tokens[a - g + 1 + i] for i in range(g)] + [cfg.mask_token_id] * (B - 1)
    X = [embed[t].tolist() for t in qtok]
    Q = len(X)
    ctx_pos, q_pos = max(g - 2, 0), list(range(Q))
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        U = [_rms(x, sd[p + "input_layernorm.weight"], eps) for x in X]
        keys, vals = [], []
        for src, pos in [(c, ctx_pos) for c in ctx] + list(zip(U, q_pos)):
            k = _matvec(sd[p + "self_attn.k_proj.weight"], src)
            v = _matvec(sd[p + "self_attn.v_proj.weight"], src)
            keys.append([_rope(_rms(k[h * D:(h + 1) * D], sd[p + "self_attn.k_norm.weight"], eps), pos, cfg.rope_theta)
                         for h in range(hkv)])
            vals.append([v[h * D:(h + 1) * D] for h in range(hkv)])
        newX = []
        for qi in range(Q):
            qv = _matvec(sd[p + "self_attn.q_proj.weight"], U[qi])
            heads = []
            for h in range(hq):
                qh = _rope(_rms(qv[h * D:(h + 1) * D], sd[p + "self_attn.q_norm.weight"], eps), q_pos[qi], cfg.rope_theta)
                kv = h // (hq // hkv)
                scores = [sum(qh[d] * keys[t][kv][d] for d in range(D)) / math.sqrt(D) for t in range(len(keys))]
                m = max(scores)
                w = [math.exp(s - m) for s in scores]
                z = sum(w)
                heads += [sum(w[t] * vals[t][kv][d] for t in range(len(keys))) / z for d in range(D)]
            att = _matvec(sd[p + "self_attn.o_proj.weight"], heads)
            x = [X[qi][d] + att[d] for d in range(H)]
            u2 = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
            gate = _matvec(sd[p + "mlp.gate_proj.weight"], u2)
            up = _matvec(sd[p + "mlp.up_proj.weight"], u2)
            act = [gi / (1 + math.exp(-gi)) * ui for gi, ui in zip(gate, up)]
            mlp = _matvec(sd[p + "mlp.down_proj.weight"], act)
            newX.append([x[d] + mlp[d] for d in range(H)])
        X = newX
    Y = [_rms(x, sd["norm.weight"], eps) for x in X]
    # sequential head
    r = cfg.sequential_rank
    P, Ws, bs = sd["sequential_head.prev_token_embedding.weight"], sd["sequential_head.state_proj.weight"], sd["sequential_head.state_proj.bias"]
    Wf, bf, Wo = sd["sequential_head.state_hidden_mlp.weight"], sd["sequential_head.state_hidden_mlp.bias"], sd["sequential_head.output_proj.weight"]

    def phi(s, t):
        zc = _matvec(Ws, s + P[t].tolist(), bs)
        sig = [1 / (1 + math.exp(-z)) for z in zc[:r]]
        return [sig[i] * s[i] + (1 - sig[i]) * math.tanh(zc[r + i]) for i in range(r)]

    s = [0.0] * r
    if G > 1:
        s = phi(s, tokens[a - 1])
    prev = tokens[a]
    out = []
    for k in range(1, B):
        s = phi(s, prev)
        o = _matvec(Wf, s + Y[g - 1 + k], bf)
        out.append(_matvec(Wo, o))
        prev = labels[k - 1]
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("G", [1, 2, 3])
def test_model_equals_independent_per_token_reference(G):
    cfg = small_config(G)
    model, embed, norm_w = random_drafter(cfg, seed=G)
    sd = {k: v.detach().double() for k, v in model.state_dict().items()}
    torch.manual_seed(10 + G)
    tokens = torch.randint(4, V, (24,)).tolist()
    K = cfg.num_draft_tokens
    for a in (1, 2, 9):  # a = 1: g = 2 < 3 for G = 3 (sequence start); a = 9 mid-sequence
        g = min(G, a + 1)
        feats = torch.randn(1, len(cfg.target_layer_ids), H)
        group = torch.tensor([tokens[a - g + 1: a + 1]])
        labels = torch.tensor([tokens[a + 1: a + 1 + K]])
        got = model.forward_train(feats, group, labels)[0].double()
        want = spec_logits(sd, cfg, embed.double(), norm_w.double(), feats[0].double(), tokens, a, labels[0].tolist())
        rel = ((got - want).abs().max() / want.abs().max()).item()
        assert rel <= 1e-5, (G, a, rel)


@pytest.mark.parametrize("G", [1, 2])
def test_free_running_draft_equals_teacher_forced_on_its_own_drafts(G):
    cfg = small_config(G)
    model, _, _ = random_drafter(cfg, seed=5)
    feats = torch.randn(4, len(cfg.target_layer_ids), H)
    group = torch.randint(4, V, (4, G))
    out = model.draft(feats, group)
    assert out.token_ids.shape == (4, cfg.num_draft_tokens) and out.logits.dtype == torch.float32
    tf = model.forward_train(feats, group, out.token_ids)
    torch.testing.assert_close(tf, out.logits)
    assert torch.equal(out.logits.argmax(-1), out.token_ids)


def test_k_runs_only_the_needed_head_steps(monkeypatch):
    from vllm_dlite.ops import reference

    cfg = small_config(2)
    model, _, _ = random_drafter(cfg)
    calls = []
    real = reference.head_state_update
    monkeypatch.setattr(reference, "head_state_update", lambda *a: calls.append(1) or real(*a))
    feats, group = torch.randn(3, 4, H), torch.randint(4, V, (3, 2))
    full = model.draft(feats, group)
    n_full = len(calls)
    calls.clear()
    part = model.draft(feats, group, k=2)
    assert n_full == 1 + cfg.num_draft_tokens and len(calls) == 1 + 2  # priming + steps
    assert torch.equal(part.token_ids, full.token_ids[:, :2])


def test_draft_is_per_request_and_stateless():
    cfg = small_config(2)
    model, _, _ = random_drafter(cfg)
    feats, group = torch.randn(5, 4, H), torch.randint(4, V, (5, 2))
    batch = model.draft(feats, group).logits
    for i in range(5):
        torch.testing.assert_close(model.draft(feats[i:i + 1], group[i:i + 1]).logits[0], batch[i])
    torch.testing.assert_close(model.draft(feats, group).logits, batch)  # no state between calls


def test_sampling_draws_from_softmax_over_temperature():
    cfg = small_config(1)
    model, _, _ = random_drafter(cfg)
    feats, group = torch.randn(1, 4, H).expand(4000, -1, -1), torch.full((4000, 1), 7)
    out = model.draft(feats, group, temperature=0.7, generator=torch.Generator().manual_seed(0), k=1)
    probs = torch.softmax(out.logits[0, 0] / 0.7, -1)
    freq = torch.bincount(out.token_ids[:, 0], minlength=V).float() / 4000
    assert (freq - probs).abs().max() < 0.03


# =========================================================================== layer-id rule
def test_layer_id_rule_matches_the_spec():
    assert build_target_layer_ids(36, 14) == [0, 1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 35]
    assert build_target_layer_ids(36, 12) == [0, 1, 5, 8, 12, 16, 19, 23, 27, 30, 34, 35]
    assert build_target_layer_ids(12, 3) == [0, 5, 11]  # f = 0.5: 1 + round(4.5) = 1 + 4 (half to even)
    assert small_config().aux_layer_ids == [j + 1 for j in build_target_layer_ids(N_TARGET, 4)]
    with pytest.raises(ValueError, match="chs_num_layers must be an integer in 2..6"):
        build_target_layer_ids(6, 7)


# =========================================================================== checkpoints
def authors_config(H_, I, r, L, V_=151936, N=36) -> dict:
    return {"architectures": ["DLiteDraftModel"], "model_type": "qwen3", "hidden_size": H_,
            "intermediate_size": I, "num_hidden_layers": 5, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
            "vocab_size": V_, "num_target_layers": N, "block_size": 8, "hidden_act": "silu",
            "dlite_config": {"architecture_version": "dlite_v1", "model_role": "pivot_q_student",
                             "anchor_group_size": 1, "chs_num_layers": L,
                             "target_layer_ids": build_target_layer_ids(N, L),
                             "sequential_head": "rnn", "sequential_rank": r, "mask_token_id": 151669}}


@pytest.mark.parametrize("shape, expected", [((4096, 12288, 512, 14), 1_123_879_680),
                                             ((2560, 9728, 320, 12), 603_322_560)])
def test_authors_checkpoint_at_qwen3_shapes_on_meta(tmp_path, shape, expected):
    """A checkpoint in the authors' layout at Qwen3-8B / -4B shapes (``docs/dlite_v1.md`` §7): its
    headers pass the loader's check, and the model it describes has the spec's parameter count."""
    cfg = authors_config(*shape)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = DLiteConfig.from_checkpoint_config(cfg)
    with torch.device("meta"):
        model = DLiteDrafter(config)
    assert sum(p.numel() for p in model.parameters()) == expected
    # the loader's header check accepts it as a sharded, prefixed file set (sparse files)
    names = list(model.state_dict())
    index = {"metadata": {}, "weight_map": {}}
    for s, chunk in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        fname = f"model-{s + 1:05d}-of-00002.safetensors"
        write_sparse_safetensors(tmp_path / fname, {f"model.{n}": tuple(model.state_dict()[n].shape) for n in chunk})
        index["weight_map"].update({f"model.{n}": fname for n in chunk})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert check_checkpoint(tmp_path).sequential_rank == shape[2]


@pytest.fixture
def saved(tmp_path):
    cfg = small_config(2)
    model, embed, norm_w = random_drafter(cfg, seed=3)
    d = save_pretrained(model, tmp_path / "ckpt", {"model_type": "qwen3", "num_hidden_layers": N_TARGET},
                        dtype=torch.float32)
    return d, model, embed, norm_w


def test_save_load_round_trip_in_authors_layout(saved):
    d, model, embed, norm_w = saved
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["dlite_config"]["architecture_version"] == "dlite_v1"
    assert cfg["block_size"] == 5 and cfg["num_target_layers"] == N_TARGET and cfg["num_hidden_layers"] == 2
    assert cfg["dlite_config"]["anchor_group_size"] == 2 and cfg["dlite_config"]["chs_num_layers"] == 4
    loaded = load_drafter(d)
    loaded.bind_target(embed, norm_w, 1e-6)
    feats, group = torch.randn(2, 4, H), torch.randint(4, V, (2, 2))
    assert torch.equal(loaded.draft(feats, group).logits, model.draft(feats, group).logits)
    bf16 = save_pretrained(model, d.parent / "bf16", {"model_type": "qwen3"})  # released dtype
    assert load_drafter(bf16).dtype == torch.bfloat16


def test_loader_tolerates_prefix_shards_architectures_and_rope_parameters(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    d, model, embed, norm_w = saved
    out = tmp_path / "authors"
    out.mkdir()
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["SomethingElse"]
    theta = cfg.pop("rope_theta")
    cfg["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(d / "model.safetensors"))
    names = sorted(tensors)
    index = {"metadata": {}, "weight_map": {}}
    for s, chunk in enumerate((names[::2], names[1::2])):
        fname = f"model-{s + 1:05d}-of-00002.safetensors"
        save_file({f"model.{n}": tensors[n] for n in chunk}, str(out / fname))
        index["weight_map"].update({f"model.{n}": fname for n in chunk})
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_drafter(out)
    loaded.bind_target(embed, norm_w, 1e-6)
    feats, group = torch.randn(2, 4, H), torch.randint(4, V, (2, 2))
    assert torch.equal(loaded.draft(feats, group).logits, model.draft(feats, group).logits)


def test_hub_ids_resolve_through_huggingface_hub(saved, monkeypatch):
    import huggingface_hub

    d = saved[0]
    seen = {}

    def fake(repo_id, revision=None, allow_patterns=None):
        seen.update(repo=repo_id, patterns=allow_patterns)
        return str(d)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert load_drafter("SJTU-DAI-Sys/Qwen3-8B-DLite").config.anchor_group_size == 2
    assert seen["repo"] == "SJTU-DAI-Sys/Qwen3-8B-DLite" and "*.safetensors" in seen["patterns"]


def _edit(d: Path, tmp: Path, fn) -> Path:
    out = tmp / "edited"
    shutil.copytree(d, out)
    cfg = json.loads((out / "config.json").read_text())
    fn(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c["dlite_config"].update(architecture_version="dlite_v2"), "architecture_version = 'dlite_v2' is not supported"),
    (lambda c: c["dlite_config"].update(target_layer_ids=[0, 2, 4, 5]), "requires the authors' layer-id rule"),
    (lambda c: c["dlite_config"].update(chs_num_layers=3), "chs_num_layers = 3 but target_layer_ids has 4"),
    (lambda c: c["dlite_config"].update(mask_token_id=500), "mask_token_id = 500 is invalid"),
    (lambda c: c["dlite_config"].update(sequential_head="mlp"), "only 'rnn'"),
    (lambda c: c.update(block_size=1), "block_size = 1 is invalid"),
    (lambda c: c.update(rope_scaling={"rope_type": "longrope", "factor": 4, "long_factor": [1.0],
                                      "short_factor": [1.0]}), "longrope (Phi-3's per-dimension factors) is not implemented"),
    (lambda c: c.pop("num_target_layers"), "lacks the dlite_v1 keys ['num_target_layers']"),
    (lambda c: c.update(dlite_config={"head_rank": 32, "target_layer_ids": [1, 2]}), "old vllm-dlite format"),
])
def test_bad_checkpoints_fail_with_one_message_naming_the_fix(saved, tmp_path, edit, needle):
    bad = _edit(saved[0], tmp_path, edit)
    with pytest.raises(CheckpointError) as err:
        load_drafter(bad)
    msg = str(err.value)
    assert needle in msg and "\n" not in msg and str(bad / "config.json") in msg, msg


def test_old_format_error_names_the_fix(tmp_path):
    old = Path(__file__).resolve().parents[1] / "tests" / "data" / "old_format_config.json"
    cfg = json.loads(old.read_text()) if old.exists() else {
        "architectures": ["DFlashDLiteDraftModel"],
        "dlite_config": {"target_layer_ids": [1, 2], "head_rank": 32, "feature_mode": "sequence",
                         "target_hidden_size": 256}}
    with pytest.raises(ValueError, match="old vllm-dlite format.*retrain it with"):
        DLiteConfig.from_checkpoint_config(cfg)


def test_target_fit_is_checked_with_one_message():
    cfg = small_config()
    cfg.check_target(hidden_size=H, vocab_size=V, num_layers=N_TARGET)
    for kw, needle in ((dict(hidden_size=64), "hidden_size=64"), (dict(vocab_size=500), "vocab_size=500"),
                       (dict(num_layers=8), "has 8 layers")):
        args = dict(hidden_size=H, vocab_size=V, num_layers=N_TARGET) | kw
        with pytest.raises(ValueError, match="use a DLite drafter trained for this target") as err:
            cfg.check_target(**args)
        assert needle in str(err.value)


# =========================================================================== the anchor group
@pytest.mark.parametrize("G", [1, 2, 3, 4])
def test_anchor_group_reads_the_step_then_the_history_as_both_runners_hold_them(G):
    """One batch as a serving engine holds it, three requests with known sequences:
    req0 decodes (its row before the anchor is the step's first, so x_{a-2}.. are in its history),
    req1 is a prompt's first chunk (a = 2: only min(G, 3) real tokens exist),
    req2 a later chunk (everything this step). History rows are permuted, as V2's request states
    are; the group must be x_{a-G+1..a} of each sequence (left slots 0 where there is no token)."""
    from vllm_dlite.model import anchor_group

    seqs = [torch.arange(100, 130), torch.arange(200, 230), torch.arange(300, 330)]
    scheduled = [range(10, 15), range(0, 6), range(20, 23)]  # positions each request runs this step
    rows_at = [10, 1, 22]  # position a-1 of each round
    step_tokens = torch.cat([seqs[b][list(p)] for b, p in enumerate(scheduled)])
    step_positions = torch.cat([torch.tensor(list(p)) for p in scheduled])
    query_start = torch.tensor([0, 5, 11])
    rows = torch.tensor([int(query_start[b]) + rows_at[b] - scheduled[b][0] for b in range(3)])
    anchors = torch.stack([seqs[b][rows_at[b] + 1] for b in range(3)])
    history_rows = torch.tensor([2, 0, 1])
    history = torch.full((3, 30), -1)
    for b in range(3):  # everything scheduled before this step
        history[history_rows[b], : scheduled[b][0]] = seqs[b][: scheduled[b][0]]

    group, lens = anchor_group(anchors, rows, step_tokens, G, step_positions=step_positions,
                               query_start=query_start, history=history, history_rows=history_rows)
    want = torch.zeros(3, G, dtype=torch.long)
    for b in range(3):
        a = rows_at[b] + 1
        for j in range(G):  # slot j holds x_{a-G+1+j}
            if a - G + 1 + j >= 0:
                want[b, j] = seqs[b][a - G + 1 + j]
    assert group.tolist() == want.tolist()
    wanted_lens = [min(G, r + 2) for r in rows_at]
    assert (lens is None) == all(g == G for g in wanted_lens)
    if lens is not None:
        assert lens.tolist() == wanted_lens
    if G > 2:  # without the history the reads before this step fail with the fix, not garbage
        with pytest.raises(ValueError, match="needs the token history"):
            anchor_group(anchors, rows, step_tokens, G, step_positions=step_positions, query_start=query_start)
        # a prompt's first chunk alone needs none: what precedes position 0 is no token at all
        alone, alone_lens = anchor_group(anchors[1:2], torch.tensor([1]), step_tokens[5:11], G,
                                         step_positions=step_positions[5:11], query_start=torch.tensor([0]))
        assert alone.tolist() == want[1:2].tolist()
        assert (alone_lens is None) if G == 3 else alone_lens.tolist() == [3]
