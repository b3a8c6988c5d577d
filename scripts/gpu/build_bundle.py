#!/usr/bin/env python3
"""Build the vLLM bundle for the lent GPU machine (no network there; 64 MiB per run).

    .venv/bin/python scripts/gpu/build_bundle.py            # download (cached), select, prune, pack
    .venv/bin/python scripts/gpu/build_bundle.py --no-download --budget-mib 64 --margin-mib 4

What it makes (see scripts/gpu/README.md):

1. ``pip download`` (cp312, manylinux x86_64, ``--no-deps``) of ``vllm==0.32.0`` (the CUDA wheel) and
   the runtime wheels the device lacks (:data:`DEPENDENCY_WHEELS`), into the ignored cache
   ``.gpu-bundle-cache/wheels/`` (a second run downloads nothing).
2. The files to carry: from the vLLM wheel every Python file, data file and dist-info, the small
   ``.so`` files, FlashAttention 3 and ``_C_stable_libtorch`` with every non-sm_90 entry of its
   ``.nv_fatbin`` section zeroed (:func:`prune_fatbin`: the file keeps its size and section table,
   the zeros compress away); what is left out is listed with its reason (:data:`EXCLUDE_SO`,
   :data:`EXCLUDE_PATHS`, :data:`EXCLUDE_SUFFIXES`). From the other wheels every file (``.data/
   purelib|platlib`` mapped to the top; scripts and headers left out).
3. Compression units ("blobs"): each file over ``big_file`` bytes alone, the rest grouped by wheel
   family; each a deterministic ``tar`` compressed with ``xz -9e`` (Python's ``lzma``; cached in
   ``.gpu-bundle-cache/blobs/`` by content).
4. Parts: the blobs' bytes cut into chunks so that every ``part-N/`` folder (chunks + ``manifest.json``
   + ``filelist.json.xz``) stays under ``part_budget`` = 64 MiB - the working tree - a margin. The
   manifest lists the parts, every blob's and chunk's sha256, and (in the file list) every file's
   size, sha256 and mode, the pruned files and every left-out file with its reason.

``scripts/gpu/unpack.py`` puts the parts back together on the device. Stdlib only (plus pip for the
download); every function takes its inputs and budget as parameters (tests/test_gpu_bundle.py builds a
bundle from a fake wheel with a budget of a few KiB).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

REPO = Path(__file__).resolve().parents[2]
FORMAT = "vllm-dlite-gpu-bundle/1"
MIB = 1 << 20
RUN_LIMIT_BYTES = 64 * MIB  # working tree + carried paths per device run
VLLM_SPEC = "vllm==0.32.0"
# Runtime packages the device lacks for LLM, the engine core, Model Runner V2, qwen3 and the
# FlashAttention / Triton backends (found by import tests against the device's package list, see
# /work/shared/gpu/README.md): installed --no-deps next to vLLM.
DEPENDENCY_WHEELS = (
    "annotated_types==0.8.0", "apache_tvm_ffi==0.1.11", "blake3==1.0.11", "cachetools==8.0.2",
    "cbor2==6.3.0", "fastapi==0.136.3", "httpcore2==2.16.2", "httpx2==2.16.2", "jiter==0.19.0",
    "llguidance==1.7.6", "msgspec==0.23.0", "openai==3.57.0", "opentelemetry_api==1.45.2",
    "oss_harmony==0.0.11", "partial_json_parser==0.2.1.1.post7", "pybase64==1.5.1",
    "pydantic==2.14.4", "pydantic_core==2.50.5", "pyzmq==27.3.0", "setproctitle==1.3.8",
    "sniffio==1.3.1", "starlette==1.10.0", "truststore==0.10.5", "typing_extensions==4.16.0",
    "typing_inspection==0.4.5", "xgrammar==0.2.8",
    # imported lazily (model loading, compilation, metrics), so import tests did not find them:
    # the first GPU run (2026-12-04) stopped at load_model on "No module named 'compressed_tensors'"
    "compressed_tensors==0.17.0", "loguru==0.7.3", "depyf==0.20.0", "astor==0.8.1", "dill==0.4.1",
    "prometheus_client==0.26.0", "lark==1.2.2", "einops==0.8.2", "python_json_logger==4.2.0",
    "ijson==3.6.0", "py_cpuinfo==9.0.0", "cloudpickle==3.1.3",
)
# The device: Python 3.12 (Ubuntu 24.04's 3.12.3, glibc 2.39), x86_64. llguidance 1.7.6 needs
# manylinux_2_31, so the list goes up to 2_39.
PIP_TARGET = ["--python-version", "3.12", "--implementation", "cp",
              *[a for v in range(39, 16, -1) for a in ("--platform", f"manylinux_2_{v}_x86_64")],
              "--platform", "manylinux2014_x86_64", "--platform", "any"]

PRUNE = {"vllm/_C_stable_libtorch.abi3.so"}  # keep only sm_90 machine code (and PTX <= 90)
KEEP_SO = {
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",  # FlashAttention 3: Hopper attention
    "vllm/cumem_allocator.abi3.so", "vllm/fs_io_C.abi3.so", "vllm/spinloop.abi3.so",
}
EXCLUDE_SO = {  # every other .so of the wheel is left out; these with a known reason
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "FlashAttention 2 (Hopper uses FA3)",
    "vllm/_moe_C_stable_libtorch.abi3.so": "MoE kernels (dense Qwen3 only)",
    "vllm/third_party/deep_gemm/_C_extension.abi3.so": "deep_gemm (FP8 only; needs a newer torch)",
    "vllm/_qutlass_C.abi3.so": "qutlass (needs a newer torch; vLLM ignores its import failure)",
    "vllm/_flashkda_C.abi3.so": "flashkda (not used by dense attention)",
    "vllm/_deepselect_C.abi3.so": "deepselect (sparse attention, not used)",
    "vllm/_flashmla_C.abi3.so": "FlashMLA (MLA models only)",
    "vllm/_flashmla_extension_C.abi3.so": "FlashMLA (MLA models only)",
}
EXCLUDE_PATHS = {"vllm/vllm-rs": "the Rust frontend binary (not used by the Python LLM engine)"}
EXCLUDE_SUFFIXES = {  # C++/CUDA headers of deep_gemm / cutlass / FA4 JIT builds
    ".hpp": "C++/CUDA header (JIT builds not used)", ".h": "C++/CUDA header (JIT builds not used)",
    ".cuh": "C++/CUDA header (JIT builds not used)", ".inl": "C++/CUDA header (JIT builds not used)",
}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ============================================================================ ELF / fatbin pruning
FATBIN_MAGIC = 0xBA55ED50
ELF_MAGIC = b"\x7fELF"


@dataclass(frozen=True)
class Section:
    name: str
    type: int
    offset: int
    size: int


def elf_sections(data: bytes) -> list[Section]:
    """Section table of a 64-bit little-endian ELF (what ``readelf -S`` lists), stdlib only."""
    if data[:4] != ELF_MAGIC or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shentsize < 64 or shoff + shnum * shentsize > len(data):
        raise ValueError("ELF section header table missing or out of bounds")
    raw = []
    for i in range(shnum):
        name, typ, _flags, _addr, off, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        raw.append((name, typ, off, size))
    str_off, str_size = raw[shstrndx][2], raw[shstrndx][3]
    strtab = data[str_off:str_off + str_size]

    def name_at(i: int) -> str:
        end = strtab.find(b"\0", i)
        return strtab[i:end if end >= 0 else None].decode("ascii", "replace")

    return [Section(name_at(n), t, o, s) for n, t, o, s in raw]


def elf_section_table(data: bytes) -> bytes:
    """The raw bytes of the section header table (pruning must leave them untouched)."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    return bytes(data[shoff:shoff + shentsize * shnum])


