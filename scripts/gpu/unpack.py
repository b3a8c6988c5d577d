#!/usr/bin/env python3
"""Unpack one part of the GPU bundle (scripts/gpu/build_bundle.py) into an ignored folder; once all
parts are there, optionally run a command with that folder on PYTHONPATH.

    python3 scripts/gpu/unpack.py gpu_bundle/part-1 --run -- python3 benchmarks/gpu_check.py --out $OUT
    python3 scripts/gpu/unpack.py gpu_bundle/part-2 --run -- python3 benchmarks/gpu_check.py --out $OUT
    python3 scripts/gpu/unpack.py --status                    # what is there, what is missing

Parts arrive in back-to-back device runs (each run carries one part; the ignored ``.gpu_env/``
survives only until the machine is given back, 30 s after a run). Every call is idempotent and any
part order works: the part's chunks are checked (sha256) and kept in ``.gpu_env/chunks/``; each blob
whose chunks are all there is streamed through sha256 + xz + tar into ``.gpu_env/site/``, each of its
files checked against the file list (size + sha256), then its chunks are deleted. A folder holding a
different bundle is wiped first. Once every blob is in, ``.gpu_env/COMPLETE`` is written and
``--run`` executes its command with ``PYTHONPATH=.gpu_env/site:<repo>:$PYTHONPATH`` (exit status:
the command's); before that, ``--run`` only reports the missing parts and exits 0
(``--require-complete`` makes it exit 3). Stdlib only (Python >= 3.9; no ``xz`` binary needed).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
FORMAT = "vllm-dlite-gpu-bundle/1"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _ChunkReader(io.RawIOBase):
    """The concatenation of a blob's chunk files, hashed while read."""

    def __init__(self, paths: list[Path]):
        self._paths, self._f, self.sha = list(paths), None, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while True:
            if self._f is None:
                if not self._paths:
                    return 0
                self._f = open(self._paths.pop(0), "rb")
            n = self._f.readinto(b)
            if n:
                self.sha.update(memoryview(b)[:n])
                return n
            self._f.close()
            self._f = None

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        super().close()


# members are checked by _safe_member; Python >= 3.12 warns unless a filter is named
_NO_FILTER = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}


def _safe_member(member: tarfile.TarInfo, root: Path) -> bool:
    target = (root / member.name).resolve()
    return member.isfile() and not member.name.startswith("/") and root.resolve() in target.parents


