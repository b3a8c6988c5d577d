"""vLLM 0.32 integration of DLite on both model runners (CPU), with tiny random-weight models.

* plugin: idempotent ``register()``, version refusal, ``"method": "dlite"`` mapping (Python dict
  and ``--speculative-config`` JSON), one clear error per bad checkpoint/config;
* lossless greedy decoding vs no speculation at max batch sizes 1, 4 and 16 on 32 prompts (fp32),
  with a random drafter (mostly rejections) and a copy drafter (many acceptances);
* no draft KV cache: the KV pool with DLite equals the pool without speculation;
* the aux hidden states vLLM serves == HF ``output_hidden_states`` (pre-norm last layer via a hook)
  on the same tokens, and the drafts made inside vLLM == the offline drafter on those features;
* chunked prefill + preemption + requests finishing mid-batch, mixed greedy/sampled batches with
  probabilistic draft sampling.

Every end-to-end check runs on Model Runner V1 and V2 (the ``runner`` fixture, ``conftest.py``):
V1 engines in the test process, V2 engines in fresh processes running V2 through Triton's
interpreter (:mod:`lab.harness.runners`), each engine in its process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
with one OpenMP thread. The G = 3 drafter reads x_{a-2} from V2's request token history.
Tests that start engines are marked ``slow`` (project convention, pytest.ini); each takes
15-40 s on an idle 2-core CPU. ``pytest -m "not slow"`` runs the config/plugin/V2 unit tests.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import helpers_vllm as H  # noqa: E402

H.apply_vllm_env()
torch.set_num_threads(1)

vllm = pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from lab.harness.faults import CHECKPOINT_FAULTS, damage_weights  # noqa: E402
from vllm_dlite.vllm import plugin  # noqa: E402

NUM_PROMPTS = 32
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts():
    return H.make_prompts(NUM_PROMPTS)


@pytest.fixture(scope="module")
def baseline(models, prompts, greedy, runner):
    """Greedy outputs and KV pool without speculation, on the runner under test."""
    return H.run_llm(models.target, prompts, greedy, max_num_seqs=16, runner=runner)


DRAFTER_TYPE = {"v1": "DLiteProposer", "v2": "DLiteSpeculator"}


def dlite(path, **extra):
    return {"method": "dlite", "model": str(path), **extra}


def served_method() -> str:
    """What the plugin turns ``"method": "dlite"`` into: itself where vLLM's speculator registry serves
    it (0.34), else vLLM's parallel-drafting path ``"dflash"`` (0.32-0.33)."""
    return plugin.DLITE_METHOD if plugin.registry_in_use() else plugin.VLLM_METHOD


def is_served_as_dlite(sc) -> bool:
    """A built ``SpeculativeConfig`` runs DLite on the parallel-drafting path: ``method`` is
    ``"dflash"`` on every release (0.34 moves a registered method's name to ``custom_method`` and sets
    its base method, ``"dflash"``)."""
    custom = plugin.DLITE_METHOD if plugin.registry_in_use() else None
    return sc.method == plugin.VLLM_METHOD and getattr(sc, "custom_method", None) == custom


# =========================================================================== plugin
@pytest.mark.v1
def test_register_is_idempotent():
    from vllm import ModelRegistry
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker import gpu_model_runner

    plugin.register()
    first = (EngineArgs.create_speculative_config, gpu_model_runner.GPUModelRunner.__init__)
    plugin._registered = False  # force a second full pass: hooks must not stack
    plugin.register()
    plugin.register()
    assert (EngineArgs.create_speculative_config, gpu_model_runner.GPUModelRunner.__init__) == first
    assert EngineArgs.create_speculative_config.__wrapped__.__name__ == "create_speculative_config"
    assert not getattr(EngineArgs.create_speculative_config.__wrapped__, plugin._WRAPPED, False)
    assert "DFlashDLiteDraftModel" in ModelRegistry.get_supported_archs()
    assert sum(isinstance(f, plugin._PostImportHook) for f in sys.meta_path) == 1


def test_v2_hook_wraps_init_speculator_once():
    """0.32-0.33: the plugin wraps V2's ``init_speculator`` once. 0.34: vLLM's speculator registry
    builds DLite's speculator, so nothing is wrapped."""
    import vllm.v1.worker.gpu.spec_decode as spec_decode

    plugin.register()
    wrapped = spec_decode.init_speculator
    assert bool(getattr(wrapped, plugin._WRAPPED, False)) != plugin.registry_in_use()
    plugin._hook_v2_spec_decode(spec_decode)
    assert spec_decode.init_speculator is wrapped


def test_cpu_thread_binding_gives_each_rank_its_own_cores(monkeypatch):
    from vllm_dlite.vllm.engine import cpu_thread_binding

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert cpu_thread_binding(2) == "0|1"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert cpu_thread_binding(2) == "0-7|8-15"
    assert cpu_thread_binding(4) == "0-3|4-7|8-11|12-15"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {3})
    with pytest.raises(ValueError, match="needs one core per rank"):
        cpu_thread_binding(2)