def prune_fatbin(data: bytes, arch: int = 90) -> tuple[bytes, dict]:
    """Zero the payloads of every ``.nv_fatbin`` entry not for ``arch``; same size and layout.

    Per fatbin container (magic ``0xBA55ED50``, 8-byte aligned): keep every entry whose arch is
    ``arch`` (SASS sm_90 / sm_90a and PTX compute_90); a container without one keeps only its
    highest PTX <= ``arch`` (the driver JIT-compiles it), or everything when it has no such PTX.
    Entry headers stay, so the CUDA runtime still parses the container; it picks the sm_90 image.
    Returns the new bytes and counts (containers, entries kept / zeroed, bytes zeroed).
    """
    sections = [s for s in elf_sections(data) if s.name == ".nv_fatbin"]
    if len(sections) != 1:
        raise ValueError(f"expected one .nv_fatbin section, found {len(sections)}")
    sec = sections[0]
    buf = bytearray(data)
    view = memoryview(buf)[sec.offset:sec.offset + sec.size]
    stats = dict(containers=0, entries=0, kept=0, zeroed=0, zeroed_bytes=0, kept_archs={}, zeroed_archs={})
    pos = 0
    while pos + 16 <= len(view):
        magic, _version, hsize, fsize = struct.unpack_from("<IHHQ", view, pos)
        if magic != FATBIN_MAGIC:
            pos += 8
            continue
        start, end = pos + hsize, pos + hsize + fsize
        if end > len(view):
            raise ValueError(f"fatbin container at section offset {pos} runs past the section")
        entries = []  # (kind, arch, payload start, payload size)
        e = start
        while e < end:
            kind, _, ehsize, psize = struct.unpack_from("<HHIQ", view, e)
            if ehsize < 0x20 or e + ehsize + psize > end:
                raise ValueError(f"bad fatbin entry header at section offset {e}")
            entries.append((kind, struct.unpack_from("<I", view, e + 0x1C)[0], e + ehsize, psize))
            e += ehsize + psize
        keep = {i for i, x in enumerate(entries) if x[1] == arch}
        if not keep:
            ptx = [(x[1], i) for i, x in enumerate(entries) if x[0] == 1 and x[1] <= arch]
            keep = {max(ptx)[1]} if ptx else set(range(len(entries)))
        for i, (kind, a, s, ps) in enumerate(entries):
            label = f"{'ptx' if kind == 1 else 'sass'}_{a}"
            bucket = "kept_archs" if i in keep else "zeroed_archs"
            stats[bucket][label] = stats[bucket].get(label, 0) + 1
            if i in keep:
                stats["kept"] += 1
            else:
                view[s:s + ps] = bytes(ps)
                stats["zeroed"] += 1
                stats["zeroed_bytes"] += ps
        stats["containers"] += 1
        stats["entries"] += len(entries)
        pos = end
    view.release()
    if stats["containers"] == 0:
        raise ValueError(".nv_fatbin holds no fatbin container")
    return bytes(buf), stats


