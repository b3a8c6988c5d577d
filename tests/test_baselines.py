"""Baseline drafters trained with speculators==0.9.0 (lab.baselines), end to end on a
tiny random Qwen3 target: feature store in vLLM's aux-id convention, CPU training of EAGLE-3,
DFlash and DSpark for a couple of steps, exported checkpoints without the target's weights, and
(slow) vLLM serving them with greedy output identical to no speculation."""

from __future__ import annotations

import json

import helpers_vllm as H
import pytest
import torch

import lab.baselines as B
from lab.baselines import features as BF
from lab.baselines import patches as SP

K = 7
N_SEQ = 8
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny target, a regenerated-format JSONL (prompt + answer token ids), a work dir."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("baselines")
    target = H.make_tiny_target(root / "target")
    tok = AutoTokenizer.from_pretrained(str(target))
    records = []
    for i, prompt in enumerate(H.make_prompts(N_SEQ)):
        ids = tok.encode(prompt, add_special_tokens=False)
        answer = tok.encode(H._CORPUS[i % len(H._CORPUS)], add_special_tokens=False)[:NEW_TOKENS]
        records.append(dict(id=f"s{i}#0", kind="chat", prompt_len=len(ids),
                            token_ids=ids + answer))
    data = root / "sequences.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return dict(root=root, target=target, data=data, work=root / "work", out=root / "models")


def _train(tiny, method, *extra):
    out = tiny["out"] / method
    B.main([
        "--method", method, "--target", str(tiny["target"]), "--data", str(tiny["data"]),
        "--out", str(out), "--work-dir", str(tiny["work"]), "--epochs", "1", "--max-steps", "2",
        "--max-len", "128", "--max-anchors", "16", "--log-freq", "1", "--fresh", *extra,
    ])
    return out


@pytest.fixture(scope="module")
def trained(tiny):
    return {m: _train(tiny, m) for m in ("eagle3", "dflash", "dspark")}


@pytest.mark.parametrize("shape", [(48, 96), (96, 48)])
def test_cpu_muon_orthogonalisation_matches_torch(shape):
    """The fp32 stand-in for torch.optim.Muon's bf16 Newton-Schulz step (CPU only) computes the
    same update, up to bf16 rounding."""
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, _zeropower_via_newtonschulz

    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    coeffs = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
    ours = SP._newton_schulz_fp32(g, coeffs, 5, 1e-7)
    ref = _zeropower_via_newtonschulz(g, coeffs, 5, 1e-7).float()
    assert ours.shape == g.shape and ours.dtype == g.dtype
    assert (ours - ref).norm() / ref.norm() < 0.02
    with SP.cpu_safe_speculators():  # patched in while speculators trains, restored after
        import torch.optim._muon as muon

        assert muon._zeropower_via_newtonschulz is SP._newton_schulz_fp32
    assert muon._zeropower_via_newtonschulz is _zeropower_via_newtonschulz


def _eagle3_mask(doc_lengths, ttt_steps):
    """speculators' own EAGLE-3 SDPA mask: causal within each packed document, then one
    diagonal block per further training-time-test step."""
    from speculators.models.eagle3.attention import (
        create_combined_mask_mod,
        extend_dense_mask_for_draft_tokens,
    )
    from torch.nn.attention.flex_attention import create_mask

    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(doc_lengths)])
    t = len(doc_ids)
    mask = create_mask(create_combined_mask_mod(doc_ids, t), None, None, t, t, device="cpu")
    for _ in range(ttt_steps - 1):
        mask = extend_dense_mask_for_draft_tokens(mask, t)
    return mask


