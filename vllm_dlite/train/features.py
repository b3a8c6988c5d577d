"""Target features for DLite training and evaluation, from two sources that must agree.

Layer-index convention (docs/design.md §2, vLLM 0.32 aux ids): feature id ``i`` is the target's
residual stream after ``i`` decoder layers, pre-norm; id 0 = embedding output, id N = after the
last decoder layer, BEFORE the final norm. Row ``p`` of a feature tensor is the residual stream at
position ``p``, i.e. the row that predicts token ``p + 1``. A DLite anchor ``x_t`` reads row
``t - 1``.

(a) In-process, HF transformers (:class:`TargetFeatureExtractor`): the frozen target runs with
    ``output_hidden_states=True``; HF's ``hidden_states[i]`` equals vLLM id ``i`` for ``i < N`` but
    HF's last entry is AFTER the final norm, so id N is captured with a forward pre-hook on the
    final norm (its input = the last decoder layer's output + residual, pre-norm). The same
    forward returns the final-norm output, from which the target's own next-token distribution
    ``p^T`` is computed for the rows that need it (never the full ``[T, V]`` logits).

(b) speculators-format files (what ``speculators==0.9.0`` trains EAGLE-3 / DFlash on; written on a
    GPU by vLLM's ``ExampleHiddenStatesConnector``, which is CUDA-only): one ``hs_{i}.safetensors``
    per sequence holding ``hidden_states [T, num_layers, H]`` (the requested aux ids, in request
    order, the model dtype) and ``token_ids [T]`` int64. :func:`write_hs_file` writes the same
    file from (a) on any device (plus a ``layer_ids`` metadata entry, which speculators ignores);
    :func:`read_hs_file` reads either kind. :func:`write_speculators_dataset` also writes the
    companion ``datasets`` table (``input_ids``, ``loss_mask``, ``seq_len``) so speculators'
    trainer can consume the directory unchanged (``--data-path DIR``).
    For speculators' EAGLE-3/DFlash trainers the LAST layer id in a file must be N (speculators
    reads ``hidden_states[:, -1]`` as the verifier's pre-norm last hidden state).

:class:`TargetHead` (final norm + lm_head of the target, loadable without the decoder layers)
turns id-N rows into ``p^T`` when features come from files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dlite.model.drafter import rms_norm

HS_FILE_PATTERN = "hs_{index}.safetensors"
HS_DIRNAME = "hidden_states"
LAYER_IDS_METADATA_KEY = "layer_ids"

PathLike = Union[str, Path]


# =========================================================================== helpers
def _decoder(model: nn.Module) -> nn.Module:
    """The decoder stack (``model.model`` for HF ``*ForCausalLM``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        decoder = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
        raise TypeError(
            f"{type(model).__name__} is not a supported HF decoder LM: expected "
            "`model.model.layers` and `model.model.norm` (Qwen3/Llama-style *ForCausalLM)"
        )
    return decoder


def validate_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Check vLLM aux ids against a target with ``num_layers`` decoder layers."""
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise ValueError("layer_ids must be a non-empty list of vLLM aux layer ids")
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(
            f"layer ids {bad} are outside 0..{num_layers} (vLLM aux id i = residual stream after "
            f"i decoder layers; this target has {num_layers})"
        )
    if len(set(ids)) != len(ids):
        raise ValueError(f"layer ids must be distinct, got {ids}")
    return ids


def crop_cache(cache: Any, new_length: int) -> None:
    """Drop cached positions ``>= new_length`` from an HF cache (works on transformers 4.x/5.x)."""
    remove = cache.get_seq_length() - new_length
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} to {new_length}")
    if remove:
        cache.crop(-remove)  # negative = "remove this many" in both 4.x and 5.x


def torch_dtype(name: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    """``"bfloat16" | "float32" | torch.dtype | None`` -> torch dtype (None/"auto" -> None)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return None
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (use float32, bfloat16 or float16)")
    return value


# =========================================================================== (a) HF in-process
@dataclass
class TargetForward:
    """Result of one target forward.

    features:          ``[B, T, L, H]`` selected aux layers (``layer_ids`` order), model dtype.
    last_hidden:       ``[B, T, H]`` id N (pre final norm), model dtype.
    final_hidden:      ``[B, T, H]`` after the final norm (what lm_head reads), model dtype.
    past_key_values:   the HF cache when ``use_cache=True``, else None.
    """

    features: torch.Tensor
    last_hidden: torch.Tensor
    final_hidden: torch.Tensor
    past_key_values: Any = None


class TargetFeatureExtractor:
    """Frozen HF target -> DLite features (vLLM aux convention) and next-token distributions.

    Contract: ``forward(input_ids)`` returns, for every position, exactly what vLLM 0.32 serves as
    ``target_hidden_states`` for the ids ``layer_ids`` (same model, same dtype, up to kernel
    numerics). Right padding with ``attention_mask`` is supported (rows at padded positions are
    garbage and must be ignored). With ``past_key_values`` the call continues a cached sequence
    (positions start at the cache length), which the offline estimator uses.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.decoder = _decoder(model)
        self.num_layers = len(self.decoder.layers)
        self.layer_ids = validate_layer_ids(layer_ids, self.num_layers)
        self.lm_head = model.get_output_embeddings()
        if self.lm_head is None:
            raise TypeError(f"{type(model).__name__} has no output embeddings (lm_head)")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        path: PathLike,
        layer_ids: Sequence[int],
        *,
        dtype: Union[str, torch.dtype, None] = None,
        device: Union[str, torch.device] = "cpu",
        attn_implementation: str = "sdpa",
    ) -> "TargetFeatureExtractor":
        """Load an HF causal LM (``dtype=None``: fp32 on CPU, the checkpoint's dtype elsewhere)."""
        from transformers import AutoModelForCausalLM

        dtype = torch_dtype(dtype)
        if dtype is None:
            dtype = torch.float32 if torch.device(device).type == "cpu" else "auto"
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, attn_implementation=attn_implementation
        )
        return cls(model.to(device), layer_ids)

    # ------------------------------------------------------------------ properties
    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def embed_weight(self) -> torch.Tensor:
        """``[V, H]`` target token embedding (for ``DLiteDrafter.bind_target``)."""
        return self.model.get_input_embeddings().weight

    @property
    def final_norm(self) -> tuple[torch.Tensor, float]:
        """``(weight [H], eps)`` of the target's final norm (for ``DLiteDrafter.bind_target``)."""
        norm = self.decoder.norm
        return norm.weight, float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[V, H]`` target vocabulary projection (``p^T`` in the stable stage)."""
        return self.lm_head.weight

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        *,
        past_key_values: Any = None,
        use_cache: bool = False,
    ) -> TargetForward:
        """``input_ids [B, T]`` (or ``[T]``) -> :class:`TargetForward` (``[T]`` input keeps B=1)."""
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        input_ids = input_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
            if past_key_values is not None:
                raise ValueError("attention_mask with past_key_values is not supported")
        captured: dict[str, torch.Tensor] = {}

        def grab_norm_input(_module, args):  # id N = input of the final norm (pre-norm)
            captured["last"] = args[0]

        handle = self.decoder.norm.register_forward_pre_hook(grab_norm_input)
        try:
            out = self.decoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                use_cache=use_cache or past_key_values is not None,
                output_hidden_states=True,
                return_dict=True,
            )
        finally:
            handle.remove()
        hidden_states = out.hidden_states  # N+1 entries: [0..N-1] pre-norm, [N] post-norm
        if len(hidden_states) != self.num_layers + 1:
            raise RuntimeError(
                f"expected {self.num_layers + 1} hidden states from the target, got "
                f"{len(hidden_states)}; this transformers version captures hidden states "
                "differently"
            )
        last = captured["last"]  # [B, T, H] pre-norm
        rows = [last if i == self.num_layers else hidden_states[i] for i in self.layer_ids]
        return TargetForward(
            features=torch.stack(rows, dim=2),  # [B, T, L, H]
            last_hidden=last,
            final_hidden=out.last_hidden_state,  # [B, T, H] post-norm
            past_key_values=out.past_key_values if (use_cache or past_key_values is not None)
            else None,
        )

    __call__ = forward

    def logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """Post-norm rows ``[..., H]`` -> fp32 logits ``[..., V]`` (the target's lm_head)."""
        return self.lm_head(final_hidden.to(self.dtype)).float()

    def head(self) -> "TargetHead":
        """The target's final norm + lm_head as a :class:`TargetHead` (shares the weights)."""
        norm = self.decoder.norm
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        return TargetHead(norm.weight, self.lm_head.weight, float(eps))


# =========================================================================== target head
class TargetHead:
    """``p^T`` from id-N (pre-norm) rows: ``softmax(lm_head(rmsnorm(h_N)))``.

    Used when features come from files (the decoder layers are then not needed): load it with
    :meth:`from_pretrained`, which reads only ``embed_tokens``, ``norm`` and ``lm_head`` tensors.
    RMSNorm: the package's one :func:`~vllm_dlite.model.drafter.rms_norm` (Qwen3/HF), on rows in the weight dtype.
    """

    def __init__(self, norm_weight: torch.Tensor, lm_head_weight: torch.Tensor, eps: float,
                 embed_weight: Optional[torch.Tensor] = None):
        self.norm_weight = norm_weight  # [H]
        self.lm_head_weight = lm_head_weight  # [V, H]
        self.embed_weight = embed_weight  # [V, H] or None
        self.eps = eps

    def to(self, device: Union[str, torch.device]) -> "TargetHead":
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return TargetHead(move(self.norm_weight), move(self.lm_head_weight), self.eps,
                          move(self.embed_weight))

    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm rows ``[..., H]`` -> fp32 logits ``[..., V]``."""
        x = rms_norm(last_hidden.to(self.norm_weight.dtype), self.norm_weight, self.eps)
        return F.linear(x.to(self.lm_head_weight.dtype), self.lm_head_weight).float()

    @classmethod
    def from_pretrained(cls, path: PathLike, dtype: Optional[torch.dtype] = None,
                        device: Union[str, torch.device] = "cpu") -> "TargetHead":
        """Read ``model.embed_tokens``, ``model.norm`` and ``lm_head`` (tied embeddings honoured)
        from an HF safetensors checkpoint, without instantiating the decoder layers."""
        from safetensors import safe_open

        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        index_file = path / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
        else:
            single = path / "model.safetensors"
            if not single.is_file():
                raise FileNotFoundError(f"{path} has no model.safetensors(.index.json)")
            with safe_open(str(single), framework="pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}

        def load(*names: str) -> Optional[torch.Tensor]:
            for name in names:
                if name in weight_map:
                    with safe_open(str(path / weight_map[name]), framework="pt") as f:
                        tensor = f.get_tensor(name)
                    return tensor.to(device=device, dtype=dtype or tensor.dtype)
            return None

        embed = load("model.embed_tokens.weight", "embed_tokens.weight")
        norm = load("model.norm.weight", "norm.weight")
        lm_head = load("lm_head.weight")
        if lm_head is None and cfg.get("tie_word_embeddings", False):
            lm_head = embed
        if embed is None or norm is None or lm_head is None:
            raise ValueError(
                f"{path}: could not find model.embed_tokens / model.norm / lm_head weights "
                "(only Qwen3/Llama-style checkpoints are supported)"
            )
        return cls(norm, lm_head, float(cfg.get("rms_norm_eps", 1e-6)), embed)


# =========================================================================== (b) speculators files
@dataclass
class HiddenStateFile:
    """Content of one ``hs_{i}.safetensors`` file.

    token_ids: ``[T]`` int64.  features: ``[T, L, H]`` (file dtype).  layer_ids: the aux ids of the
    L layers when the writer recorded them (our writer does; vLLM's connector does not).
    """

    token_ids: torch.Tensor
    features: torch.Tensor
    layer_ids: Optional[list[int]]
    row_start: int = 0  # features hold positions row_start..T-1 (DLite's files skip early prompt rows)


def hs_file_path(directory: PathLike, index: int) -> Path:
    return Path(directory) / HS_FILE_PATTERN.format(index=index)


def write_hs_file(
    path: PathLike, token_ids: Sequence[int] | torch.Tensor, features: torch.Tensor,
    layer_ids: Sequence[int], row_start: int = 0,
) -> Path:
    """Write one speculators/vLLM-format hidden-state file.

    ``features [T, L, H]`` (any float dtype, stored as given), ``token_ids`` of length T. The
    layout is exactly vLLM's ``ExampleHiddenStatesConnector`` output (``hidden_states``,
    ``token_ids``), plus ``layer_ids`` in the safetensors metadata. The write is atomic
    (temporary file + rename), so an interrupted run never leaves a truncated file.
    ``row_start > 0`` stores only the rows of positions ``row_start..T-1`` (``features`` then has
    ``T - row_start`` rows; recorded in the metadata; not a speculators file any more): DLite's
    trainer never reads rows far before the response.
    """
    from safetensors.torch import save_file

    token_ids = torch.as_tensor(token_ids, dtype=torch.long).cpu().contiguous()
    if features.dim() != 3 or features.shape[0] != token_ids.shape[0] - row_start:
        raise ValueError(
            f"features must be [T-row_start={token_ids.shape[0] - row_start}, L, H], got "
            f"{tuple(features.shape)}"
        )
    if features.shape[1] != len(layer_ids):
        raise ValueError(f"features have {features.shape[1]} layers but layer_ids={layer_ids}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # one per writer process
    save_file(
        {"hidden_states": features.detach().cpu().contiguous(), "token_ids": token_ids},
        str(tmp),
        metadata={"format": "pt", LAYER_IDS_METADATA_KEY: json.dumps(list(map(int, layer_ids))),
                  **({"row_start": str(int(row_start))} if row_start else {})},
    )
    tmp.replace(path)
    return path


def read_hs_file(path: PathLike, layer_ids: Optional[Sequence[int]] = None,
                 file_layer_ids: Optional[Sequence[int]] = None) -> HiddenStateFile:
    """Read a speculators/vLLM hidden-state file, optionally selecting ``layer_ids``.

    The file's own layer ids come from its metadata (our writer) or ``file_layer_ids`` (vLLM's
    connector writes none: pass the ``eagle_aux_hidden_state_layer_ids`` used at extraction).
    Selecting needs one of them; errors name the file and the missing ids.
    """
    from safetensors import safe_open

    path = Path(path)
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        names = set(f.keys())
        if not {"hidden_states", "token_ids"} <= names:
            raise ValueError(f"{path}: not a hidden-state file (keys {sorted(names)})")
        hidden = f.get_tensor("hidden_states")
        token_ids = f.get_tensor("token_ids").long()
    stored = metadata.get(LAYER_IDS_METADATA_KEY)
    ids = json.loads(stored) if stored else (list(file_layer_ids) if file_layer_ids else None)
    if hidden.dim() == 2:  # [T, H]: a single layer
        hidden = hidden[:, None]
    if ids is not None and len(ids) != hidden.shape[1]:
        raise ValueError(f"{path}: {hidden.shape[1]} layers stored but layer ids {ids} given")
    if layer_ids is not None:
        if ids is None:
            raise ValueError(
                f"{path} does not record its layer ids; pass file_layer_ids= (the aux ids used "
                "when the file was extracted)"
            )
        missing = [i for i in layer_ids if i not in ids]
        if missing:
            raise ValueError(f"{path} holds layers {ids}; requested ids {missing} are missing")
        hidden = hidden[:, [ids.index(i) for i in layer_ids]]
        ids = list(layer_ids)
    return HiddenStateFile(token_ids=token_ids, features=hidden, layer_ids=ids,
                           row_start=int(metadata.get("row_start", 0)))


@torch.no_grad()
def write_speculators_dataset(
    out_dir: PathLike,
    sequences: Iterable[tuple[Sequence[int], Sequence[int]]],
    extractor: TargetFeatureExtractor,
    *,
    start_index: int = 0,
    write_table: bool = True,
    progress: bool = False,
) -> int:
    """Write speculators training data from HF on any device (CPU included).

    ``sequences`` yields ``(input_ids, loss_mask)`` pairs (``loss_mask[p] = 1`` on response
    tokens). Writes ``out_dir/hidden_states/hs_{i}.safetensors`` with ``extractor.layer_ids``
    (order kept) and, with ``write_table``, the ``datasets`` table ``out_dir`` (columns
    ``input_ids``, ``loss_mask``, ``seq_len``; the layout of ``speculators prepare-data``).
    Existing ``hs_{i}`` files are kept (the run resumes). Returns the number of sequences.
    """
    out_dir = Path(out_dir)
    hs_dir = out_dir / HS_DIRNAME
    hs_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    items = list(sequences)
    iterator: Iterable = enumerate(items, start=start_index)
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, total=len(items), desc="hidden states", unit="seq")
    for index, (ids, mask) in iterator:
        if len(ids) != len(mask):
            raise ValueError(f"sequence {index}: {len(ids)} ids but {len(mask)} loss_mask entries")
        rows["input_ids"].append(list(map(int, ids)))
        rows["loss_mask"].append(list(map(int, mask)))
        rows["seq_len"].append(len(ids))
        path = hs_file_path(hs_dir, index)
        if path.exists():
            continue
        out = extractor(torch.tensor(ids, dtype=torch.long))
        write_hs_file(path, ids, out.features[0], extractor.layer_ids)
    if write_table:
        from datasets import Dataset

        Dataset.from_dict(rows).save_to_disk(str(out_dir))
    return len(items)


__all__ = [
    "HS_DIRNAME",
    "HiddenStateFile",
    "TargetFeatureExtractor",
    "TargetForward",
    "TargetHead",
    "crop_cache",
    "hs_file_path",
    "read_hs_file",
    "torch_dtype",
    "validate_layer_ids",
    "write_hs_file",
    "write_speculators_dataset",
]