# ============================================================================ selecting files
@dataclass
class Rules:
    """What to carry from the vLLM wheel (defaults: the plan in scripts/gpu/README.md)."""

    prune: set = field(default_factory=lambda: set(PRUNE))
    keep_so: set = field(default_factory=lambda: set(KEEP_SO))
    exclude_so: dict = field(default_factory=lambda: dict(EXCLUDE_SO))
    exclude_paths: dict = field(default_factory=lambda: dict(EXCLUDE_PATHS))
    exclude_suffixes: dict = field(default_factory=lambda: dict(EXCLUDE_SUFFIXES))
    arch: int = 90

    def decide(self, path: str) -> Optional[str]:
        """None to carry ``path``, "prune" to carry it pruned, else the reason to leave it out."""
        if path in self.prune:
            return "prune"
        if path in self.keep_so:
            return None
        if path in self.exclude_paths:
            return self.exclude_paths[path]
        name = path.rsplit("/", 1)[-1]
        if name.endswith(".so") or ".so." in name:
            return self.exclude_so.get(path, "compiled extension not needed for a dense bf16 Qwen3 on Hopper")
        for suffix, reason in self.exclude_suffixes.items():
            if name.endswith(suffix):
                return reason
        return None


@dataclass
class Entry:
    path: str  # relative to the site folder on the device
    data: bytes
    mode: int  # 0o644 or 0o755
    group: str  # compression group (wheel family)
    pruned: Optional[dict] = None


