"""Bad input to the numerics probe and the telemetry: every batch the model cannot read, a threshold of the wrong
type, a bool where a count of steps belongs, a strategy the user never chose; each a clear one-line error naming
the value and the way out, raised before the model runs (never a crash inside torch halfway through)."""

from __future__ import annotations

import pytest
import torch

import fp8dist
from fp8dist.train.models import build_llama
from fp8dist.numerics import FP8Telemetry, Thresholds

pytest.importorskip("torchao", reason="torchao is not installed")

VOCAB = 256  # the tiny Llama's vocabulary (build_llama)
IDS = torch.randint(0, VOCAB, (2, 16))


@pytest.fixture(scope="module")
def llama():
    """The tiny Llama with a counter of its forwards: a refusal must come before the first one."""
    torch.manual_seed(0)
    model = build_llama("tiny")
    model.forwards = 0

    def count(module, args, kwargs):
        module.forwards += 1

    model.register_forward_pre_hook(count, with_kwargs=True)
    return model


BAD_BATCHES = [
    ("float ids", [IDS.float()], ValueError, ("batch 0 holds torch.float32 values", "ids.long()")),
    ("bool ids", [IDS > 5], ValueError, ("batch 0 holds torch.bool values",)),
    ("an id equal to the vocabulary size", [IDS, torch.full((2, 16), VOCAB)], ValueError,
     ("batch 1 holds token id 256", "ids 0 to 255 (vocab_size=256)", "tokenizer")),
    ("a negative id", [IDS.clone().fill_(-1)], ValueError, ("batch 0 holds token id -1",)),
    ("one sequence without its batch dim", [IDS[0]], ValueError,
     ("batch 0 has shape (16,)", "(batch, sequence)", "ids.unsqueeze(0)")),
    ("a 3-D tensor", [IDS[None]], ValueError, ("batch 0 has shape (1, 2, 16)", "(batch, sequence)")),
    ("no tokens", [IDS[:, :0]], ValueError, ("batch 0 has shape (2, 0), no tokens",)),
    ("longer than the model's positions", [torch.zeros(1, 513, dtype=torch.long)], ValueError,
     ("sequences of 513 tokens", "512 positions", "512 tokens or less")),
    ("a list as a batch", [[1, 2, 3]], TypeError, ("batch 0 is a list", "token id tensors or dicts")),
    ("one tensor instead of a list of batches", IDS, TypeError, ("batches is one tensor", "pass a list")),
    ("one dict instead of a list of batches", {"input_ids": IDS}, TypeError, ("batches is a dict", "pass a list")),
    ("no batches", [], ValueError, ("batches is empty",)),
    ("a generator of no batches", (b for b in []), ValueError, ("batches is empty",)),
    ("dict with float input_ids", [{"input_ids": IDS.float(), "labels": IDS}], ValueError,
     ("batch 0['input_ids'] holds torch.float32 values",)),
    ("dict with labels past the vocabulary", [{"input_ids": IDS, "labels": IDS + VOCAB}], ValueError,
     ("batch 0['labels'] holds token id", "or -100 to ignore a label")),
    ("dict with a list of ids", [{"input_ids": IDS.tolist()}], TypeError,
     ("batch 0['input_ids'] is a list", "pass a tensor")),
    ("dict with labels of another shape", [{"input_ids": IDS, "labels": IDS[:, :8]}], ValueError,
     ("labels of shape (2, 8) and input_ids of shape (2, 16)", "same shape")),
]


@pytest.mark.parametrize("batches, expected, texts", [c[1:] for c in BAD_BATCHES], ids=[c[0] for c in BAD_BATCHES])
def test_a_batch_the_model_cannot_read_is_named_before_the_model_runs(llama, batches, expected, texts):
    before = llama.forwards
    with pytest.raises(expected) as err:
        fp8dist.measure_fp8_numerics(llama, batches, fp8="torchao")
    message = str(err.value)
    assert all(t in message for t in texts), message
    assert "\n" not in message and llama.forwards == before


def test_ignored_labels_and_a_good_last_batch_after_bad_ones_are_told_apart(llama):
    labels = IDS.clone()
    labels[:, :4] = -100  # prompt tokens left out of the loss: a valid label
    report = fp8dist.measure_fp8_numerics(llama, [{"input_ids": IDS, "labels": labels}], fp8="torchao")
    assert report.batches == 1 and report.tokens == IDS.numel()
    before = llama.forwards
    with pytest.raises(ValueError, match="batch 2 holds token id 300"):  # the last batch is bad: nothing ran
        fp8dist.measure_fp8_numerics(llama, [IDS, IDS, IDS.clone().fill_(300)], fp8="torchao")
    assert llama.forwards == before