def load_part(part: Path) -> tuple[dict, dict]:
    """The part's manifest and file list (checked against the manifest's sha256)."""
    manifest = json.loads((part / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
        raise SystemExit(f"{part}: not a {FORMAT} part (format {manifest.get('format')!r})")
    fl = part / manifest["filelist"]["name"]
    if sha256_file(fl) != manifest["filelist"]["sha256"]:
        raise SystemExit(f"{fl}: sha256 mismatch (a damaged or mixed-up part)")
    return manifest, json.loads(lzma.decompress(fl.read_bytes()))


def status(env: Path) -> dict:
    """What is unpacked in ``env``: bundle id, blobs done, parts still needed."""
    mf = env / "manifest.json"
    if not mf.exists():
        return dict(bundle_id=None, complete=False, missing_parts=None)
    manifest = json.loads(mf.read_text())
    done = {b["name"] for b in manifest["blobs"] if (env / "extracted" / (b["name"] + ".ok")).exists()}
    chunks = env / "chunks"
    missing = sorted({c["part"] for b in manifest["blobs"] if b["name"] not in done for c in b["chunks"]
                      if not (chunks / c["file"]).exists()})
    return dict(bundle_id=manifest["bundle_id"], num_parts=manifest["num_parts"],
                blobs_done=sorted(done), blobs_total=len(manifest["blobs"]),
                complete=(env / "COMPLETE").exists(), missing_parts=missing)


def unpack(part: Path, env: Path, log=print) -> dict:
    """Add ``part`` to ``env`` (idempotent); extract every blob that became complete."""
    t0 = time.time()
    manifest, filelist = load_part(part)
    if (env / "manifest.json").exists():
        old = json.loads((env / "manifest.json").read_text())
        if old.get("bundle_id") != manifest["bundle_id"]:
            log(f"{env} holds bundle {old.get('bundle_id')}, not {manifest['bundle_id']}: wiping it")
            shutil.rmtree(env)
    for sub in ("chunks", "site", "extracted"):
        (env / sub).mkdir(parents=True, exist_ok=True)
    if not (env / "manifest.json").exists():
        (env / "filelist.json").write_text(json.dumps(filelist))
        (env / "manifest.json").write_text(json.dumps(manifest, indent=1))
    site = env / "site"
    for blob in manifest["blobs"]:
        if (env / "extracted" / (blob["name"] + ".ok")).exists():
            continue
        for c in blob["chunks"]:
            dst = env / "chunks" / c["file"]
            if dst.exists() or not (part / c["file"]).exists():
                continue
            if sha256_file(part / c["file"]) != c["sha256"]:
                raise SystemExit(f"{part / c['file']}: sha256 mismatch")
            tmp = dst.with_name(dst.name + ".tmp")
            shutil.copyfile(part / c["file"], tmp)
            tmp.replace(dst)
        paths = [env / "chunks" / c["file"] for c in blob["chunks"]]
        if not all(p.exists() for p in paths):
            continue
        t = time.time()
        reader = _ChunkReader(paths)
        names = []
        with tarfile.open(fileobj=io.BufferedReader(reader, 1 << 20), mode="r|xz") as tar:
            for member in tar:
                if not _safe_member(member, site):
                    raise SystemExit(f"{blob['name']}: refusing tar member {member.name!r}")
                tar.extract(member, site, set_attrs=False, **_NO_FILTER)
                os.chmod(site / member.name, member.mode & 0o777)
                names.append(member.name)
        if reader.sha.hexdigest() != blob["sha256"]:
            raise SystemExit(f"{blob['name']}: sha256 of the joined chunks does not match the manifest")
        expected = {p for p, v in filelist["files"].items() if v[3] == blob["name"]}
        if set(names) != expected:
            raise SystemExit(f"{blob['name']}: files differ from the file list "
                             f"({len(set(names) ^ expected)} differ, e.g. {sorted(set(names) ^ expected)[:3]})")
        for name in names:
            size, sha, _mode, _ = filelist["files"][name]
            p = site / name
            if p.stat().st_size != size or sha256_file(p) != sha:
                raise SystemExit(f"{name}: size or sha256 differs from the file list after unpacking")
        (env / "extracted" / (blob["name"] + ".ok")).write_text(blob["sha256"] + "\n")
        for p in paths:
            p.unlink()
        log(f"  {blob['name']}: {len(names)} files unpacked and checked in {time.time() - t:.1f} s")
    st = status(env)
    if len(st["blobs_done"]) == st["blobs_total"]:
        (env / "COMPLETE").write_text(manifest["bundle_id"] + "\n")
        st["complete"] = True
    log(f"{part}: bundle {manifest['bundle_id']} part {part.name} of {manifest['num_parts']}; "
        f"{len(st['blobs_done'])}/{st['blobs_total']} blobs in {env}; "
        + ("COMPLETE" if st["complete"] else f"waiting for parts {st['missing_parts']}")
        + f" ({time.time() - t0:.1f} s)")
    return st


def python_path(env: Path) -> str:
    parts = [str((env / "site").resolve()), str(REPO)]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", nargs="?", type=Path, help="a part folder, e.g. gpu_bundle/part-1")
    ap.add_argument("--env", type=Path, default=REPO / ".gpu_env", help="where to unpack (ignored by git)")
    ap.add_argument("--run", action="store_true", help="once complete, run the command after --")
    ap.add_argument("--require-complete", action="store_true", help="exit 3 while parts are missing")
    ap.add_argument("--status", action="store_true", help="print the state of --env and exit")
    args = ap.parse_args(argv)
    if args.status or args.part is None:
        print(json.dumps(status(args.env), indent=1))
        return 0
    st = unpack(args.part, args.env)
    if not st["complete"]:
        return 3 if args.require_complete else 0
    print(f"PYTHONPATH={python_path(args.env)}", flush=True)
    if args.run:
        if not command:
            raise SystemExit("--run needs a command after --")
        env = dict(os.environ, PYTHONPATH=python_path(args.env))
        sys.stdout.flush()
        os.execvpe(command[0], command, env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