def wheel_target_path(name: str) -> Optional[str]:
    """Where a wheel member goes on PYTHONPATH (None: not installed there)."""
    parts = name.split("/")
    if parts[0].endswith(".data"):
        if len(parts) > 2 and parts[1] in ("purelib", "platlib"):
            return "/".join(parts[2:])
        return None
    return name


def read_wheel(path: Path, group: str, rules: Optional[Rules], excluded: dict[str, str],
               pruned_stats: dict[str, dict]) -> list[Entry]:
    """Files of one wheel to carry; fills ``excluded`` (``wheel:member`` -> reason)."""
    out = []
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            target = wheel_target_path(info.filename)
            if target is None:
                excluded[f"{path.name}:{info.filename}"] = "wheel data outside purelib/platlib (scripts, headers)"
                continue
            decision = rules.decide(target) if rules is not None else None
            if decision not in (None, "prune"):
                excluded[f"{path.name}:{info.filename}"] = decision
                continue
            data = z.read(info)
            unix_mode = (info.external_attr >> 16) & 0o777
            mode = 0o755 if unix_mode & 0o111 else 0o644
            pruned = None
            if decision == "prune":
                original = sha256_bytes(data)
                data, stats = prune_fatbin(data, rules.arch)
                pruned = dict(original_sha256=original, size=len(data), **stats)
                pruned_stats[target] = pruned
            out.append(Entry(target, data, mode, group, pruned))
    return out


def collect(vllm_wheel: Path, dependency_wheels: Iterable[Path], rules: Rules):
    """All files to carry (sorted by path), the left-out ones with reasons, the pruning stats."""
    excluded: dict[str, str] = {}
    pruned: dict[str, dict] = {}
    entries = read_wheel(vllm_wheel, "vllm", rules, excluded, pruned)
    for w in sorted(dependency_wheels):
        entries += read_wheel(w, "deps", None, excluded, pruned)
    seen: dict[str, Entry] = {}
    for e in entries:
        if e.path in seen and seen[e.path].data != e.data:
            raise ValueError(f"two wheels install different {e.path}")
        seen[e.path] = e
    missing = rules.prune - set(pruned)
    if missing:
        raise ValueError(f"files to prune not found in {vllm_wheel.name}: {sorted(missing)}")
    return sorted(seen.values(), key=lambda e: e.path), excluded, pruned


# ============================================================================ blobs and parts
@dataclass
class Blob:
    name: str
    entries: list
    data: bytes = b""

    @property
    def sha256(self) -> str:
        return sha256_bytes(self.data)


def group_blobs(entries: list[Entry], big_file: int) -> list[Blob]:
    """One blob per file over ``big_file`` bytes, the rest one blob per group."""
    blobs: dict[str, Blob] = {}
    for e in entries:
        if len(e.data) > big_file:
            stem = e.path.rsplit("/", 1)[-1].split(".", 1)[0].lstrip("_")
            key = f"{e.group}-{stem}"
        else:
            key = f"{e.group}-files"
        blobs.setdefault(key, Blob(f"{key}.tar.xz", []))
        blobs[key].entries.append(e)
    return sorted(blobs.values(), key=lambda b: b.name)