@pytest.mark.parametrize("case", ["eagle3", "masked_tile", "dense"])
def test_masked_sdpa_tiles_matches_sdpa(case):
    """The tile-sparse SDPA of CPU training gives transformers' SDPA output and gradients (GQA, a
    boolean mask of speculators' EAGLE-3 layout, a fully masked query tile, a dense mask)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    if case == "eagle3":
        mask = _eagle3_mask([200, 5, 307], ttt_steps=3)  # [1, 1, 512, 1536]
    elif case == "masked_tile":  # each 128-query tile sees its own 160 keys, the 2nd tile none
        mask = torch.rand(1, 1, 512, 640, generator=g) < 0.3
        for tile in range(4):
            mask[..., tile * 128:(tile + 1) * 128, :] &= (torch.arange(640) // 160 == tile)
        mask[..., 128:256, :] = False
    else:
        mask = torch.rand(1, 1, 512, 640, generator=g) < 0.9
    q_len, kv_len = mask.shape[-2:]
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    tensors = [torch.randn(1, heads, n, 16, generator=g)
               for heads, n in ((4, q_len), (2, kv_len), (2, kv_len))]
    grad_out = torch.randn(1, q_len, 4, 16, generator=g)
    key_lengths = []

    def dense(module, q, k, *args, **kwargs):
        key_lengths.append(k.shape[-2])
        return sdpa_attention_forward(module, q, k, *args, **kwargs)

    results = []
    for fn in (sdpa_attention_forward, SP.masked_sdpa_tiles(dense)):
        q, k, v = (t.clone().requires_grad_() for t in tensors)
        out, weights = fn(module, q, k, v, mask, dropout=0.0, scaling=0.25)
        (out * grad_out).sum().backward()
        assert weights is None and out.shape == (1, q_len, 4, 16)
        results.append([out.detach(), q.grad, k.grad, v.grad])
    for ours, ref in zip(*reversed(results)):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    if case == "dense":
        assert key_lengths == [kv_len]  # nothing to gain: one dense call
    else:
        assert len(key_lengths) == 4 and max(key_lengths) < kv_len / 2, key_lengths


def test_cpu_safe_speculators_installs_tiled_sdpa():
    """While speculators trains on CPU, the "sdpa" of both attention registries the draft models
    read is the tile-sparse one; the registries are restored on exit."""
    if torch.accelerator.is_available():
        pytest.skip("the CPU patches are a no-op with an accelerator")
    interfaces = SP._attention_interfaces()
    before = [i["sdpa"] for i in interfaces]
    with SP.cpu_safe_speculators():
        assert all(i["sdpa"] is not b and i["sdpa"].__qualname__.startswith("masked_sdpa_tiles")
                   for i, b in zip(interfaces, before))
    assert [i["sdpa"] for i in interfaces] == before
    assert all("sdpa" not in i._local_mapping for i in interfaces)


def test_default_layer_ids():
    assert BF.default_layer_ids("eagle3", 12) == [2, 6, 11]
    assert BF.default_layer_ids("dflash", 12) == [1, 3, 5, 8, 10, 12]
    assert BF.default_layer_ids("dspark", 12) == [1, 3, 5, 8, 10, 12]
    assert BF.store_layer_ids(12) == list(range(1, 13))
    assert BF.default_layer_ids("eagle3", 4) == [1, 2, 4]
    assert BF.file_layer_ids([2, 6, 11], 12) == [2, 6, 11, 12]


def _backend_sample(target, features, layer_ids, row=0):
    import argparse

    from hs_connectors import HiddenStatesBackend

    backend = HiddenStatesBackend.registry[SP.register_layer_backend()]
    args = argparse.Namespace(target_layer_ids=layer_ids, verifier_name_or_path=str(target),
                              hidden_states_path=None)
    return backend.from_train_args(args, str(features)).get_cached(row)


def test_feature_store_matches_vllm_convention(tiny, trained):
    """The store holds vLLM aux ids (HF hidden_states[i], id N pre-norm) and the speculators
    backend returns ``aux layers + [id N]`` of the row's sequence."""
    features = tiny["work"] / f"features-{tiny['target'].name}"
    n = H.target_config(tiny["target"])["num_hidden_layers"]
    meta = BF.read_store_meta(features)
    assert meta["layer_ids"] == list(range(1, n + 1))
    seqs = BF.load_sequences(tiny["data"], 128)
    assert sorted(meta["file_index"]) == seqs.index  # every sequence, rows shuffled
    row = 0
    seq = seqs.input_ids[seqs.index.index(meta["file_index"][row])]
    sample = _backend_sample(tiny["target"], features, [1, 2, 4], row)
    assert sample["token_ids"].tolist() == seq
    want = H.hf_features(tiny["target"], seq, [1, 2, 4, n])  # [T, 4, H] fp32
    got = sample["hidden_states"].float()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # stored in bf16


