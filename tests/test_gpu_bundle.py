"""The GPU bundle (scripts/gpu/build_bundle.py + unpack.py) on a small fake vLLM wheel, and the dry
mode of benchmarks/gpu_check.py. Fast: no download, no vLLM import.

The fake wheel has the real wheel's names for the files the rules decide on: a pruned
``_C_stable_libtorch.abi3.so`` (a minimal ELF64 written here, with a ``.nv_fatbin`` section holding
three fatbin containers), FA3, a small ``.so``, left-out ``.so`` files, the Rust binary, headers,
Python files and a dist-info; a second wheel has ``.data/purelib`` and ``.data/scripts`` members.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


bb = _load("gpu_build_bundle", REPO / "scripts/gpu/build_bundle.py")
up = _load("gpu_unpack", REPO / "scripts/gpu/unpack.py")


# ---------------------------------------------------------------------------- fake ELF with a fatbin
def fatbin_container(entries: list[tuple[int, int, bytes]]) -> bytes:
    """One fatbin container: header (magic, version, header size 16, size of the entries), then per
    entry a 0x48-byte header (kind 1 = PTX / 2 = ELF, header size, payload size, arch at 0x1C)."""
    body = b""
    for kind, arch, payload in entries:
        head = bytearray(0x48)
        struct.pack_into("<HHIQ", head, 0, kind, 0x101, 0x48, len(payload))
        struct.pack_into("<I", head, 0x1C, arch)
        body += bytes(head) + payload
    return struct.pack("<IHHQ", bb.FATBIN_MAGIC, 1, 16, len(body)) + body


def payload(n: int, seed: int) -> bytes:
    rng = random.Random(seed)
    return bytes(rng.randrange(1, 256) for _ in range(n))  # no zero byte: zeroing is visible


CONTAINERS = [
    # (kind, arch, payload): sm_90 present -> keep every arch-90 entry
    [(2, 80, payload(300, 1)), (2, 90, payload(260, 2)), (1, 90, payload(200, 3)), (2, 100, payload(280, 4))],
    # no sm_90: keep the highest PTX <= 90 only
    [(2, 75, payload(120, 5)), (1, 80, payload(96, 6)), (1, 70, payload(64, 7))],
    # no sm_90, no PTX <= 90: keep everything
    [(2, 100, payload(80, 8))],
]


def make_elf(sections: list[tuple[str, bytes]]) -> bytes:
    """A minimal ELF64 (little endian, ET_DYN, x86-64) with the given PROGBITS sections, a
    ``.shstrtab`` and the section header table at the end (8-byte aligned everywhere)."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n, _ in sections) + b".shstrtab\0"
    body, offsets = bytearray(64), []
    for _, data in sections + [(".shstrtab", names)]:
        body += bytes(-len(body) % 8)
        offsets.append((len(body), len(data)))
        body += data
    body += bytes(-len(body) % 8)
    shoff, shnum = len(body), len(sections) + 2
    struct.pack_into("<4sBBBB8xHHIQQQIHHHHHH", body, 0, b"\x7fELF", 2, 1, 1, 0, 3, 62, 1, 0, 0, shoff,
                     0, 64, 0, 0, 64, shnum, shnum - 1)
    table = bytearray(64)  # the null section
    name_off = 1
    for i, ((name, _), (off, size)) in enumerate(zip(sections + [(".shstrtab", b"")], offsets)):
        typ = 3 if i == len(sections) else 1  # SHT_STRTAB / SHT_PROGBITS
        table += struct.pack("<IIQQQQIIQQ", name_off, typ, 2 if typ == 1 else 0, 0, off, size, 0, 0, 8, 0)
        name_off += len(name) + 1
    return bytes(body + table)


FATBIN = b"".join(fatbin_container(c) + bytes(-len(fatbin_container(c)) % 8) for c in CONTAINERS)
FAKE_C = make_elf([(".text", payload(512, 9)), (".nv_fatbin", FATBIN), (".rodata", payload(100, 10))])