def tar_xz(entries: list[Entry], preset: int) -> bytes:
    """Deterministic tar (sorted, mtime 0, root owner) compressed with xz ``preset``."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in sorted(entries, key=lambda x: x.path):
            info = tarfile.TarInfo(e.path)
            info.size, info.mode, info.mtime = len(e.data), e.mode, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(e.data))
    return lzma.compress(raw.getvalue(), format=lzma.FORMAT_XZ, preset=preset)


def compress_blobs(blobs: list[Blob], preset: int, cache_dir: Optional[Path] = None,
                   log: Callable[[str], None] = lambda s: None) -> None:
    """Fill ``blob.data``; reuse ``cache_dir/<content key>.tar.xz`` when present."""
    for blob in blobs:
        key = hashlib.sha256(json.dumps(
            [preset] + [(e.path, e.mode, sha256_bytes(e.data)) for e in blob.entries]).encode()).hexdigest()[:24]
        cached = cache_dir / f"{blob.name[:-len('.tar.xz')]}-{key}.tar.xz" if cache_dir else None
        if cached is not None and cached.exists():
            blob.data = cached.read_bytes()
            log(f"  {blob.name}: cached ({len(blob.data) / MIB:.1f} MiB)")
            continue
        t0 = time.time()
        blob.data = tar_xz(blob.entries, preset)
        raw = sum(len(e.data) for e in blob.entries)
        log(f"  {blob.name}: {len(blob.entries)} files, {raw / MIB:.1f} MiB -> {len(blob.data) / MIB:.1f} MiB "
            f"xz in {time.time() - t0:.0f} s")
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(".tmp")
            tmp.write_bytes(blob.data)
            tmp.replace(cached)


def file_list(entries: list[Entry], blobs: list[Blob], excluded: dict, pruned: dict) -> bytes:
    """``filelist.json.xz``: every carried file (size, sha256, mode, blob), the pruned ones, the
    left-out ones with their reasons."""
    blob_of = {e.path: b.name for b in blobs for e in b.entries}
    doc = dict(
        files={e.path: [len(e.data), sha256_bytes(e.data), e.mode, blob_of[e.path]] for e in entries},
        pruned=pruned,
        excluded=excluded,
    )
    return lzma.compress(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode(), preset=6)


def plan_chunks(blob_sizes: list[int], capacity: int) -> list[list[tuple[int, int, int]]]:
    """Cut the blobs, in order, into parts of at most ``capacity`` bytes each: the fewest parts
    possible, filled evenly (so every run keeps the same room to spare). Returns per part a list of
    ``(blob index, offset, size)``."""
    if capacity <= 0:
        raise ValueError(f"no room for bundle data in a part (capacity {capacity} bytes): raise the budget")
    total = sum(blob_sizes)
    if total:
        n = -(-total // capacity)
        capacity = -(-total // n)
    parts: list[list[tuple[int, int, int]]] = [[]]
    room = capacity
    for i, size in enumerate(blob_sizes):
        off = 0
        while off < size:
            if room == 0:
                parts.append([])
                room = capacity
            n = min(room, size - off)
            parts[-1].append((i, off, n))
            off += n
            room -= n
    return parts if parts[0] else []


MANIFEST_RESERVE = 64 * 1024  # room kept in every part for manifest.json


def write_parts(blobs: list[Blob], filelist: bytes, out_dir: Path, part_budget: int,
                meta: Optional[dict] = None, manifest_reserve: int = MANIFEST_RESERVE) -> dict:
    """Write ``out_dir/part-N/`` (chunks, manifest.json, filelist.json.xz); return the manifest.
    Every part's total size is checked against ``part_budget``."""
    capacity = part_budget - len(filelist) - manifest_reserve
    plan = plan_chunks([len(b.data) for b in blobs], capacity)
    manifest = dict(
        format=FORMAT,
        bundle_id=sha256_bytes("".join(b.sha256 for b in blobs).encode() + filelist)[:16],
        num_parts=len(plan),
        part_budget_bytes=part_budget,
        filelist=dict(name="filelist.json.xz", sha256=sha256_bytes(filelist), size=len(filelist)),
        blobs=[dict(name=b.name, sha256=b.sha256, size=len(b.data), num_files=len(b.entries),
                    unpacked_bytes=sum(len(e.data) for e in b.entries), chunks=[]) for b in blobs],
        **(meta or {}),
    )
    for p, chunks in enumerate(plan, 1):
        for i, off, n in chunks:
            data = blobs[i].data[off:off + n]
            manifest["blobs"][i]["chunks"].append(dict(
                part=p, file=f"{blobs[i].name}.{len(manifest['blobs'][i]['chunks']):03d}",
                offset=off, size=n, sha256=sha256_bytes(data)))
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("part-*"):
        shutil.rmtree(old)
    text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    if len(text) > manifest_reserve:
        raise ValueError(f"manifest.json is {len(text)} bytes, over the {manifest_reserve} reserved")
    sizes = []
    for p in range(1, len(plan) + 1):
        d = out_dir / f"part-{p}"
        d.mkdir()
        (d / "manifest.json").write_bytes(text)
        (d / "filelist.json.xz").write_bytes(filelist)
        for b, blob in zip(manifest["blobs"], blobs):
            for c in b["chunks"]:
                if c["part"] == p:
                    (d / c["file"]).write_bytes(blob.data[c["offset"]:c["offset"] + c["size"]])
        size = sum(f.stat().st_size for f in d.iterdir())
        if size > part_budget:
            raise AssertionError(f"part-{p} is {size} bytes, over the budget {part_budget}")
        sizes.append(size)
    manifest["part_sizes"] = sizes
    return manifest


