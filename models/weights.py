"""Reading Hugging Face safetensors checkpoints as published, one rank's slice at a time.

Each model parameter carries a `weight_loader(param, source, shard)` that knows which slice of the
checkpoint tensor belongs to this rank; `load_weights` walks every tensor of every shard file, maps
its key to a parameter through the model's `map_checkpoint_key`, and fails with the tensor's name
and file on a missing, unexpected or wrongly shaped tensor.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from safetensors import safe_open


class WeightLoadError(ValueError):
    """A checkpoint does not match the model: names the tensor and the file."""


@dataclass
class TensorSource:
    """One checkpoint tensor, read lazily: `read(dim, start, end)` reads only that slice from disk."""

    name: str
    file: str
    _slice: object

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._slice.get_shape())

    @property
    def is_fp8(self) -> bool:
        return self._slice.get_dtype() == "F8_E4M3"

    def read(self, dim: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
        if dim is None:
            return self._slice[:]
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, end)
        return self._slice[tuple(index)]

    def fail(self, message: str) -> WeightLoadError:
        return WeightLoadError(f"{self.name} in {os.path.basename(self.file)}: {message}")


def checkpoint_files(model_path: str) -> list[str]:
    """The safetensors files of a checkpoint: from the index when sharded, else model.safetensors."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_path, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(model_path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise WeightLoadError(f"no model.safetensors.index.json or model.safetensors in {model_path!r}")


def iter_checkpoint(model_path: str) -> Iterator[TensorSource]:
    for path in checkpoint_files(model_path):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                yield TensorSource(name, path, f.get_slice(name))


def copy_checked(param: torch.Tensor, value: torch.Tensor, source: TensorSource) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise source.fail(
            f"shape {tuple(value.shape)} does not fit parameter shape {tuple(param.shape)}"
        )
    param.data.copy_(value.to(param.dtype))


def replicated_loader(param: torch.Tensor, source: TensorSource, shard: object = None) -> None:
    copy_checked(param, source.read(), source)


def attach_loader(param: torch.nn.Parameter, loader: Callable) -> torch.nn.Parameter:
    param.weight_loader = loader
    return param


# Maps a checkpoint key to (parameter name, shard id), SKIP for a tensor left out on purpose (another
# model's, such as the MTP layer's for the target), or None for a tensor the model does not know.
SKIP = ("", "skip")
KeyMapper = Callable[[str], "tuple[str, object] | None"]


def prefixed(prefix: str, mapped: "tuple[str, object] | None") -> "tuple[str, object] | None":
    """A submodule's mapping seen from its parent: its parameter name under `prefix`."""
    if mapped is None or mapped is SKIP:
        return mapped
    return prefix + mapped[0], mapped[1]


def load_weights(
    model: torch.nn.Module, model_path: str, map_key: KeyMapper, progress: bool = True
) -> None:
    """Load every checkpoint tensor into `model` through the parameters' own loaders (an FP8
    checkpoint's quantized weights stay FP8: `models/quant.py`)."""
    from dserve.models import quant

    sources = list(_with_progress(iter_checkpoint(model_path), progress, model_path))
    scheme, fp8 = quant.read_scheme(model_path), {}
    if scheme is not None:
        map_key, fp8 = quant.prepare_fp8(model, sources, map_key, scheme)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    expected = {
        name: set(getattr(p, "expected_shards", [None]))
        for name, p in params.items()
        if getattr(p, "weight_loader", None) is not None
    }
    seen: dict[str, set] = {name: set() for name in expected}
    for source in sources:
        if scheme is not None:
            source = quant.scale_source(source, fp8, scheme)
        mapped = map_key(source.name)
        if mapped is SKIP:
            continue
        name, shard = mapped if mapped is not None else (None, None)
        param = params.get(name) if name else None
        if param is None or getattr(param, "weight_loader", None) is None:
            raise source.fail("unexpected tensor: the model has no parameter for it")
        with torch.no_grad():
            param.weight_loader(param, source, shard)
        seen[name].add(shard)
    missing = [
        f"{name} (part {sorted(map(str, want - seen[name]))})" if want != {None} else name
        for name, want in expected.items()
        if not want <= seen[name]
    ]
    if missing:
        raise WeightLoadError(
            f"checkpoint {model_path!r} is missing tensors for: {', '.join(missing[:10])}"
            + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        )


def _with_progress(items: Iterator[TensorSource], progress: bool, model_path: str):
    if not progress:
        yield from items
        return
    from tqdm import tqdm

    files = checkpoint_files(model_path)
    with tqdm(total=len(files), desc="Loading safetensors shards", unit="file", leave=False) as bar:
        last = None
        for item in items:
            if item.file != last and last is not None:
                bar.update(1)
            last = item.file
            yield item
        bar.update(1)


LOAD_FORMATS = ("auto", "dummy")


def init_dummy(model: torch.nn.Module, std: float = 0.02) -> None:
    """Random weights instead of a checkpoint's (`load_format="dummy"`, as vLLM and SGLang name it):
    made on the parameters' own device, so real shapes can be timed without a checkpoint on disk.
    Norm weights 1, biases 0, every other loadable tensor N(0, std)."""
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if getattr(p, "weight_loader", None) is None:
                continue
            leaf = name.rsplit(".", 1)[-1]
            if p.dtype == torch.float8_e4m3fn:  # w = q x scale ~ N(0, std)
                p.copy_(torch.randn(p.shape, device=p.device).to(p.dtype))
            elif name.endswith("_scale"):
                p.fill_(std)
            elif not p.is_floating_point():
                p.zero_()
            elif "norm" in name and leaf == "weight":
                p.fill_(1.0)
            elif leaf == "bias" or name.endswith("correction_bias"):
                p.zero_()
            else:
                p.normal_(0.0, std)


def fill_weights(
    model: torch.nn.Module,
    model_path: str,
    map_key: KeyMapper,
    load_format: str = "auto",
    progress: bool = True,
) -> None:
    """The checkpoint's tensors (`auto`) or random ones (`dummy`) into `model`; FP8 weights
    read as matrices are dequantized once filled (`quant.finish_fp8`)."""
    from dserve.models.quant import finish_fp8

    if load_format == "dummy":
        init_dummy(model)
    elif load_format == "auto":
        load_weights(model, model_path, map_key, progress)
    else:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )
    finish_fp8(model)