def test_draft_rounds_after_a_prefill_chunk_are_not_steady_state():
    """vLLM 0.32 passes spec-decode metadata on prefill steps too; the schedule tells them apart."""
    from types import SimpleNamespace as NS

    from lab.harness.replay import is_decode_step

    assert is_decode_step(NS(num_scheduled_tokens={"a": 8, "b": 1}, scheduled_spec_decode_tokens={"a": [1] * 7}))
    assert not is_decode_step(NS(num_scheduled_tokens={"a": 4089}, scheduled_spec_decode_tokens={}))
    assert not is_decode_step(NS(num_scheduled_tokens={"a": 8, "b": 512}, scheduled_spec_decode_tokens={"a": [1] * 7}))
    assert not is_decode_step(NS(num_scheduled_tokens={}, scheduled_spec_decode_tokens={}))


def test_tensor_parallel_env_pins_cpu_ranks_once(monkeypatch):
    """Engine and server take their CPU core groups from the same helper; a binding that already
    lists one group per rank is the user's and is kept."""
    from vllm_dlite.vllm.engine import tensor_parallel_env

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert tensor_parallel_env(1) == {}
    assert tensor_parallel_env(2) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1|0")
    assert tensor_parallel_env(2) == {}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert tensor_parallel_env(2) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def test_use_cpu_env_threads_reach_this_process_torch():
    """torch read OMP_NUM_THREADS when it was imported: ``threads`` must also set its thread count,
    or an engine in this process runs on one thread per core; the user's variable wins. In a fresh
    interpreter: once a vLLM CPU worker has bound its threads in this one, torch.set_num_threads
    is a no-op here."""
    import os
    import subprocess

    if torch.cuda.is_available():
        pytest.skip("CPU settings only")
    code = ("import os, torch; torch.set_num_threads(2); from vllm_dlite.vllm.engine import use_cpu_env; "
            "use_cpu_env(1, threads=1); ours = torch.get_num_threads(); os.environ['OMP_NUM_THREADS'] = '2'; "
            "use_cpu_env(1, threads=1); print(ours, torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["1", "2", "2"]


# =========================================================================== config time
def _target_dict(models):
    return H.target_config(models.target)


def test_method_dlite_is_mapped(models):
    cfg = H.target_config(models.target)
    out = plugin.prepare_speculative_config(dlite(models.drafter), cfg)
    assert out["method"] == served_method()
    assert out["num_speculative_tokens"] == H.BLOCK_K  # defaults to the drafter's K
    out = plugin.prepare_speculative_config(dlite(models.drafter, num_speculative_tokens=2), cfg)
    assert out["num_speculative_tokens"] == 2
    # a dflash config pointing at a DLite checkpoint is validated the same way
    out = plugin.prepare_speculative_config({"method": "dflash", "model": str(models.drafter)}, cfg)
    assert out["num_speculative_tokens"] == H.BLOCK_K
    # other methods pass through untouched
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    assert plugin.prepare_speculative_config(ngram, cfg) == ngram


def test_engine_config_from_dict_and_cli(models):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    plugin.register()
    common = dict(model=str(models.target), dtype="float32", max_model_len=256)
    config = EngineArgs(**common, speculative_config=dlite(models.drafter)).create_engine_config()
    sc = config.speculative_config
    assert is_served_as_dlite(sc) and sc.num_speculative_tokens == H.BLOCK_K
    assert sc.draft_model_config.architectures == ["DFlashDLiteDraftModel"]
    assert plugin.is_dlite_draft(sc)
    assert tuple(sc.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids) == (1, 2, 3, 4)

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "--model", str(models.target), "--dtype", "float32", "--max-model-len", "256",
            "--speculative-config", json.dumps(dlite(models.drafter, num_speculative_tokens=3)),
        ]
    )
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert is_served_as_dlite(config.speculative_config)
    assert config.speculative_config.num_speculative_tokens == 3

    # --spec-method / --spec-model aliases
    args = parser.parse_args(
        ["--model", str(models.target), "--dtype", "float32", "--max-model-len", "256",
         "--spec-method", "dlite", "--spec-model", str(models.drafter)]
    )
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert plugin.is_dlite_draft(config.speculative_config)


def test_dlite_keeps_the_whole_prefix_cache_hit(models):
    """No EAGLE-style last-block drop for DLite (it keeps no draft KV)."""
    from vllm.engine.arg_utils import EngineArgs

    plugin.register()
    sc = EngineArgs(model=str(models.target), dtype="float32", max_model_len=256,
                    speculative_config=dlite(models.drafter)).create_engine_config().speculative_config
    assert sc.use_eagle() and not sc.use_eagle_block_drop()