def build(vllm_wheel: Path, dependency_wheels: Iterable[Path], out_dir: Path, part_budget: int, *,
          rules: Optional[Rules] = None, preset: int = 9 | lzma.PRESET_EXTREME, big_file: int = 8 * MIB,
          cache_dir: Optional[Path] = None, manifest_reserve: int = MANIFEST_RESERVE,
          log: Callable[[str], None] = print) -> dict:
    """The whole build from wheels on disk: select, prune, compress, split; returns the manifest
    (with ``part_sizes``)."""
    rules = rules or Rules()
    dependency_wheels = list(dependency_wheels)
    log(f"reading {vllm_wheel.name} and {len(dependency_wheels)} other wheels")
    entries, excluded, pruned = collect(vllm_wheel, dependency_wheels, rules)
    for path, st in pruned.items():
        log(f"  pruned {path}: {st['zeroed']} of {st['entries']} fatbin entries zeroed "
            f"({st['zeroed_bytes'] / MIB:.1f} MiB), kept {st['kept_archs']}")
    blobs = group_blobs(entries, big_file)
    compress_blobs(blobs, preset, cache_dir, log)
    filelist = file_list(entries, blobs, excluded, pruned)
    meta = dict(
        sources=[dict(wheel=w.name, sha256=sha256_file(w), size=w.stat().st_size)
                 for w in [vllm_wheel, *sorted(dependency_wheels)]],
        num_files=len(entries), num_excluded=len(excluded),
        unpacked_bytes=sum(len(e.data) for e in entries),
    )
    return write_parts(blobs, filelist, out_dir, part_budget, meta, manifest_reserve)


# ============================================================================ the real build
def working_tree_bytes(repo: Path = REPO) -> int:
    """Bytes a device run copies besides the carried paths: tracked files and untracked files git
    does not ignore (what ``git ls-files`` and ``git ls-files --others --exclude-standard`` list)."""
    total = 0
    for args in (["ls-files", "-z"], ["ls-files", "-z", "--others", "--exclude-standard"]):
        out = subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True).stdout
        for name in out.decode().split("\0"):
            p = repo / name
            if name and p.is_file() and not p.is_symlink():
                total += p.stat().st_size
    return total


def download(cache: Path, specs: Iterable[str]) -> None:
    """``pip download --no-deps`` for the device (cp312, manylinux x86_64) into ``cache``;
    files already there are not downloaded again."""
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *PIP_TARGET,
           "-d", str(cache), *specs]
    subprocess.run(cmd, check=True)


