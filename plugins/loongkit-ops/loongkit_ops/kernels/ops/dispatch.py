"""What every op module shares: which backend a call gets, and the Triton modules.

An op runs the compiled C++ kernel for CPU tensors of the dtypes it takes, the Triton kernel
(``kernels/triton/<name>.py``) for fp16/bf16/fp32/fp64 CUDA tensors when triton imports, and its
plain-torch ``reference`` otherwise, so an op never fails because a kernel is missing.
"""

from __future__ import annotations

import functools
import importlib
import typing
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from loongkit_core.log import get_logger
from loongkit_ops import kernels

CPU_DTYPES = (torch.float32, torch.float64)
GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

log = get_logger("loongkit.ops.kernels")


@functools.cache
def triton(name: str) -> Any:
    """The Triton module ``kernels.triton.<name>``, or None (no triton, or a broken install)."""
    from loongkit_ops.kernels.triton import available

    if not available():
        return None
    try:
        return importlib.import_module(f"loongkit_ops.kernels.triton.{name}")
    except Exception as exc:  # a broken triton install: keep the reference path
        log.warning("triton kernels unavailable", reason=f"{type(exc).__name__}: {exc}")
        return None


def backend(t: Tensor, kernel: str, cpu_dtypes: tuple[torch.dtype, ...] = CPU_DTYPES,
            triton_module: str | None = None) -> tuple[str, str]:
    """(backend, reason) for an op's main tensor: 'cpu', 'triton' or 'reference' (with why)."""
    if t.device.type == "cpu":
        if t.dtype not in cpu_dtypes:
            names = "/".join(str(d).removeprefix("torch.") for d in cpu_dtypes)
            return "reference", f"CPU kernel takes {names}, not {t.dtype}"
        if kernels.load() is None:  # looked up at call time: tests replace kernels.load
            return "reference", f"CPU kernel unavailable: {kernels.failure()}"
        return "cpu", ""
    if t.device.type == "cuda" and triton_module is not None:
        if t.dtype not in GPU_DTYPES:
            return "reference", f"Triton kernel does not take {t.dtype}"
        if triton(triton_module) is None:
            return "reference", "triton is not installed"
        return "triton", ""
    return "reference", f"no {kernel} kernel for device {t.device.type}"


def custom_op(name: str) -> Callable[[Callable[..., Any]], Any]:
    """``torch.library.custom_op(name, mutates_args=())`` for every torch the plugin declares (2.4.0+).

    The op modules use ``from __future__ import annotations``, so their signatures hold strings
    (``'Tensor'``), which torch 2.4's schema inference cannot resolve ("Parameter value has
    unsupported type Tensor"); and torch before 2.5 accepts ``typing.List[float]`` but not
    ``list[float]``. The annotations are resolved here (``typing.get_type_hints``) and builtin
    ``list[X]`` parameters spelled ``typing.List[X]``, which every torch from 2.4 to 2.14 takes.
    """

    def define(fn: Callable[..., Any]) -> Any:
        hints = typing.get_type_hints(fn)
        fn.__annotations__ = {key: _schema_type(hint) if key != "return" else hint for key, hint in hints.items()}
        return torch.library.custom_op(name, mutates_args=())(fn)

    return define


def _schema_type(hint: Any) -> Any:
    """``list[X]`` as ``typing.List[X]`` (torch < 2.5 knows only the latter); other hints unchanged."""
    if typing.get_origin(hint) is list:
        return typing.List[typing.get_args(hint)[0]]  # type: ignore[misc]  # noqa: UP006
    return hint


def host_list(t: Tensor) -> Any:
    """``t.tolist()``, element by element where torch 2.4 refuses ``tolist`` inside a torch.func
    transform ("Cannot access data pointer of Tensor that doesn't have storage"; the references'
    backward runs under ``torch.func.vjp``); ``item()`` works there."""
    try:
        return t.tolist()
    except RuntimeError:
        return t.item() if t.dim() == 0 else [host_list(row) for row in t]


def index_args(shapes: Tensor, starts: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
    """Spatial shapes and level start indices as contiguous int64 tensors on ``device`` (the kernels' form)."""
    return (shapes.to(device=device, dtype=torch.int64).contiguous(),
            starts.to(device=device, dtype=torch.int64).contiguous())
