"""``capturable=True`` with what a captured step could not replay is refused naming both
settings, and the refusal leaves nothing behind: a distributed step (DDP's process group,
FSDP2's DTensors) and a CPU ``lr`` tensor beside accelerator parameters."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fastmuon import Muon, MuSGD

pytestmark = pytest.mark.parametrize("cls", [MuSGD, Muon])


def _groups(*params):
    return [{"params": list(params), "use_muon": True}]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_with_a_process_group(cls, one_rank_world):
    p = torch.nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match=r"capturable=True cannot be combined with a process_group"):
        cls(_groups(p), lr=0.02, capturable=True, nonfinite="skip", process_group=one_rank_world)
    assert cls(_groups(p), lr=0.02, nonfinite="skip", process_group=one_rank_world).process_group is not None


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_with_dtensor_parameters(cls, one_rank_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    p = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match=r"capturable=True cannot be combined with DTensor parameters"):
        cls(_groups(p), lr=0.02, capturable=True, nonfinite="skip")
    opt = cls(_groups(torch.nn.Parameter(torch.randn(8, 4))), lr=0.02, capturable=True, nonfinite="skip")
    with pytest.raises(ValueError, match=r"capturable=False"):
        opt.add_param_group(_groups(p)[0])
    assert len(opt.param_groups) == 1


def test_with_a_host_lr_beside_device_parameters(cls):
    device_param = torch.nn.Parameter(torch.randn(8, 4, device="meta"))
    host_lr = torch.tensor(0.02)
    fix = r"capturable=True cannot be combined with a CPU tensor lr beside meta parameters.*put the lr tensor on meta"
    with pytest.raises(ValueError, match=fix):
        cls(_groups(device_param), lr=host_lr, capturable=True, nonfinite="skip")
    opt = cls(_groups(torch.nn.Parameter(torch.randn(8, 4))), lr=host_lr, capturable=True, nonfinite="skip")
    with pytest.raises(ValueError, match=fix):
        opt.add_param_group(_groups(device_param)[0])
    assert len(opt.param_groups) == 1
    # without capture: accepted (the lr is read on the host at every step)
    cls(_groups(device_param), lr=host_lr, nonfinite="skip")
