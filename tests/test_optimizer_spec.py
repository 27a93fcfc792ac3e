"""An optimizer spec (``optimizer={"type": "AdamW", "lr": ...}``) is checked once, by one function
(fp8dist.runtime.optim.check_optimizer_spec), before anything changes: every key of every torch.optim type, on every path
that builds one (the standard and lean levels, DeepSpeed's engine, MS-AMP's build_optimizer)."""

from __future__ import annotations

import typing

import pytest
import torch
from torch import nn

from fp8dist import wrap_model
from fp8dist.train.models import build_llama
from fp8dist.runtime.optim import build_optimizer, check_optimizer_spec, optimizer_classes

CLASSES = sorted(optimizer_classes().values(), key=lambda c: c.__name__)


def _wrong_value(hint) -> object:
    """A value of another type than ``hint`` allows: text, or a number where text is allowed."""
    return 5 if "str" in repr(hint) else "1e-3"


def _keys(cls) -> list[tuple[str, object]]:
    hints = typing.get_type_hints(cls.__init__)
    return [(k, hints[k]) for k in hints if k not in ("params", "return")]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_key_of_every_optimizer_type_refuses_a_value_of_the_wrong_type(cls):
    keys = _keys(cls)
    assert keys, cls
    check_optimizer_spec({"type": cls.__name__})  # torch's defaults pass
    for key, hint in keys:
        value = _wrong_value(hint)
        with pytest.raises(ValueError) as err:
            check_optimizer_spec({"type": cls.__name__, key: value})
        assert f"optimizer {key}={value!r} is a {type(value).__name__}: torch.optim.{cls.__name__} takes" in \
            str(err.value), (key, str(err.value))


def test_a_value_torch_refuses_is_named_with_its_key_and_torch_s_reason():
    with pytest.raises(ValueError, match=r"optimizer betas=\(0.9, 1.5\): torch.optim.AdamW refuses it \(Invalid "
                                         r"beta parameter at index 1: 1.5\)"):
        check_optimizer_spec({"type": "AdamW", "lr": 1e-3, "betas": (0.9, 1.5)})
    with pytest.raises(ValueError, match=r"optimizer nesterov=True: torch.optim.SGD refuses it \(Nesterov"):
        check_optimizer_spec({"type": "SGD", "lr": 0.1, "nesterov": True})
    check_optimizer_spec({"type": "SGD", "lr": 0.1, "nesterov": True, "momentum": 0.9})  # together they hold
    with pytest.raises(ValueError, match=r"optimizer key 'weight_decy' is not an option of torch.optim.AdamW; it takes lr, "
                                         r"betas.*Did you mean 'weight_decay'\?"):
        check_optimizer_spec({"type": "AdamW", "weight_decy": 0.1})


def test_an_engine_s_own_keys_and_types_are_left_to_it_only_where_it_builds_the_optimizer():
    deepspeed = {"torch_adam": bool, "adam_w_mode": bool}
    assert check_optimizer_spec({"type": "AdamW", "lr": 1e-3, "torch_adam": True}, engine_keys=deepspeed) \
        is torch.optim.AdamW
    assert check_optimizer_spec({"type": "Lamb", "lr": 1e-3}, engine_keys=deepspeed) is None
    with pytest.raises(ValueError, match="optimizer torch_adam='yes' is a str: the engine that builds it takes True "
                                         "or False"):
        check_optimizer_spec({"type": "AdamW", "torch_adam": "yes"}, engine_keys=deepspeed)
    with pytest.raises(ValueError, match="optimizer key 'torch_adam' is not an option of torch.optim.AdamW"):
        check_optimizer_spec({"type": "AdamW", "torch_adam": True})
    with pytest.raises(ValueError, match="optimizer type='Lamb' is not valid"):
        check_optimizer_spec({"type": "Lamb"})


@pytest.mark.parametrize("options", [dict(strategy="none"), dict(strategy="ddp"), dict(strategy="fsdp"),
                                     dict(strategy="fsdp1"), dict(strategy="deepspeed"),
                                     dict(strategy="none", memory="lean")], ids=repr)
def test_wrap_model_refuses_a_string_lr_before_the_model_changes(options):
    model = build_llama("tiny", seed=0)
    before = [(p, p.dtype) for p in model.parameters()]
    spec = {"type": "AdamW", "lr": "3e-4", "betas": (0.9, 0.95)}
    with pytest.raises(ValueError, match=r"optimizer lr='3e-4' is a str: torch.optim.AdamW takes a number or a "
                                         r"tensor there: pass one, e.g. lr=0.001"):
        wrap_model(model, optimizer=spec, **options)
    assert [(p, p.dtype) for p in model.parameters()] == before  # the same tensors, still fp32


def test_build_optimizer_the_msamp_path_refuses_the_same():
    with pytest.raises(ValueError, match=r"optimizer betas='0.9, 0.95' is a str: torch.optim.Adam takes a list of 2"):
        build_optimizer({"type": "Adam", "lr": 1e-3, "betas": "0.9, 0.95"}, [nn.Parameter(torch.zeros(2))])