def test_thresholds_take_a_dict_of_limits_and_refuse_other_types(llama):
    report = fp8dist.measure_fp8_numerics(llama, [IDS], fp8="torchao", thresholds={"max_flushed_share": 0.02})
    assert report.thresholds == Thresholds(max_flushed_share=0.02)
    cases = [(0.02, TypeError, ("thresholds=0.02 is a float", "Thresholds(...) or a dict")),
             ("strict", TypeError, ("thresholds='strict' is a str",)),
             ({"max_flush": 0.1}, ValueError, ("'max_flush'", "Did you mean 'max_flushed_share'?")),
             ({"max_flushed_share": "a lot"}, ValueError, ("max_flushed_share='a lot' must be a number",)),
             ({"min_output_sqnr_db": True}, ValueError, ("min_output_sqnr_db=True must be a number",)),
             ({"max_flushed_share": 5}, ValueError, ("max_flushed_share=5 must be a share between 0 and 1",))]
    before = llama.forwards
    for value, expected, texts in cases:
        with pytest.raises(expected) as err:
            fp8dist.measure_fp8_numerics(llama, [IDS], fp8="torchao", thresholds=value)
        assert all(t in str(err.value) for t in texts), str(err.value)
    with pytest.raises(TypeError, match="loss_fn='loss' is not callable"):
        fp8dist.measure_fp8_numerics(llama, [IDS], fp8="torchao", loss_fn="loss")
    assert llama.forwards == before


def test_a_refusal_names_the_strategy_as_the_default_when_the_user_chose_none(llama, capsys):
    from fp8dist.cli import main

    with pytest.raises(ValueError) as err:
        fp8dist.measure_fp8_numerics(llama, [IDS], fp8="msamp")
    assert str(err.value).startswith("fp8='msamp' with the default strategy='fsdp': ")
    with pytest.raises(ValueError) as err:
        fp8dist.measure_fp8_numerics(llama, [IDS], fp8="torchao", param_dtype="fp16")
    assert str(err.value).startswith("param_dtype='fp16' with the default strategy='fsdp': ")
    with pytest.raises(ValueError) as err:  # chosen: named as chosen
        fp8dist.measure_fp8_numerics(llama, [IDS], fp8="msamp", strategy="fsdp")
    assert str(err.value).startswith("fp8='msamp' with strategy='fsdp': ")
    with pytest.raises(ValueError) as err:  # the same rule, the same words, wherever the config is made
        fp8dist.wrap_model(build_llama("tiny"), fp8="msamp")
    assert str(err.value).startswith("fp8='msamp' with the default strategy='fsdp': ")
    assert main(["probe", "--fp8", "msamp"]) == 2
    err_text = capsys.readouterr().err
    assert err_text.startswith("fp8dist probe: error: fp8='msamp' with the default strategy='fsdp': ")
    assert err_text.count("\n") == 1


@pytest.fixture(scope="module")
def fp8_model():
    return fp8dist.wrap_model(build_llama("tiny"), strategy="none", fp8="torchao")


BAD_TELEMETRY = [
    ({"every": True}, ValueError, ("every=True must be a whole number of steps >= 1",)),
    ({"every": 2.5}, ValueError, ("every=2.5 must be a whole number",)),
    ({"every": 0}, ValueError, ("every=0 must be",)),
    ({"every": 1, "step": False}, ValueError, ("step=False must be the number of the step about to run",)),
    ({"every": 1, "step": -3}, ValueError, ("step=-3 must be",)),
    ({"every": 1, "thresholds": 0.5}, TypeError, ("thresholds=0.5 is a float",)),
    ({"every": 1, "thresholds": {"max_flushed": 0.5}}, ValueError, ("'max_flushed'",)),
    ({"every": 1, "optimizer": "adamw"}, TypeError, ("optimizer='adamw' is not a torch.optim.Optimizer",)),
    ({"every": 1, "log": "stdout"}, TypeError, ("log='stdout' is not callable", "print")),
]


@pytest.mark.parametrize("kwargs, expected, texts", BAD_TELEMETRY, ids=[str(c[0]) for c in BAD_TELEMETRY])
def test_telemetry_refuses_a_bool_for_a_count_and_other_wrong_types(fp8_model, kwargs, expected, texts):
    with pytest.raises(expected) as err:
        FP8Telemetry(fp8_model, **kwargs)
    assert all(t in str(err.value) for t in texts), str(err.value)


def test_telemetry_takes_a_dict_of_limits_and_a_count_written_as_text(fp8_model):
    telemetry = FP8Telemetry(fp8_model, every="2", thresholds={"max_flushed_share": 0.5})
    assert telemetry.every == 2 and telemetry.thresholds.max_flushed_share == 0.5
    telemetry.close()
