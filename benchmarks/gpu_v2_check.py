#!/usr/bin/env python3
"""DLite on vLLM's Model Runner V2 (the GPU default), with random-weight tiny models (< 8 minutes).

    python benchmarks/gpu_v2_check.py --out $OUT          # on a CUDA machine with vllm==0.32.*
    python benchmarks/gpu_v2_check.py --out /tmp/x         # on CPU: the same checks on Model Runner V1

Checks, each recorded in ``v2_check.json`` / ``v2_check.md``:
1. the engine with ``{"method": "dlite"}`` builds the DLite speculator of the model runner in use
   (``DLiteSpeculator`` on V2, ``DLiteProposer`` on V1) and no draft KV: the KV pool equals the
   pool without speculation;
2. greedy outputs with DLite are identical to no speculation on 32 prompts at max batch 16, with
   CUDA graphs on (the default; V2 captures one draft-step graph per batch size) and with
   ``enforce_eager`` (the copy drafter gets real acceptances, so accept/bookkeeping paths run);
3. spec-decode counters: drafts > 0, accepted > 0; tau reported;
4. sampled requests (temperature 0.8, probabilistic drafts) complete in a mixed batch.
Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the random tiny-model builders the tests use


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    import helpers_vllm as H

    on_gpu = torch.cuda.is_available()
    H.apply_vllm_env()  # in-process engine: the check reads the model runner's drafter
    from vllm import SamplingParams

    models = H.tiny_models(Path(tempfile.mkdtemp(prefix="dlite-v2-")))
    prompts = H.make_prompts(args.num_prompts)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    spec = {"method": "dlite", "model": str(models.copy_drafter), "num_speculative_tokens": H.BLOCK_K}
    engine = dict(max_num_seqs=16)
    if on_gpu:
        engine.update(enforce_eager=False, gpu_memory_utilization=0.3)
    checks: list[dict] = []
    report: dict = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "checks": checks}
    t0 = time.time()

    def check(name, fn):
        try:
            ok, detail = fn()
        except Exception as exc:  # noqa: BLE001 - recorded and reported
            ok, detail = False, f"{exc!r}\n{traceback.format_exc()[-1500:]}"
        checks.append(dict(name=name, ok=bool(ok), detail=detail))
        print(f"[{'ok' if ok else 'FAIL'}] {name}: {str(detail)[:300]}", flush=True)

    base = H.run_llm(models.target, prompts, greedy, **engine)
    for mode, extra in (("cuda graphs" if on_gpu else "default", {}), ("eager", {"enforce_eager": True})):
        run = H.run_llm(models.target, prompts, greedy, spec, **{**engine, **extra})
        m = run.metrics
        drafts, accepted = m.get("vllm:spec_decode_num_drafts", 0), m.get("vllm:spec_decode_num_accepted_tokens", 0)
        report[mode] = dict(drafter=run.drafter_types, drafts=drafts, accepted=accepted,
                            tau=1 + accepted / drafts if drafts else None, kv_blocks=run.num_gpu_blocks)
        check(f"{mode}: DLite speculator in the runner", lambda: (
            any("DLite" in t for t in run.drafter_types), run.drafter_types))
        check(f"{mode}: no draft KV (pool == no speculation)", lambda: (
            run.num_gpu_blocks == base.num_gpu_blocks, f"{run.num_gpu_blocks} vs {base.num_gpu_blocks} blocks"))
        check(f"{mode}: greedy identical on {len(prompts)} prompts", lambda: (
            run.token_ids == base.token_ids,
            f"{sum(a == b for a, b in zip(run.token_ids, base.token_ids))}/{len(prompts)} identical"))
        check(f"{mode}: drafts accepted", lambda: (drafts > 0 and accepted > 0, report[mode]))

    mixed = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, max_tokens=args.max_tokens,
                            ignore_eos=True, seed=i) for i in range(len(prompts))]
    run = H.run_llm(models.target, prompts, mixed, {**spec, "draft_sample_method": "probabilistic"}, **engine)
    check("probabilistic drafts, mixed greedy/sampled batch", lambda: (
        all(len(t) == args.max_tokens for t in run.token_ids)
        and all(run.token_ids[i] == base.token_ids[i] for i in range(0, len(prompts), 2)),
        "sampled rows complete; greedy rows identical to no speculation"))

    report["wall_s"] = round(time.time() - t0, 1)
    (args.out / "v2_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    lines = [f"# DLite on vLLM's model runner ({report['device']}), {report['wall_s']} s", "",
             "| check | ok | detail |", "| --- | --- | --- |"]
    lines += [f"| {c['name']} | {'yes' if c['ok'] else 'NO'} | {str(c['detail'])[:200]} |" for c in checks]
    (args.out / "v2_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
