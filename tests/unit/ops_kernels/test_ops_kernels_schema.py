"""dispatch.custom_op: the op modules' postponed annotations (``from __future__ import annotations``) become
a schema on every torch the plugin declares (2.4.0+; torch 2.4's inference took only objects, and
``typing.List[X]``, not ``list[X]``). Run on torch 2.4.1 and 2.13 alike."""

from __future__ import annotations

import typing

import torch
from loongkit_ops.kernels.ops import dispatch
from torch import Tensor


@dispatch.custom_op("loongkit_test::annotated")
def annotated(x: Tensor, sizes: list[float], n: int, flag: bool, scale: float) -> tuple[Tensor, Tensor]:
    return x * scale, x + n


@annotated.register_fake
def _(x: Tensor, sizes: list[float], n: int, flag: bool, scale: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def test_postponed_annotations_make_the_schema() -> None:
    assert str(torch.ops.loongkit_test.annotated.default._schema) == (
        "loongkit_test::annotated(Tensor x, float[] sizes, SymInt n, bool flag, float scale) -> (Tensor, Tensor)")
    a, b = annotated(torch.ones(2), [0.5], 3, True, 2.0)
    torch.testing.assert_close(a, torch.full((2,), 2.0))
    torch.testing.assert_close(b, torch.full((2,), 4.0))


def test_list_parameters_are_spelled_typing_list() -> None:
    assert dispatch._schema_type(list[float]) == typing.List[float]  # noqa: UP006
    assert dispatch._schema_type(Tensor) is Tensor


def test_every_op_module_registers() -> None:
    from loongkit_ops.kernels.ops import bev_pool, daf, dice_class_stats, dice_stats, msda, msda_fused, voxelize

    assert all(m is not None for m in (bev_pool, daf, dice_class_stats, dice_stats, msda, msda_fused, voxelize))
    names = ("ms_deform_attn", "ms_deform_attn_fused", "deformable_aggregation", "bev_pool", "dice_stats",
             "dice_class_stats", "hard_voxelize", "dynamic_voxelize")
    for name in names:
        assert hasattr(torch.ops.loongkit, name), name
    assert "float[] voxel_size" in str(torch.ops.loongkit.hard_voxelize.default._schema)