@pytest.mark.slow
def test_prefix_cache_hits_equal_no_speculation(models, greedy, runner):
    """The same prompts twice with prefix caching: DLite's cache hits == no speculation's."""
    long_prompts = [" ".join(H.PROMPTS[(i + j) % len(H.PROMPTS)] for j in range(12)) for i in range(4)]
    hits = {}
    for name, spec in (("none", None), ("dlite", dlite(models.drafter))):
        run = H.run_llm(models.target, long_prompts + long_prompts, greedy, spec, max_num_seqs=4,
                        enable_prefix_caching=True, block_size=32, runner=runner)
        assert run.runner == runner
        hits[name] = run.metrics["vllm:prefix_cache_hits"]
    assert hits["none"] > 0 and hits["dlite"] == hits["none"], hits


def _copy_ckpt(src: Path, dst: Path, edit=None) -> Path:
    shutil.copytree(src, dst)
    if edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _set_dlite(key, value):
    def edit(cfg):
        cfg["dlite_config"][key] = value
    return edit


@pytest.mark.parametrize(
    "case, error, needle",
    [
        ("missing_dir", FileNotFoundError, "DLite checkpoint directory not found"),
        ("missing_weights", FileNotFoundError, "model.safetensors is missing"),
        ("not_dlite", ValueError, "not a DLite checkpoint"),
        ("wrong_version", ValueError, "architecture_version = 'dlite_v2' is not supported"),
        ("layers_off_rule", ValueError, "requires the authors' layer-id rule"),
        ("old_format", ValueError, "old vllm-dlite format"),
        ("hidden_mismatch", ValueError, "has hidden_size=128"),
        ("vocab_mismatch", ValueError, "has vocab_size=500"),
        ("layers_mismatch", ValueError, "has 6 layers"),
        ("mask_outside_vocab", ValueError, "mask_token_id = 384 is invalid"),
        ("k_too_large", ValueError, "drafts K=4 tokens per round"),
        ("no_model", ValueError, 'needs "model"'),
        ("truncated", ValueError, "is truncated"),
        ("missing_tensor", ValueError, "missing tensors ['norm.weight']"),
        ("wrong_dtype", ValueError, "has dtype I32"),
        ("wrong_shape", ValueError, "tensor 'norm.weight' has shape ("),
    ],
)
def test_bad_config_errors(models, tmp_path, case, error, needle):
    cfg = _target_dict(models)
    spec = dlite(models.drafter)
    if case == "missing_dir":
        spec = dlite(tmp_path / "nope")
    elif case == "missing_weights":
        d = _copy_ckpt(models.drafter, tmp_path / "d")
        (d / "model.safetensors").unlink()
        spec = dlite(d)
    elif case == "not_dlite":
        spec = dlite(models.target)  # a plain Qwen3 directory
    elif case == "wrong_version":
        spec = dlite(_copy_ckpt(models.drafter, tmp_path / "d", _set_dlite("architecture_version", "dlite_v2")))
    elif case == "layers_off_rule":
        spec = dlite(_copy_ckpt(models.drafter, tmp_path / "d", _set_dlite("target_layer_ids", [0, 1, 3, 3])))
    elif case == "old_format":
        spec = dlite(_copy_ckpt(models.drafter, tmp_path / "d", lambda c: c.update(
            dlite_config={"target_layer_ids": [1, 2, 3, 4], "head_rank": 8, "block_size": 4})))
    elif case == "hidden_mismatch":
        cfg = dict(cfg, hidden_size=128)
    elif case == "vocab_mismatch":
        cfg = dict(cfg, vocab_size=500)
    elif case == "layers_mismatch":
        cfg = dict(cfg, num_hidden_layers=6)
    elif case == "mask_outside_vocab":
        spec = dlite(_copy_ckpt(models.drafter, tmp_path / "d", _set_dlite("mask_token_id", H.TARGET_VOCAB)))
    elif case == "k_too_large":
        spec = dlite(models.drafter, num_speculative_tokens=H.BLOCK_K + 1)
    elif case == "no_model":
        spec = {"method": "dlite"}
    elif case in CHECKPOINT_FAULTS:
        d = _copy_ckpt(models.drafter, tmp_path / "d")
        damage_weights(d / "model.safetensors", case, tensor="norm.weight")
        spec = dlite(d)
    with pytest.raises(error) as err:
        plugin.prepare_speculative_config(spec, cfg)
    assert needle in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
    if case in CHECKPOINT_FAULTS:
        assert str(tmp_path / "d" / "model.safetensors") in str(err.value)


