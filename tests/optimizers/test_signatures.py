"""The constructors' signatures as ``inspect.signature`` shows them: every option, with its type
annotation and default (the variants' are made from Muon's declaration, so this pins them)."""

import inspect

import pytest
import torch

import fastmuon

SIGNATURES = {
    "Muon": (
        "(params: 'ParamsT', lr: 'float | Tensor' = 0.001, weight_decay: 'float' = 0.1, "
        "momentum: 'float' = 0.95, nesterov: 'bool' = True, ns_coefficients: 'Any' = (3.4445, "
        "-4.775, 2.0315), eps: 'float' = 1e-07, ns_steps: 'int | None' = None, "
        "adjust_lr_fn: 'str | None' = None, *, ns_dtype: 'torch.dtype' = torch.bfloat16, "
        "ns_method: 'str' = 'auto', matrices: 'MatrixMapSpec | list' = 'flatten', "
        "policy: 'str' = 'auto', rms_scale: 'float' = 0.2, "
        "betas: 'tuple[float, float]' = (0.9, 0.95), adamw_eps: 'float' = 1e-08, "
        "adamw_lr: 'float' = 0.0003, foreach: 'bool | None' = None, "
        "max_bucket_bytes: 'int' = 536870912, cost_model: 'CostModel | str | None' = None, "
        "compile: 'bool' = False, process_group: 'ProcessGroup | None' = None, "
        "nonfinite: 'str' = 'raise', capturable: 'bool' = False, "
        "owner_group_size: 'int | None' = None, max_exchange_bytes: 'int | None' = None, "
        "cautious_weight_decay: 'bool' = False, qk_clip_tau: 'float | None' = None, "
        "qk_clip_alpha: 'float' = 0.5, state_dtype: 'torch.dtype | None' = None)"
    ),
    "MuSGD": (
        "(params: 'ParamsT', lr: 'float | Tensor' = 0.001, momentum: 'float' = 0.0, "
        "weight_decay: 'float' = 0.0, nesterov: 'bool' = False, use_muon: 'bool' = False, "
        "muon: 'float' = 0.5, sgd: 'float' = 0.5, *, ns_steps: 'int | None' = None, "
        "ns_coefficients: 'Any' = 'jordan', ns_dtype: 'torch.dtype' = torch.bfloat16, "
        "eps: 'float' = 1e-07, ns_method: 'str' = 'auto', "
        "matrices: 'MatrixMapSpec | list' = 'flatten', policy: 'str' = 'auto', "
        "adjust_lr_fn: 'str' = 'ultralytics', rms_scale: 'float' = 0.2, "
        "adjust_lr: 'str | None' = None, foreach: 'bool | None' = None, "
        "max_bucket_bytes: 'int' = 536870912, cost_model: 'CostModel | str | None' = None, "
        "compile: 'bool' = False, process_group: 'ProcessGroup | None' = None, "
        "nonfinite: 'str' = 'raise', capturable: 'bool' = False, "
        "owner_group_size: 'int | None' = None, max_exchange_bytes: 'int | None' = None, "
        "cautious_weight_decay: 'bool' = False, state_dtype: 'torch.dtype | None' = None)"
    ),
    "NorMuon": (
        "(params: 'ParamsT', lr: 'float | Tensor' = 0.001, weight_decay: 'float' = 0.1, "
        "momentum: 'float' = 0.95, nesterov: 'bool' = True, ns_coefficients: 'Any' = (3.4445, "
        "-4.775, 2.0315), eps: 'float' = 1e-07, ns_steps: 'int | None' = None, "
        "adjust_lr_fn: 'str | None' = None, *, beta2: 'float' = 0.95, moment_eps: 'float' = 1e-08, "
        "rescale: 'str' = 'norm', ns_dtype: 'torch.dtype' = torch.bfloat16, "
        "ns_method: 'str' = 'auto', matrices: 'MatrixMapSpec | list' = 'flatten', "
        "policy: 'str' = 'auto', rms_scale: 'float' = 0.2, "
        "betas: 'tuple[float, float]' = (0.9, 0.95), adamw_eps: 'float' = 1e-08, "
        "adamw_lr: 'float' = 0.0003, foreach: 'bool | None' = None, "
        "max_bucket_bytes: 'int' = 536870912, cost_model: 'CostModel | str | None' = None, "
        "compile: 'bool' = False, process_group: 'ProcessGroup | None' = None, "
        "nonfinite: 'str' = 'raise', capturable: 'bool' = False, "
        "owner_group_size: 'int | None' = None, max_exchange_bytes: 'int | None' = None, "
        "cautious_weight_decay: 'bool' = False, qk_clip_tau: 'float | None' = None, "
        "qk_clip_alpha: 'float' = 0.5, state_dtype: 'torch.dtype | None' = None)"
    ),
    "AdaMuon": (
        "(params: 'ParamsT', lr: 'float | Tensor' = 0.001, weight_decay: 'float' = 0.1, "
        "momentum: 'float' = 0.95, nesterov: 'bool' = False, ns_coefficients: 'Any' = (3.4445, "
        "-4.775, 2.0315), eps: 'float' = 1e-07, ns_steps: 'int | None' = None, "
        "adjust_lr_fn: 'str | None' = None, *, beta2: 'float' = 0.95, moment_eps: 'float' = 1e-08, "
        "sign_momentum: 'bool' = True, rescale: 'str' = 'rms', "
        "ns_dtype: 'torch.dtype' = torch.bfloat16, ns_method: 'str' = 'auto', "
        "matrices: 'MatrixMapSpec | list' = 'flatten', policy: 'str' = 'auto', "
        "rms_scale: 'float' = 0.2, betas: 'tuple[float, "
        "float]' = (0.9, 0.95), adamw_eps: 'float' = 1e-08, adamw_lr: 'float' = 0.0003, "
        "foreach: 'bool | None' = None, max_bucket_bytes: 'int' = 536870912, "
        "cost_model: 'CostModel | str | None' = None, compile: 'bool' = False, "
        "process_group: 'ProcessGroup | None' = None, nonfinite: 'str' = 'raise', "
        "capturable: 'bool' = False, owner_group_size: 'int | None' = None, "
        "max_exchange_bytes: 'int | None' = None, cautious_weight_decay: 'bool' = False, "
        "qk_clip_tau: 'float | None' = None, qk_clip_alpha: 'float' = 0.5, "
        "state_dtype: 'torch.dtype | None' = None)"
    ),
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_lists_every_option_with_its_type_and_default(name):
    assert str(inspect.signature(getattr(fastmuon, name))) == SIGNATURES[name]


@pytest.mark.parametrize("name", ["NorMuon", "AdaMuon"])
def test_a_variant_refuses_an_unknown_argument_naming_itself(name):
    params = torch.nn.Linear(4, 4).parameters()
    with pytest.raises(
        TypeError, match=rf"^{name}\.__init__\(\) got an unexpected keyword argument 'lr_scale'"
    ):
        getattr(fastmuon, name)(params, lr=0.02, lr_scale=2.0)
    with pytest.raises(TypeError, match=rf"^{name}\.__init__\(\) takes from 2 to 10 positional arguments"):
        getattr(fastmuon, name)(params, *range(40))
