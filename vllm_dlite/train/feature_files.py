"""DLite's own target-feature files for training (``data.feature_source: files``): the frozen
target's features are computed once and stored per sequence as ``hs_<i>.safetensors`` (``i`` =
:class:`~vllm_dlite.train.sequences.SequenceStore` index; the format of
:func:`~vllm_dlite.train.features.write_hs_file`) holding only the rows a drafter or teacher step
can read, from :func:`first_stored_row` on. :func:`write_feature_files` (collective) has every
rank write its share of the missing files, after rank 0 has removed files written for other
sequences, layers, dtype, target or teacher window (recorded in ``source.json``);
:func:`read_batch_features` reads a batch's files back, checking their tokens.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from vllm_dlite.train.config import TrainConfig
from vllm_dlite.train.distributed import DistInfo, barrier
from vllm_dlite.train.features import (
    HS_DIRNAME,
    TargetFeatureExtractor,
    hs_file_path,
    read_hs_file,
    torch_dtype,
    write_hs_file,
)
from vllm_dlite.train.sequences import SequenceBatch, SequenceStore

SOURCE_FILE = "source.json"


def first_stored_row(response_start: int, teacher_window: int) -> int:
    """First stored feature row of a sequence: the teacher's window before the first anchor."""
    W = max(teacher_window, 1)
    return max(0, response_start - W - 1)


def write_feature_files(cfg: TrainConfig, features_dir: Path, store: SequenceStore,
                        indices: Sequence[int], layer_ids: list[int], info: DistInfo,
                        log: Callable[[str], None] = print) -> Optional[float]:
    """Write this rank's share (``indices[rank::world_size]``) of the missing ``hs_i`` files of
    ``features_dir``, rows :func:`first_stored_row` .. T-1 of the target layers ``layer_ids``
    (vLLM aux ids). Collective. A file that appears while this runs (another process extracting
    into the same directory, e.g. in the other order) is skipped. Returns the wall seconds when
    this rank wrote any, else None."""
    hs_dir = features_dir / HS_DIRNAME
    source = dict(sequences=store.fingerprint(), layer_ids=layer_ids,
                  dtype=cfg.data.features_dtype, target=str(Path(cfg.target.path).resolve()),
                  target_dtype=cfg.target.dtype, window=cfg.model.teacher_window)
    source_file = features_dir / SOURCE_FILE
    if info.is_main:
        known = json.loads(source_file.read_text()) if source_file.is_file() else None
        if known != source:  # other sequences, layers or target: files are keyed by index
            stale = list(hs_dir.glob("hs_*.safetensors")) if hs_dir.is_dir() else []
            if stale:
                log(f"removing {len(stale)} feature files built for other "
                    f"data/target ({source_file})")
            for path in stale:
                path.unlink()
            hs_dir.mkdir(parents=True, exist_ok=True)
            source_file.write_text(json.dumps(source, indent=2) + "\n")
    barrier(info)
    todo = [int(i) for i in indices[info.rank :: info.world_size]
            if not hs_file_path(hs_dir, int(i)).exists()]
    t0 = time.time()
    if todo:
        target_dtype = torch_dtype(cfg.target.dtype) or (
            torch.float32 if info.device.type == "cpu" else "auto")
        extractor = TargetFeatureExtractor.from_pretrained(
            cfg.target.path, layer_ids, dtype=target_dtype, device=info.device,
            attn_implementation=cfg.target.attn_implementation,
        )
        store_dtype = torch_dtype(cfg.data.features_dtype)
        iterator: Any = todo
        if info.is_main and cfg.run.progress:
            from tqdm.auto import tqdm

            iterator = tqdm(todo, desc="target features", unit="seq", dynamic_ncols=True)
        for i in iterator:
            if hs_file_path(hs_dir, i).exists():  # another worker on the same directory wrote it
                continue
            ids = torch.from_numpy(store.token_ids(i).astype(np.int64))
            start = first_stored_row(store.response_start(i), cfg.model.teacher_window)
            feats = extractor(ids).features[0, start:]
            write_hs_file(hs_file_path(hs_dir, i), ids,
                          feats.to(store_dtype) if store_dtype else feats,
                          extractor.layer_ids, row_start=start)
        del extractor
    barrier(info)
    return round(time.time() - t0, 1) if todo else None


def read_batch_features(hs_dir: Path, batch: SequenceBatch, layer_ids: list[int],
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [S, T', Lf, H], row_start [S])`` on ``device``: the stored rows of the batch's
    sequences (zero-padded to the longest) and the position of each one's first row."""
    files = []
    for row, s in enumerate(batch.seq_numbers):
        f = read_hs_file(hs_file_path(hs_dir, s), layer_ids=layer_ids)
        n = int(batch.lengths[row])
        if f.token_ids.shape[0] != n or not torch.equal(
            f.token_ids, batch.input_ids[row, :n].cpu()
        ):
            raise ValueError(
                f"{hs_file_path(hs_dir, s)} holds other tokens than sequence {s}: the feature "
                "files are stale; delete the features directory to rebuild them"
            )
        files.append(f)
    T = max(f.features.shape[0] for f in files)
    Lf, H = files[0].features.shape[1:]
    rows = torch.zeros(len(files), T, Lf, H, dtype=files[0].features.dtype)
    for row, f in enumerate(files):
        rows[row, : f.features.shape[0]] = f.features
    starts = torch.tensor([f.row_start for f in files], dtype=torch.long)
    return rows.to(device), starts.to(device)


__all__ = ["first_stored_row", "read_batch_features", "write_feature_files"]