def test_bad_config_error_surfaces_from_engine_args(models, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    plugin.register()
    bad = _copy_ckpt(models.drafter, tmp_path / "d", _set_dlite("target_layer_ids", [0, 1, 3, 3]))
    with pytest.raises(ValueError, match="requires the authors' layer-id rule"):
        EngineArgs(
            model=str(models.target), dtype="float32", max_model_len=256,
            speculative_config=dlite(bad),
        ).create_engine_config()


# =========================================================================== end to end
@pytest.fixture(scope="module")
def g2(models):
    """G = 2 drafters (x_{a-1} in the query and priming the head): random and copy; and a random
    G = 3 drafter (``random3``: V2 reads x_{a-2} from the request's token history)."""
    root = models.root
    if not (root / "drafter_g2" / "config.json").exists():
        H.make_random_drafter(root / "drafter_g2", models.target, seed=2, anchor_group_size=2)
        H.make_copy_drafter(root / "copy_drafter_g2", models.target, anchor_group_size=2)
        H.make_random_drafter(root / "drafter_g3", models.target, seed=5, anchor_group_size=3)
    return {"random": root / "drafter_g2", "copy": root / "copy_drafter_g2", "random3": root / "drafter_g3"}


@pytest.mark.slow
@pytest.mark.parametrize("G, batch_size", [(1, 1), (1, 4), (1, 16), (2, 4)])
def test_greedy_lossless_random_drafter(models, g2, prompts, greedy, baseline, runner, G, batch_size):
    drafter = models.drafter if G == 1 else g2["random"]
    run = H.run_llm(models.target, prompts, greedy, dlite(drafter), max_num_seqs=batch_size, runner=runner)
    assert run.runner == runner
    assert run.drafter_types == [DRAFTER_TYPE[runner]]
    assert run.token_ids == baseline.token_ids
    assert run.metrics["vllm:spec_decode_num_drafts"] > 0
    # no draft KV cache: same pool as without speculation
    assert run.num_gpu_blocks == baseline.num_gpu_blocks


@pytest.mark.slow
@pytest.mark.parametrize("G", [1, 2])
def test_greedy_lossless_with_acceptances_and_metrics(models, g2, prompts, greedy, baseline, runner, G):
    drafter = models.copy_drafter if G == 1 else g2["copy"]
    run = H.run_llm(models.target, prompts, greedy, dlite(drafter), max_num_seqs=4, runner=runner)
    assert run.runner == runner
    assert run.token_ids == baseline.token_ids
    m = run.metrics
    drafts, drafted = m["vllm:spec_decode_num_drafts"], m["vllm:spec_decode_num_draft_tokens"]
    accepted = m["vllm:spec_decode_num_accepted_tokens"]
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert drafted == drafts * H.BLOCK_K
    assert 0 < accepted < drafted and sum(per_pos) == accepted
    assert list(per_pos) == sorted(per_pos, reverse=True)
    tau = 1 + accepted / drafts  # vLLM's mean acceptance length (bonus token included)
    assert tau > 1.2, tau


@pytest.mark.slow
def test_fewer_speculative_tokens_run_fewer_head_steps(models, prompts, greedy, baseline, runner):
    """num_speculative_tokens = k < K: the drafter runs k head steps (drafts [B, k]), lossless."""
    run = H.run_llm(models.target, prompts[:8], greedy, dlite(models.copy_drafter, num_speculative_tokens=2),
                    max_num_seqs=4, record=True, runner=runner)
    assert run.runner == runner
    assert run.token_ids == baseline.token_ids[:8]
    assert run.records and all(r["drafts"].shape[1] == 2 for r in run.records)
    assert len(run.metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]) == 2
    assert run.metrics["vllm:spec_decode_num_accepted_tokens"] > 0


@pytest.mark.slow
def test_draft_length_by_batch_size(models, prompts, greedy, baseline, runner):
    """vLLM's own dynamic speculation (``num_speculative_tokens_per_batch_size``): the step's k is
    chosen by batch size and the DLite head runs exactly that many steps; lossless."""
    schedule = [(1, 2, H.BLOCK_K), (3, 16, 2)]  # (first batch size, last, k)
    run = H.run_llm(models.target, prompts[:10], greedy,
                    dlite(models.copy_drafter, num_speculative_tokens_per_batch_size=schedule),
                    max_num_seqs=4, record=True, runner=runner)
    assert run.runner == runner and run.token_ids == baseline.token_ids[:10]
    widths = {r["drafts"].shape[1] for r in run.records}
    assert widths == {2, H.BLOCK_K}, widths
    assert run.metrics["vllm:spec_decode_num_accepted_tokens"] > 0


def _offline_drafter(drafter_dir: Path, target_dir: Path):
    """The shipped-format drafter bound to the target's embedding and final norm (from files)."""
    from safetensors.torch import load_file

    from vllm_dlite.model import load_drafter

    w = load_file(str(target_dir / "model.safetensors"))
    drafter = load_drafter(drafter_dir, dtype=torch.float32)
    drafter.bind_target(w["model.embed_tokens.weight"], w["model.norm.weight"],
                        H.target_config(target_dir)["rms_norm_eps"])
    return drafter