def test_feature_store_reuses_existing_files(tiny, trained, tmp_path, monkeypatch):
    """Files already written under the same sequence indices (DLite's feature files) are read,
    not recomputed."""
    import vllm_dlite.train.features as F

    src = tiny["work"] / f"features-{tiny['target'].name}" / "hidden_states"
    seqs = BF.load_sequences(tiny["data"], 128)
    monkeypatch.setattr(F.TargetFeatureExtractor, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("features recomputed")))
    store = BF.write_feature_store(tiny["target"], seqs, tmp_path / "store", [1, 2, 3, 4],
                                  reuse=src)
    assert not list((store / "hidden_states").iterdir())
    sample = _backend_sample(tiny["target"], store, [1, 3], row=len(seqs) - 1)
    assert sample["token_ids"].tolist() == seqs.input_ids[-1]
    assert sample["hidden_states"].shape[1] == 3


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_exported_checkpoint(tiny, trained, method):
    from safetensors import safe_open

    out = trained[method]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == method
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == K
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or cfg.get("aux_hidden_state_layer_ids")
    assert ids == BF.default_layer_ids(method, 4)
    layers = cfg["transformer_layer_config"]["num_hidden_layers"]
    assert layers == (1 if method == "eagle3" else 2)
    if method != "eagle3":
        assert cfg["mask_token_id"] == H.mask_token_id(tiny["target"])
        assert cfg["block_size"] == (K + 1 if method == "dflash" else K)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        dtypes = {f.get_tensor(k).dtype for k in names}
    assert not {"embed_tokens.weight", "lm_head.weight"} & set(names), names
    assert dtypes <= {torch.bfloat16, torch.int64, torch.bool}, dtypes
    assert (out / "README.md").is_file()


@pytest.mark.slow
def test_vllm_serves_baselines_greedy_identical(tiny, trained, runner):
    """vLLM loads each exported checkpoint unchanged (method eagle3 / dflash, K = 7), drafts with
    it, and greedy output equals output without speculation (fp32), on the runner under test: the
    controls of every DLite engine check."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    tok = AutoTokenizer.from_pretrained(str(tiny["target"]))
    prompts = [{"prompt_token_ids": tok.encode(p, add_special_tokens=False)} for p in H.make_prompts(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = H.run_llm(tiny["target"], prompts, params, max_model_len=512, runner=runner)
    assert expected.runner == runner
    for method in B.SERVABLE_ON_CPU:
        run = H.run_llm(tiny["target"], prompts, params, B.vllm_speculative_config(method, trained[method], K),
                        max_model_len=512, runner=runner)
        assert run.runner == runner
        assert run.token_ids == expected.token_ids, method
        assert run.metrics["vllm:spec_decode_num_drafts"] > 0, f"{method}: vLLM never drafted"


@pytest.mark.parametrize("method", B.SERVABLE_ON_CPU)
def test_shipped_baseline_is_what_vllm_expects(method):
    """The shipped EAGLE-3 / DFlash drafters for the tiny target (the A/B baselines) pass vLLM's
    config-time checks with the shipped target at the benchmarks' K, read only target layers that
    exist, record what they were trained for, and carry no copy of the target's embedding or LM head."""
    from paths import REPO, TARGET_DIR
    from safetensors import safe_open
    from vllm.engine.arg_utils import EngineArgs

    out = REPO / "models" / f"{method}-qwen3-tiny-stdlib"
    if not (out / "model.safetensors").is_file():
        pytest.skip(f"no shipped {method} drafter")
    cfg = json.loads((out / "config.json").read_text())
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or cfg.get("aux_hidden_state_layer_ids")
    assert ids == BF.default_layer_ids(method, 12)
    # the steps it was trained for, as it is served (equal-budget recipe): EAGLE-3 K test-time-
    # training steps, DFlash its block (anchor + K)
    trained_for = cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert trained_for == K
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert not set(B.SHARED_TARGET_KEYS) & set(f.keys())
    config = EngineArgs(model=str(TARGET_DIR), dtype="float32", max_model_len=1024,
                        speculative_config=B.vllm_speculative_config(method, out, K)).create_engine_config()
    assert config.speculative_config.num_speculative_tokens == K
    assert config.speculative_config.method == method


def test_an_interrupted_run_is_not_exported(tmp_path):
    """speculators returns normally after SIGINT; only a checkpoint closing the last epoch exports."""
    for epoch, local_step in ((0, 0), (3, 0)):
        (tmp_path / str(epoch)).mkdir()
        (tmp_path / str(epoch) / "training_state.json").write_text(
            json.dumps({"epoch": epoch, "local_step": local_step}))
    assert B.last_checkpoint(tmp_path) == tmp_path / "3"
    with pytest.raises(SystemExit, match="before the end of epoch 6"):
        B.last_checkpoint(tmp_path, 6)
    assert B.last_checkpoint(tmp_path, 4) == tmp_path / "3"
    (tmp_path / "3" / "training_state.json").write_text(json.dumps({"epoch": 3, "local_step": 59}))
    with pytest.raises(SystemExit, match="step 59"):
        B.last_checkpoint(tmp_path, 4)