def test_fake_elf_parses_like_readelf(tmp_path):
    secs = bb.elf_sections(FAKE_C)
    assert [s.name for s in secs] == ["", ".text", ".nv_fatbin", ".rodata", ".shstrtab"]
    if shutil.which("readelf") is None:
        pytest.skip("readelf not installed: the section table is checked by the project's own parser only")
    (tmp_path / "c.so").write_bytes(FAKE_C)
    out = subprocess.run(["readelf", "-S", "-W", str(tmp_path / "c.so")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ".nv_fatbin" in ln)
    fields = line.split("]")[1].split()
    fat = secs[2]
    assert (int(fields[3], 16), int(fields[4], 16)) == (fat.offset, fat.size)


def _zeroed_ranges(data: bytes) -> list[tuple[int, int]]:
    """(start, size) of every payload the rule must zero, in file offsets."""
    base = bb.elf_sections(data)[2].offset
    out, pos = [], 0
    for c in CONTAINERS:
        blob = fatbin_container(c)
        keep = {i for i, (_, a, _) in enumerate(c) if a == 90}
        if not keep:
            ptx = [(a, i) for i, (k, a, _) in enumerate(c) if k == 1 and a <= 90]
            keep = {max(ptx)[1]} if ptx else set(range(len(c)))
        e = pos + 16
        for i, (_, _, p) in enumerate(c):
            if i not in keep:
                out.append((base + e + 0x48, len(p)))
            e += 0x48 + len(p)
        pos += len(blob) + (-len(blob) % 8)
    return out


def test_prune_keeps_layout_and_zeroes_only_other_archs():
    pruned, stats = bb.prune_fatbin(FAKE_C)
    assert len(pruned) == len(FAKE_C)
    assert bb.elf_section_table(pruned) == bb.elf_section_table(FAKE_C)
    assert bb.elf_sections(pruned) == bb.elf_sections(FAKE_C)
    zeroed = _zeroed_ranges(FAKE_C)
    assert stats["containers"] == 3 and stats["entries"] == 8
    assert stats["zeroed"] == len(zeroed) == 4 and stats["kept"] == 4
    assert stats["zeroed_archs"] == {"sass_80": 1, "sass_100": 1, "sass_75": 1, "ptx_70": 1}
    expected = bytearray(FAKE_C)
    for start, size in zeroed:
        expected[start:start + size] = bytes(size)
    assert pruned == bytes(expected)  # every other byte (headers, .text, ...) untouched
    assert bb.prune_fatbin(pruned)[0] == pruned  # idempotent


def test_prune_on_a_real_elf_with_objcopy(tmp_path):
    tools = [t for t in ("objcopy", "readelf") if shutil.which(t) is None]
    if tools:
        pytest.skip(f"{' and '.join(tools)} not installed: the real-ELF variant needs binutils")
    host = Path(shutil.which("true") or "/bin/true").resolve()
    (tmp_path / "fat.bin").write_bytes(FATBIN)
    so = tmp_path / "real.so"
    subprocess.run(["objcopy", "--add-section", f".nv_fatbin={tmp_path / 'fat.bin'}",
                    "--set-section-flags", ".nv_fatbin=alloc,readonly,data", str(host), str(so)],
                   check=True, capture_output=True)
    data = so.read_bytes()
    pruned, stats = bb.prune_fatbin(data)
    (tmp_path / "pruned.so").write_bytes(pruned)
    assert len(pruned) == len(data) and stats["zeroed"] == 4
    sections = [subprocess.run(["readelf", "-S", "-W", str(p)], check=True, capture_output=True,
                               text=True).stdout.split("\n", 1)[1] for p in (so, tmp_path / "pruned.so")]
    assert sections[0] == sections[1]
    assert sum(a != b for a, b in zip(data, pruned)) > 0


# ---------------------------------------------------------------------------- fake wheels and bundle
def make_wheel(path: Path, files: dict[str, bytes], executable: tuple = ()) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, (2024, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if name in executable else 0o644) << 16
            z.writestr(info, data)
    return path


VLLM_FILES = {
    "vllm/__init__.py": b"__version__ = '0.32.0'\nfrom .sub import b\n",
    "vllm/sub/__init__.py": b"",
    "vllm/sub/b.py": b"VALUE = 42\n" * 50,
    "vllm/configs/fused.json": json.dumps({"k": list(range(200))}).encode(),
    "vllm/_C_stable_libtorch.abi3.so": FAKE_C,
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": payload(30_000, 11) + bytes(50_000),
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": payload(5_000, 12),
    "vllm/spinloop.abi3.so": payload(2_000, 13),
    "vllm/_moe_C_stable_libtorch.abi3.so": payload(3_000, 14),
    "vllm/_unknown_C.abi3.so": payload(1_000, 15),
    "vllm/vllm-rs": payload(4_000, 16),
    "vllm/third_party/deep_gemm/include/cute/x.hpp": b"// header\n",
    "vllm/scripts/run.sh": b"#!/bin/sh\necho hi\n",
    "vllm-0.32.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n",
    "vllm-0.32.0.dist-info/RECORD": b"",
}
VLLM_EXCLUDED = {"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so",
                 "vllm/_unknown_C.abi3.so", "vllm/vllm-rs", "vllm/third_party/deep_gemm/include/cute/x.hpp"}
DEP_FILES = {
    "dep/__init__.py": b"from dep_extra import EXTRA\n",
    "dep-1.0.data/purelib/dep_extra.py": b"EXTRA = 'extra'\n",
    "dep-1.0.data/scripts/dep-tool": b"#!/bin/sh\n",
    "dep-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: dep\nVersion: 1.0\n",
}


@pytest.fixture()
def wheels(tmp_path):
    v = make_wheel(tmp_path / "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", VLLM_FILES,
                   executable=("vllm/scripts/run.sh",))
    d = make_wheel(tmp_path / "dep-1.0-py3-none-any.whl", DEP_FILES)
    return v, d


BUDGET = 40 * 1024  # bytes per part (the real build: 64 MiB - working tree - margin)
RESERVE = 8 * 1024


def build_small(wheels, out: Path, budget: int = BUDGET, cache=None) -> dict:
    return bb.build(wheels[0], [wheels[1]], out, budget, preset=0, big_file=20_000, cache_dir=cache,
                    manifest_reserve=RESERVE, log=lambda s: None)


def expected_site() -> dict[str, bytes]:
    files = {k: v for k, v in VLLM_FILES.items() if k not in VLLM_EXCLUDED}
    files["vllm/_C_stable_libtorch.abi3.so"] = bb.prune_fatbin(FAKE_C)[0]
    files["dep/__init__.py"] = DEP_FILES["dep/__init__.py"]
    files["dep_extra.py"] = DEP_FILES["dep-1.0.data/purelib/dep_extra.py"]
    files["dep-1.0.dist-info/METADATA"] = DEP_FILES["dep-1.0.dist-info/METADATA"]
    return files


def test_bundle_parts_fit_and_manifest_accounts_for_every_file(wheels, tmp_path):
    out = tmp_path / "bundle"
    m = build_small(wheels, out)
    parts = sorted(out.glob("part-*"))
    assert len(parts) == m["num_parts"] >= 2  # the FA3 payload alone is over one part
    for p in parts:
        assert sum(f.stat().st_size for f in p.iterdir()) <= BUDGET
        assert (p / "manifest.json").read_bytes() == (parts[0] / "manifest.json").read_bytes()
    # chunks cover each blob exactly, in order
    for b in m["blobs"]:
        assert sum(c["size"] for c in b["chunks"]) == b["size"]
        assert [c["offset"] for c in b["chunks"]] == [sum(c["size"] for c in b["chunks"][:i])
                                                      for i in range(len(b["chunks"]))]
    _, fl = up.load_part(parts[0])
    vname, dname = wheels[0].name, wheels[1].name
    accounted = set(fl["files"]) | set(fl["excluded"])
    members = {f"{vname}:{n}" for n in VLLM_FILES} | {f"{dname}:{n}" for n in DEP_FILES}
    # every wheel member is carried (under its install path) or left out with a reason
    carried_members = {f"{vname}:{n}" for n in VLLM_FILES if n not in VLLM_EXCLUDED} | {
        f"{dname}:{n}" for n in DEP_FILES if "/scripts/" not in n}
    assert set(fl["excluded"]) == members - carried_members
    assert all(isinstance(r, str) and r for r in fl["excluded"].values())
    assert set(fl["files"]) == set(expected_site())
    assert len(accounted) == len(members)
    assert fl["excluded"][f"{vname}:vllm/_unknown_C.abi3.so"].startswith("compiled extension")
    assert set(fl["pruned"]) == {"vllm/_C_stable_libtorch.abi3.so"}
    assert fl["pruned"]["vllm/_C_stable_libtorch.abi3.so"]["original_sha256"] == bb.sha256_bytes(FAKE_C)


def test_too_small_budget_is_refused(wheels, tmp_path):
    with pytest.raises(ValueError, match="raise the budget"):
        build_small(wheels, tmp_path / "b", budget=RESERVE + 100)


def test_unpack_round_trip_any_order_idempotent(wheels, tmp_path):
    out, env = tmp_path / "bundle", tmp_path / "env"
    m = build_small(wheels, out, cache=tmp_path / "cache")
    parts = sorted(out.glob("part-*"))
    log = []
    for p in reversed(parts):  # last part first
        st = up.unpack(p, env, log=log.append)
        st = up.unpack(p, env, log=log.append)  # the same part again: nothing changes
        assert st["complete"] == (p == parts[0])
    assert up.status(env)["complete"] and up.status(env)["missing_parts"] == []
    assert not list((env / "chunks").iterdir())  # chunks are dropped once their blob is unpacked
    site = env / "site"
    got = {str(p.relative_to(site)): p.read_bytes() for p in site.rglob("*") if p.is_file()}
    assert got == expected_site()
    pruned = site / "vllm/_C_stable_libtorch.abi3.so"
    assert pruned.stat().st_size == len(FAKE_C)
    assert bb.elf_section_table(pruned.read_bytes()) == bb.elf_section_table(FAKE_C)
    assert os.access(site / "vllm/scripts/run.sh", os.X_OK)
    # a rebuild with the cache gives the same bundle; a different bundle wipes the folder
    assert build_small(wheels, out, cache=tmp_path / "cache")["bundle_id"] == m["bundle_id"]
    other = tmp_path / "other"
    bb.build(wheels[0], [], other, BUDGET, preset=0, big_file=20_000, manifest_reserve=RESERVE, log=lambda s: None)
    up.unpack(other / "part-1", env, log=log.append)
    assert not (site / "dep").exists() and any("wiping" in s for s in log)


def test_unpack_detects_a_damaged_chunk(wheels, tmp_path):
    out = tmp_path / "bundle"
    m = build_small(wheels, out)
    chunk = m["blobs"][0]["chunks"][0]
    f = out / f"part-{chunk['part']}" / chunk["file"]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="sha256"):
        up.unpack(f.parent, tmp_path / "env", log=lambda s: None)