@pytest.mark.slow
@pytest.mark.parametrize("G", [1, 2, 3])
def test_served_features_and_drafts_match_hf(models, g2, prompts, greedy, runner, G):
    """aux hidden states served by vLLM == HF's at a-1, the G tokens vLLM hands the drafter are
    the sequence's x_{a-G+1..a}, and in-engine drafts == offline drafts."""
    from transformers import AutoTokenizer

    drafter_dir = {1: models.drafter, 2: g2["random"], 3: g2["random3"]}[G]
    sub = prompts[:8]
    run = H.run_llm(models.target, sub, greedy, dlite(drafter_dir), max_num_seqs=4, record=True, runner=runner)
    assert run.runner == runner and run.records
    tok = AutoTokenizer.from_pretrained(str(models.target))
    drafter = _offline_drafter(drafter_dir, models.target)
    aux = drafter.config.aux_layer_ids
    seqs = []
    hf_model = H._hf_model(str(models.target))
    for p, out in zip(sub, run.token_ids):
        ids = tok(p)["input_ids"] + out
        # a request's last round may accept past max_tokens (vLLM truncates the output, its
        # discarded drafts start from the untruncated anchor): extend greedily with HF
        with torch.no_grad():
            ids = hf_model.generate(torch.tensor([ids]), max_new_tokens=H.BLOCK_K + 1, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0].tolist()
        seqs.append((ids, H.hf_features(models.target, ids, aux)))

    matched, max_err = 0, 0.0
    for rec in run.records:
        B = rec["group_ids"].shape[0]
        assert rec["group_ids"].shape[1] == G and rec["group_lens"] is None
        feats = rec["features"].view(B, len(aux), H.TARGET_HIDDEN)
        for b in range(B):
            group = rec["group_ids"][b].tolist()
            best = None
            for ids, hf in seqs:
                for t in range(G, len(ids)):  # anchor at t: group = ids[t-G+1..t]
                    if ids[t - G + 1: t + 1] != group:
                        continue
                    err = (hf[t - 1] - feats[b]).abs().max().item()
                    if best is None or err < best[0]:
                        best = (err, hf[t - 1])
            assert best is not None, f"tokens {group} not found in any sequence"
            assert best[0] < 1e-3 * max(1.0, feats[b].abs().max().item()), best[0]
            max_err = max(max_err, best[0])
            offline = drafter.draft(best[1][None], torch.tensor([group])).token_ids[0]
            assert offline.tolist() == rec["drafts"][b].tolist()
            matched += 1
    assert matched >= len(sub) * (MAX_TOKENS - 1)  # one row per request per step (few acceptances)
    print(f"G={G}: matched {matched} drafting rows, max |vLLM - HF| feature error {max_err:.2e}")


@pytest.mark.slow
def test_chunked_prefill_preemption_and_early_finish(models, runner):
    # ~45-token prompts > max_num_batched_tokens=32: every prefill is chunked
    long_prompts = [(" ".join(H.PROMPTS[(i + j) % len(H.PROMPTS)] for j in range(8)) + f" {i}") for i in range(12)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + 5 * (i % 6), ignore_eos=(i % 3 != 0))
        for i in range(len(long_prompts))
    ]
    base = H.run_llm(models.target, long_prompts, params, max_num_seqs=12, runner=runner)
    spec = H.run_llm(
        models.target, long_prompts, params, dlite(models.copy_drafter),
        max_num_seqs=12, max_num_batched_tokens=32, block_size=32, num_gpu_blocks_override=8, max_model_len=128,
        enable_prefix_caching=False, runner=runner,
    )
    assert spec.runner == runner
    print("preemptions", spec.metrics.get("vllm:num_preemptions"), "blocks", spec.num_gpu_blocks)
    assert spec.token_ids == base.token_ids
    assert spec.metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    assert spec.metrics.get("vllm:num_preemptions", 0) > 0, "no preemption happened"


@pytest.mark.slow
def test_probabilistic_drafts_mixed_batch(models, prompts, baseline, runner):
    sub = prompts[:12]
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, seed=i)
        for i in range(len(sub))
    ]
    run = H.run_llm(
        models.target, sub, params,
        dlite(models.copy_drafter, draft_sample_method="probabilistic"),
        max_num_seqs=6, record=True, runner=runner,
    )
    assert run.runner == runner
    for i in range(0, len(sub), 2):  # greedy requests stay exactly the no-spec greedy output
        assert run.token_ids[i] == baseline.token_ids[i]
    sampled_calls = [r for r in run.records if r["temperatures"] is not None]
    assert sampled_calls, "no probabilistic drafting call"
    for r in sampled_calls:
        assert r["logits"] is not None and r["logits"].shape[:2] == r["drafts"].shape
    assert run.metrics["vllm:spec_decode_num_accepted_tokens"] > 0


# =========================================================================== Model Runner V2
def _v2_speculator(models, drafter_dir):
    """A DLiteSpeculator from the wrapped init_speculator, its drafter bound to the target's tensors
    (read from files), and that offline drafter."""
    from types import SimpleNamespace

    import vllm.v1.worker.gpu.spec_decode as spec_decode
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dlite.vllm.draft_model import DFlashDLiteDraftModel
    from vllm_dlite.vllm.speculator_v2 import DLiteSpeculator

    plugin.register()
    config = EngineArgs(
        model=str(models.target), dtype="float32", max_model_len=256, max_num_seqs=8,
        speculative_config=dlite(drafter_dir),
    ).create_engine_config()
    spec = spec_decode.init_speculator(config, torch.device("cpu"), None)
    assert isinstance(spec, DLiteSpeculator)
    spec.model = DFlashDLiteDraftModel(vllm_config=config)
    drafter = _offline_drafter(drafter_dir, models.target)
    norm = SimpleNamespace(weight=drafter._final_norm_weight, variance_epsilon=drafter._final_norm_eps)
    target = SimpleNamespace(model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=drafter.embed_weight), norm=norm))
    spec.model.bind_target_model(target)
    return spec, drafter