def find_wheel(cache: Path, spec: str) -> Path:
    name, version = spec.split("==")
    found = sorted(cache.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not found:
        raise FileNotFoundError(f"no wheel for {spec} in {cache} (run without --no-download)")
    return found[-1]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=REPO / ".gpu-bundle-cache")
    ap.add_argument("--out", type=Path, default=REPO / "gpu_bundle")
    ap.add_argument("--budget-mib", type=float, default=RUN_LIMIT_BYTES / MIB,
                    help="what one device run may carry in all (working tree + one part)")
    ap.add_argument("--margin-mib", type=float, default=4.0,
                    help="kept free in every run for the working tree's growth and transfer overhead")
    ap.add_argument("--tree-bytes", type=int, default=None, help="working tree size (default: measured)")
    ap.add_argument("--vllm-version", default=VLLM_SPEC.split("==")[1],
                    help="the vLLM release to bundle (the plugin supports the series compat.SUPPORTED_VLLM_SERIES "
                         "names; 0.33 and 0.34 pin torch 2.14, the device has torch 2.11: check the C ABI first)")
    ap.add_argument("--no-download", action="store_true", help="use the wheels already in the cache")
    ap.add_argument("--preset", type=int, default=9, help="xz preset (always with --extreme)")
    ap.add_argument("--no-prune", action="store_true",
                    help="carry _C_stable_libtorch whole (all archs; ~54 MiB xz, one part more) if the "
                         "pruned one fails on the GPU")
    args = ap.parse_args(argv)

    wheels_dir = args.cache / "wheels"
    vllm_spec = f"vllm=={args.vllm_version}"
    specs = [vllm_spec, *DEPENDENCY_WHEELS]
    if not args.no_download:
        download(wheels_dir, specs)
    vllm_wheel = find_wheel(wheels_dir, vllm_spec)
    deps = [find_wheel(wheels_dir, s) for s in DEPENDENCY_WHEELS]
    tree = working_tree_bytes() if args.tree_bytes is None else args.tree_bytes
    budget = int(args.budget_mib * MIB) - tree - int(args.margin_mib * MIB)
    print(f"working tree {tree / MIB:.1f} MiB; per-part budget {budget / MIB:.1f} MiB "
          f"(= {args.budget_mib:g} - tree - {args.margin_mib:g} margin)")
    t0 = time.time()
    rules = Rules(prune=set(), keep_so=KEEP_SO | PRUNE) if args.no_prune else Rules()
    manifest = build(vllm_wheel, deps, args.out, budget, rules=rules, preset=args.preset | lzma.PRESET_EXTREME,
                     cache_dir=args.cache / "blobs")
    summary = dict(
        bundle_id=manifest["bundle_id"], num_parts=manifest["num_parts"], part_budget_bytes=budget,
        working_tree_bytes=tree, run_limit_bytes=int(args.budget_mib * MIB),
        part_sizes=manifest["part_sizes"], blobs={b["name"]: [b["size"], b["unpacked_bytes"], b["num_files"]]
                                                 for b in manifest["blobs"]},
        num_files=manifest["num_files"], num_excluded=manifest["num_excluded"],
        unpacked_bytes=manifest["unpacked_bytes"], build_s=round(time.time() - t0, 1))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\n{manifest['num_files']} files ({manifest['unpacked_bytes'] / MIB:.0f} MiB unpacked), "
          f"{manifest['num_excluded']} left out; bundle {manifest['bundle_id']}")
    for b in manifest["blobs"]:
        print(f"  {b['name']:<32} {b['size'] / MIB:7.2f} MiB xz  ({b['unpacked_bytes'] / MIB:7.1f} MiB, "
              f"{b['num_files']} files, parts {sorted({c['part'] for c in b['chunks']})})")
    for p, size in enumerate(manifest["part_sizes"], 1):
        print(f"  part-{p}: {size / MIB:6.2f} MiB + tree {tree / MIB:.2f} MiB = {(size + tree) / MIB:6.2f} MiB "
              f"of {args.budget_mib:g} MiB")
    rel = os.path.relpath(args.out, REPO)
    print("\non the device, one run per part (each within 30 s of the previous one):")
    for p in range(1, manifest["num_parts"] + 1):
        print(f"  carry [\"{rel}/part-{p}\"]: python3 scripts/gpu/unpack.py {rel}/part-{p} "
              "--run -- python3 benchmarks/gpu_check.py --out $OUT")
    return 0


if __name__ == "__main__":
    sys.exit(main())