def test_unpack_cli_runs_the_command_once_complete(wheels, tmp_path):
    out, env = tmp_path / "bundle", tmp_path / "env"
    build_small(wheels, out)
    parts = sorted(out.glob("part-*"))
    cmd = [sys.executable, str(REPO / "scripts/gpu/unpack.py"), "--env", str(env), "--run", "--",
           sys.executable, "-c", "import dep, vllm, vllm_dlite; print('RAN', dep.EXTRA, vllm.sub.b.VALUE)"]
    first = subprocess.run(cmd[:2] + [str(parts[0])] + cmd[2:], capture_output=True, text=True, timeout=60)
    assert first.returncode == 0 and "RAN" not in first.stdout and "waiting for parts" in first.stdout
    for p in parts[1:]:
        r = subprocess.run(cmd[:2] + [str(p)] + cmd[2:], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "RAN extra 42" in r.stdout


def test_real_rules_on_known_wheel_names():
    rules = bb.Rules()
    assert rules.decide("vllm/_C_stable_libtorch.abi3.so") == "prune"
    assert rules.decide("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so") is None
    assert rules.decide("vllm/v1/worker/gpu/model_runner.py") is None
    assert rules.decide("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so").startswith("FlashAttention 2")
    assert rules.decide("vllm/third_party/fmha_sm100/cutlass/include/cute/arch/mma_sm90.hpp")


def test_plan_chunks_uses_the_fewest_parts_filled_evenly():
    plan = bb.plan_chunks([10, 25, 3], 12)
    assert len(plan) == 4  # ceil(38 / 12)
    assert [sum(n for _, _, n in p) for p in plan] == [10, 10, 10, 8]
    assert plan[0] == [(0, 0, 10)] and plan[1] == [(1, 0, 10)] and plan[3] == [(1, 20, 5), (2, 0, 3)]
    assert [sum(n for _, _, n in p) for p in bb.plan_chunks([24], 12)] == [12, 12]
    assert bb.plan_chunks([], 5) == []


# ---------------------------------------------------------------------------- gpu_check dry mode
def test_gpu_check_dry_mode_on_cpu(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_check.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["dry_run"] is True and res["device"] == "no CUDA"
    assert [s["name"] for s in res["stages"]] == ["a_smoke", "b_lossless", "c_speed", "d_shapes"]
    assert all(s["status"] == "not run (no CUDA)" and s["would_run"] for s in res["stages"])
    assert res["vllm_imported"] is False
    assert res["model_runner"] is None and res["lossless_greedy"] is None
    assert "no CUDA" in (tmp_path / "results.md").read_text()


def test_gpu_check_stage_d_code_runs_on_cpu_at_tiny_shapes():
    """Stage d's code (benchmarks/gpu_shapes.py: target stack with KV cache, DLite drafter at given
    shapes, EAGLE-3/DFlash approximations, gpu_kernels.time_ms) at tiny shapes on CPU, so the GPU run
    meets no plain bug."""
    import gpu_shapes

    shapes = gpu_shapes.Qwen3Shapes(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=96,
                                    vocab=256, draft_layers=1, rank=64, features=3, eagle_vocab=64, dflash_layers=2)
    rec: dict = {}
    assert gpu_shapes.measure(rec, batches=[1, 2], contexts=[16, 32], iters=1, shapes=shapes)
    assert [(r["batch"], r["context"]) for r in rec["rows"]] == [(1, 16), (1, 32), (2, 16), (2, 32)]
    for r in rec["rows"]:
        assert all(r[f"{n}_ms"] > 0 for n in ("decode", "verify", "dlite", "eagle3", "dflash"))
        assert r["kv_buffers"] == 4 and r["dlite_over_verify"] > 0 and r["how"] == "cpu wall"
    assert "4 Qwen3 layers" in rec["what"]


@pytest.mark.slow
def test_gpu_check_stage_b_on_cpu(tmp_path):
    """Stage b's code end to end on the CPU (V1 runner, eager only, fp32, 4 prompts): engines with and
    without DLite, the runner/speculator probe, the checks, results.json/md."""
    pytest.importorskip("vllm")
    r = subprocess.run([sys.executable, str(REPO / "benchmarks/gpu_check.py"), "--out", str(tmp_path), "--cpu-smoke",
                        "--stages", "b", "--num-prompts", "4", "--b-batch", "4", "--b-max-tokens", "12"],
                       capture_output=True, text=True, timeout=900, cwd=REPO)
    res = json.loads((tmp_path / "results.json").read_text())
    assert r.returncode == 0, (res["lossless"].get("checks"), res["lossless"].get("error"), r.stdout[-2000:])
    b = res["lossless"]
    assert res["model_runner"] == "v1" and res["lossless_greedy"] is True and "DLite" in res["speculator"]
    assert {c["name"] for c in b["checks"]} >= {"eager: greedy identical to no speculation",
                                                "eager: no draft KV (pool == no speculation)"}
    assert "b_lossless" in (tmp_path / "results.md").read_text()


# ---------------------------------------------------------------------------- gpu_check's pieces on CPU
def test_waves_merge_into_one_level_result():
    """Stage c's batch levels (lab.harness.replay.replay_once with ``levels``): the waves of a level add
    up (tok/s over the summed wall, ITL weighted by requests, per-position acceptance by drafts)."""
    from lab.harness.replay import RunResult, merge_runs

    a = RunResult("x", [[1, 2, 3]], 1.0, 3, 3.0, 10.0, 100, 2, 8, 4, 3.0, [1.0, 1.0, 0.0, 0.0], [{"p": 1}])
    b = RunResult("x", [[4], [5, 6]], 2.0, 3, 1.5, 40.0, 100, 6, 24, 3, 1.5, [0.5, 0.0, 0.0, 0.0], [{"p": 2}])
    m = merge_runs("lvl", [a, b])
    assert m.outputs == [[1, 2, 3], [4], [5, 6]] and m.request_spec == [{"p": 1}, {"p": 2}]
    assert (m.wall_s, m.output_tokens, m.output_tokens_per_s) == (3.0, 6, 2.0)
    assert m.mean_itl_ms == 30.0  # (10 x 1 + 40 x 2) / 3 requests
    assert (m.num_drafts, m.num_draft_tokens, m.accepted_tokens, m.tau) == (8, 32, 7, 1 + 7 / 8)
    assert m.tau_per_position == [(2 * 1.0 + 6 * 0.5) / 8, 2 / 8, 0.0, 0.0]
    assert merge_runs("one", [a]).summary() == {**a.summary(), "method": "one"}


def test_ab_engine_kwargs_are_empty_on_cpu():
    import ab

    assert set(ab.COMPILE_MODES) == {"vllm", "none"}
    import torch

    if not torch.cuda.is_available():
        assert ab.engine_kwargs("none", 0.15) == {}