def _fake_v2_batch(L: int):
    """req0 decode (4 drafts, 2 rejected), req1 prefill (6 rows), req2 partial prefill chunk, in
    V2's shapes (``vllm/v1/worker/gpu/states.py``): last_sampled_tokens [max_num_reqs, 1],
    next_prefill_tokens [num_prefill_lookahead, max_num_reqs]."""
    from types import SimpleNamespace

    qsl = torch.tensor([0, 5, 11, 14], dtype=torch.int32)
    num_tokens = int(qsl[-1])
    aux = [torch.randn(num_tokens, H.TARGET_HIDDEN) for _ in range(L)]
    input_ids = torch.arange(num_tokens, dtype=torch.int32) + 40
    batch = SimpleNamespace(num_reqs=3, query_start_loc=qsl, input_ids=input_ids,
                            idx_mapping=torch.tensor([5, 0, 2], dtype=torch.int32))
    inputs = dict(num_sampled=torch.tensor([3, 1, 0], dtype=torch.int32),
                  num_rejected=torch.tensor([2, 0, 0], dtype=torch.int32),
                  last_sampled=(torch.arange(8) + 100)[:, None],
                  next_prefill_tokens=(torch.arange(8, dtype=torch.int32) + 200)[None, :])
    rows, anchors = [2, 10, 13], [105, 100, 202]  # the rows before each anchor, and the anchors
    feats = torch.stack([torch.stack([a[r] for a in aux]) for r in rows])
    return batch, aux, inputs, feats, input_ids[rows].long(), torch.tensor(anchors)


def _propose(spec, batch, aux, inputs, temperature=None, **kwargs):
    return spec.propose(batch, {}, {}, aux[-1], aux, inputs["num_sampled"], inputs["num_rejected"],
                        inputs["last_sampled"], inputs["next_prefill_tokens"],
                        torch.zeros(8) if temperature is None else temperature, torch.zeros(8, dtype=torch.long),
                        **kwargs)


@pytest.mark.parametrize("G", [1, 2])
def test_v2_speculator_skips_a_step_that_asks_for_no_drafts(models, g2, G, monkeypatch):
    """vLLM 0.34 calls ``propose(..., num_speculative_tokens=0)`` on steps whose drafts are not used
    (``skip_drafts``): DLite keeps no state, so the drafter does not run at all; k = 2 still drafts 2."""
    spec, _ = _v2_speculator(models, models.drafter if G == 1 else g2["random"])
    spec.init_cudagraph_manager(None)
    batch, aux, inputs, *_ = _fake_v2_batch(len(spec.dlite_config.target_layer_ids))
    calls = []
    original = spec.model.propose_drafts
    monkeypatch.setattr(spec.model, "propose_drafts", lambda *a, **kw: calls.append(kw.get("k")) or original(*a, **kw))
    assert _propose(spec, batch, aux, inputs, num_speculative_tokens=0).shape[0] == batch.num_reqs
    assert calls == []
    _propose(spec, batch, aux, inputs, num_speculative_tokens=2)
    assert calls == [2]


@pytest.mark.parametrize("G", [1, 2])
def test_v2_speculator_on_cpu_with_fake_batch(models, g2, G):
    """DLiteSpeculator (Model Runner V2) is created by the wrapped init_speculator; its row/token
    gathering and drafting are checked on CPU against the offline drafter, with V2's tensor shapes;
    probabilistic draft logits are written into either release's draft_logits; the graph holder's
    constructor arguments bind this vLLM's CudaGraphManager (compat.graph_manager_decode_query; the
    manager itself needs vLLM's distributed groups, so it is not built here)."""
    import inspect
    from types import SimpleNamespace

    from vllm_dlite.vllm import compat
    from vllm_dlite.vllm.speculator_v2 import CudaGraphManager

    spec, drafter = _v2_speculator(models, models.drafter if G == 1 else g2["random"])
    spec.init_cudagraph_manager(None)
    assert spec.graphs is None and spec.draft_attn_layer_names == set()
    kwargs = compat.graph_manager_decode_query(CudaGraphManager, query_len=1, max_num_reqs=spec.max_num_reqs)
    inspect.signature(CudaGraphManager.__init__).bind(None, spec.vllm_config, spec.device, None, **kwargs)
    batch, aux, inputs, feats, previous, anchors = _fake_v2_batch(len(spec.dlite_config.target_layer_ids))
    drafts = _propose(spec, batch, aux, inputs)
    group = anchors[:, None] if G == 1 else torch.stack([previous, anchors], dim=1)  # x_{a-1}: the row's input
    expected = drafter.draft(feats, group)
    assert drafts.tolist() == expected.token_ids.tolist()

    # probabilistic drafting: pre-temperature logits land in draft_logits at row req_state, whether
    # draft_logits is 0.32's tensor or 0.34's DraftLogitsCache (a fake: .values, .row_mapping None)
    K = spec.num_speculative_steps
    for release in ("0.32", "0.34"):
        values = torch.zeros(8, K, H.TARGET_VOCAB)
        spec.draft_logits = values if release == "0.32" else SimpleNamespace(values=values, row_mapping=None)
        temps = torch.zeros(8)
        temps[0] = 0.7  # req1 (state 0) samples; req0 (state 5) and req2 (state 2) are greedy
        drafts = _propose(spec, batch, aux, inputs, temps)
        assert drafts[0].tolist() == expected.token_ids[0].tolist()
        assert drafts[2].tolist() == expected.token_ids[2].tolist()
        for state, b in ((5, 0), (0, 1), (2, 2)):
            if b != 1:  # greedy rows: exactly the offline logits
                torch.testing.assert_close(values[state], expected.logits[b])
            else:  # sampled row: logits of the sampled prefix (first position is prefix-free)
                torch.testing.assert_close(values[state][0], expected.logits[b][0])
        assert values[1].abs().sum() == 0, release  # untouched request state


def adaptive_verification_check(target: str, drafter_dir: str) -> dict:
    """In a V2 process (vLLM's estimator kernels are Triton: the harness's interpreter): a
    DLiteSpeculator with vLLM's OnlineAcceptanceEstimator in place (what load_model builds when
    ``enable_adaptive_verification`` is on; vLLM refuses the option on CPU before that, for want
    of CUDA graphs) drafts the fake batch, eagerly and through the graph step."""
    from types import MethodType, SimpleNamespace

    from vllm.v1.worker.gpu.spec_decode.acceptance_estimator import OnlineAcceptanceEstimator

    spec, drafter = _v2_speculator(SimpleNamespace(target=Path(target)), Path(drafter_dir))
    spec.init_cudagraph_manager(None)
    K, G = spec.num_speculative_steps, spec.dlite_config.anchor_group_size
    batch, aux, inputs, feats, previous, anchors = _fake_v2_batch(len(spec.dlite_config.target_layer_ids))
    plain = _propose(spec, batch, aux, inputs).clone()  # adaptive verification off
    temps = torch.zeros(8)
    temps[0] = 0.7  # req1 (state 0) samples; greedy rows count as T = 1 in the estimator
    spec.acceptance_estimator = OnlineAcceptanceEstimator(spec.max_num_reqs, K, spec.device)
    spec.draft_token_confidence_probs.fill_(-1.0)
    drafts = _propose(spec, batch, aux, inputs, temps).clone()
    eager = spec.draft_token_confidence_probs[:3].clone()
    # vLLM's estimator on the offline drafter's logits, position by position
    group = anchors[:, None] if G == 1 else torch.stack([previous, anchors], dim=1)
    logits = drafter.draft(feats, group).logits  # [3, K, V]
    reference = OnlineAcceptanceEstimator(spec.max_num_reqs, K, spec.device)
    want = torch.full((8, K), -1.0)
    for j in range(K):
        reference.predict(logits[:, j].contiguous(), batch.idx_mapping, torch.tensor(j, dtype=torch.int32),
                          want, temps)
    # a step with 2 speculative tokens: 2 positions estimated, the rest not drafted (0)
    spec.draft_token_confidence_probs.fill_(-1.0)
    _propose(spec, batch, aux, inputs, temps, num_speculative_tokens=2)
    short = spec.draft_token_confidence_probs[:3].clone()
    # the graph step (replayed here by running the captured function itself)
    graphs = SimpleNamespace(draft_graphs={4: SimpleNamespace(replay=lambda: spec._draft_static(4))})
    graphs.padded_size = lambda n: 4
    spec.graphs = graphs
    spec.draft_token_confidence_probs.fill_(-1.0)
    graphed_drafts = _propose(spec, batch, aux, inputs, temps).clone()
    graphed = spec.draft_token_confidence_probs[:4].clone()
    return dict(drafts_unchanged=torch.equal(drafts, plain), graphed_drafts_unchanged=torch.equal(graphed_drafts, plain),
                eager=eager, want=want[:3], short=short, graphed=graphed)


@pytest.mark.slow
@pytest.mark.parametrize("G", [1, 2])
def test_v2_adaptive_verification_reads_the_head_distribution(models, g2, G):
    """``"enable_adaptive_verification": true`` with DLite: the speculator feeds vLLM's acceptance
    estimator the sequential head's logits at every draft position, so vLLM's runner can choose the
    draft slots it verifies. The drafts are the same with it as without (what verification does
    with them is vLLM's rejection sampler: lossless); the confidences are the estimator's own
    prediction from the offline drafter's logits, with each request's state and temperature;
    positions a short step did not draft read 0; a padded graph row (request state -1) is skipped."""
    from lab.harness.runners import call_with_runner

    out = call_with_runner("v2", "test_vllm_integration:adaptive_verification_check", str(models.target),
                           str(models.drafter if G == 1 else g2["random"]))
    assert out["drafts_unchanged"] and out["graphed_drafts_unchanged"]
    assert ((out["eager"] > 0) & (out["eager"] < 1)).all()
    torch.testing.assert_close(out["eager"], out["want"])
    torch.testing.assert_close(out["short"][:, :2], out["want"][:, :2])
    assert (out["short"][:, 2:] == 0).all()
    torch.testing.assert_close(out["graphed"][:3], out["want"])
    assert (out["graphed"][3] == -1).all()  # the padding row: not a request, not estimated


@pytest.mark.parametrize("G", [1, 2])
def test_v2_graph_step_over_static_buffers(models, g2, G):
    """The CUDA-graph path without the GPU: capture sizes, a batch padded to the next captured size,
    and the whole draft step replayed over the static buffers (here by running the captured function
    itself, ``_draft_static``); rows past the batch hold stale inputs and must not matter."""
    from types import MethodType, SimpleNamespace

    from vllm_dlite.vllm.speculator_v2 import _capture_sizes, _DLiteGraphs

    assert _capture_sizes(8) == [1, 2, 4, 8] and _capture_sizes(6) == [1, 2, 4, 6] and _capture_sizes(1) == [1]
    spec, drafter = _v2_speculator(models, models.drafter if G == 1 else g2["random"])
    assert spec.features.shape == (8, spec.dlite_config.num_feature_layers, H.TARGET_HIDDEN)
    assert spec.group_ids.shape == (8, G) and spec.draft_tokens.shape == (8, spec.num_speculative_steps)
    replays = []

    class Graph:  # what torch.cuda.CUDAGraph.replay() re-runs: the step captured at this size
        def __init__(self, size):
            self.size = size

        def replay(self):
            replays.append(self.size)
            spec._draft_static(self.size)

    graphs = SimpleNamespace(sizes=[1, 2, 4, 8], draft_graphs={n: Graph(n) for n in (1, 2, 4, 8)})
    graphs.padded_size = MethodType(_DLiteGraphs.padded_size, graphs)
    assert [graphs.padded_size(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    spec.graphs = graphs
    torch.manual_seed(0)
    spec.features.normal_()  # stale rows from an earlier, larger batch
    spec.group_ids.random_(0, H.TARGET_VOCAB)
    batch, aux, inputs, feats, previous, anchors = _fake_v2_batch(len(spec.dlite_config.target_layer_ids))
    drafts = _propose(spec, batch, aux, inputs)
    assert replays == [4]  # 3 requests replay the size-4 graph
    group = anchors[:, None] if G == 1 else torch.stack([previous, anchors], dim=1)
    assert drafts.tolist() == drafter.draft(feats, group).token_ids.tolist()
    # a step with fewer speculative tokens than captured runs eagerly, k head steps
    replays.clear()
    drafts = spec.propose(batch, {}, {}, aux[-1], aux, inputs["num_sampled"], inputs["num_rejected"],
                          inputs["last_sampled"], inputs["next_prefill_tokens"], torch.zeros(8),
                          torch.zeros(8, dtype=torch.long), num_speculative_tokens=2)
    assert replays == [] and drafts[:, :2].tolist() == drafter.draft(feats, group, k=2).token_ids.tolist()


@pytest.mark.slow
def test_untied_target_shares_only_embedding_and_final_norm(tmp_path_factory, greedy, runner):
    """Untied target: the drafter uses the target's embed_tokens (not its lm_head) and final norm
    (checked by comparing in-engine drafts with the offline drafter bound to those tensors)."""
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("untied")
    target = H.make_tiny_target(root / "target", tie_word_embeddings=False, seed=3)
    drafter_dir = H.make_random_drafter(root / "drafter", target, seed=4)
    sub = H.make_prompts(6)
    base = H.run_llm(target, sub, greedy, max_num_seqs=6, runner=runner)
    run = H.run_llm(target, sub, greedy, dlite(drafter_dir), max_num_seqs=6, record=True, runner=runner)
    assert run.runner == runner and run.token_ids == base.token_ids
    w = load_file(str(target / "model.safetensors"))
    assert not torch.equal(w["model.embed_tokens.weight"], w["lm_head.weight"])
    drafter = _offline_drafter(drafter_dir, target)
    n = 0
    for rec in run.records:
        B = rec["group_ids"].shape[0]
        feats = rec["features"].view(B, len(drafter.config.target_layer_ids), -1)
        offline = drafter.draft(feats, rec["group_ids"]).token_ids
        assert offline.tolist() == rec["drafts"].tolist()
        n += B
    assert n > 0
