"""One rule for an option that no chosen axis reads (README, "An option set away from its default where no chosen
axis reads it is said in one warning naming who reads it"): the same knob gives the same outcome -- a run, and one
note with the combination table's words -- whether it comes as a keyword, in fp8dist's YAML or JSON file, in a file
written by ``accelerate config``, or as a command-line flag."""

from __future__ import annotations

import json
import warnings

import pytest
import yaml
from cli_helpers import run

from fp8dist import cli, resolve_config, wrap_model
from fp8dist.train.models import build_llama

AMAX = ("amax_history_len=16 has no effect here (read only when fp8 in ['te'] and te_recipe in ['delayed']; "
        "fp8='torchao', te_recipe='delayed').")

# (id, fp8dist keys, the same in a file written by `accelerate config`, the same as flags, the note)
KNOBS = [
    ("TE amax history under torchao", {"strategy": "none", "fp8": "torchao", "amax_history_len": 16},
     {"distributed_type": "NO", "mixed_precision": "fp8", "fp8_config": {"backend": "AO", "amax_history_length": 16}},
     ["--strategy", "none", "--fp8", "torchao", "--amax-history-len", "16"], AMAX),
    ("HSDP under fsdp1", {"strategy": "fsdp1", "fp8": "none", "replicate_degree": 2},
     {"distributed_type": "FSDP", "mixed_precision": "bf16", "fsdp_config": {"fsdp_version": 1},
      "parallelism_config": {"parallelism_config_dp_replicate_size": 2}},
     ["--strategy", "fsdp1", "--fp8", "none", "--replicate-degree", "2"],
     "replicate_degree=2 has no effect here (read only when strategy in ['fsdp']; strategy='fsdp1')."),
    ("float8 all-gather under fsdp1", {"strategy": "fsdp1", "fp8": "torchao", "fp8_all_gather": True},
     {"distributed_type": "FSDP", "mixed_precision": "fp8", "fsdp_config": {"fsdp_version": 1},
      "fp8_config": {"backend": "AO", "enable_fsdp_float8_all_gather": True}},
     ["--strategy", "fsdp1", "--fp8", "torchao", "--fp8-all-gather"],
     "fp8_all_gather=True has no effect here (read only when fp8 in ['torchao'] and strategy in ['fsdp']"),
]


def _files(tmp_path, ours: dict, accelerate: dict) -> dict[str, str]:
    paths = {"fp8dist yaml": tmp_path / "ours.yaml", "fp8dist json": tmp_path / "ours.json",
             "accelerate yaml": tmp_path / "default_config.yaml", "accelerate json": tmp_path / "accelerate.json"}
    paths["fp8dist yaml"].write_text(yaml.safe_dump(ours))
    paths["fp8dist json"].write_text(json.dumps(ours))
    paths["accelerate yaml"].write_text(yaml.safe_dump(accelerate))
    paths["accelerate json"].write_text(json.dumps(accelerate))
    return {name: str(path) for name, path in paths.items()}


@pytest.mark.parametrize("name, ours, accelerate, flags, note", KNOBS, ids=[k[0] for k in KNOBS])
def test_the_same_unread_knob_is_the_same_note_from_flags_files_and_keywords(tmp_path, capsys, name, ours, accelerate,
                                                                            flags, note):
    files = _files(tmp_path, ours, accelerate)
    notes = {"keywords": resolve_config(**ours).unread_notes()}
    notes.update({source: resolve_config(path).unread_notes() for source, path in files.items()})
    assert all(any(note in n for n in found) for found in notes.values()), notes
    assert len({tuple(found) for found in notes.values()}) == 1, notes  # word for word the same everywhere
    for argv in ([*flags], *(["--config", path] for path in files.values())):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the Accelerate files' launcher notice is another matter
            assert cli.main(["plan", *argv]) == 0, argv
        err = capsys.readouterr().err
        assert f"fp8dist plan: note: {note}" in err and "error" not in err, (argv, err)


def test_wrap_model_warns_once_and_runs_for_the_knob_from_keywords_and_both_files(tmp_path):
    name, ours, accelerate, _, note = KNOBS[0]
    files = _files(tmp_path, ours, accelerate)
    for config in (None, files["fp8dist yaml"], files["accelerate yaml"]):
        options = ours if config is None else {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrap_model(build_llama("tiny", seed=0), config=config, **options)
        said = [str(w.message) for w in caught if note in str(w.message)]
        assert said == [note], (config, [str(w.message) for w in caught])


def test_every_option_has_its_readers_or_is_read_by_every_run():
    """An option no axis declares used to count as read by every run: fp8_exclude, on_unsupported and
    keep_last_blocks_share under fp8=None changed nothing and said nothing. Now each option is declared."""
    from fp8dist.config.options import SECTIONS
    from fp8dist.config.rules import EVERY_RUN, _readers
    from fp8dist.config.schema import flat_fields

    options = {f.name for section in SECTIONS.values() for _, f in flat_fields(section)}
    assert options - set(_readers()) - set(EVERY_RUN) == set()  # declare who reads a new option
    assert set(_readers()) & set(EVERY_RUN) == set()


BACKENDS_NOTE = "has no effect here (read only when fp8 in ['te', 'torchao', 'msamp']; fp8=None)."


@pytest.mark.parametrize("option, value", [("fp8_exclude", ["lm_head"]), ("on_unsupported", "fallback"),
                                           ("keep_last_blocks_share", 0.25), ("torchao_api", "weight_wrapper"),
                                           ("fp8_select", "all")])
def test_an_fp8_option_without_a_backend_is_a_note_in_the_plan_and_in_wrap_model(capsys, option, value):
    flag = f"--{option.replace('_', '-')}"
    argv = ["plan", "--strategy", "none", "--fp8", "none", flag, ",".join(value) if isinstance(value, list) else
            str(value)]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert f"fp8dist plan: note: {option}={value!r} has no effect here (read only when fp8 in " in err, err
    if option in ("fp8_exclude", "on_unsupported", "keep_last_blocks_share"):
        assert f"{option}={value!r} {BACKENDS_NOTE}" in err, err
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrap_model(build_llama("tiny", seed=0), strategy="none", fp8=None, **{option: value})
    said = [str(w.message) for w in caught if str(w.message).startswith(f"{option}=")]
    assert len(said) == 1 and "has no effect here" in said[0], [str(w.message) for w in caught]


def _bench_settings(*flags: str):
    import argparse

    from fp8dist.bench.runner import resolve_settings
    from fp8dist.cli import bench

    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_settings(parser.parse_args(["bench", "--sizes", "tiny", *flags]), "cpu")
    return [str(w.message) for w in caught if w.category is UserWarning]


def test_bench_says_a_matrix_flag_no_cell_reads(tmp_path):
    """``fp8dist bench --fp8 none --torchao-api weight_wrapper`` ran its bf16 cells and said nothing of the API."""
    assert _bench_settings("--fp8", "none,te", "--torchao-api", "weight_wrapper", "--torchao-recipe", "rowwise") == [
        "--torchao-recipe rowwise has no effect here: only the fp8 torchao cells read it, and --fp8 none,te has "
        "none; add torchao to --fp8.",
        "--torchao-api weight_wrapper has no effect here: only the fp8 torchao cells read it, and --fp8 none,te has "
        "none; add torchao to --fp8."]
    assert _bench_settings("--strategies", "ddp,fsdp", "--zero-stage", "3") == [
        "--zero-stage 3 has no effect here: only the deepspeed cells read it, and --strategies ddp,fsdp has none; "
        "add deepspeed to --strategies."]
    assert _bench_settings("--fp8", "none,torchao", "--torchao-api", "weight_wrapper", "--strategies", "deepspeed",
                           "--zero-stage", "3") == []
    assert _bench_settings("--fp8", "none", "--torchao-api", "auto") == []  # its default
    done = run(["python", "-m", "fp8dist", "bench", "--fp8", "none", "--torchao-api", "weight_wrapper", "--strategies",
                "none", "--sizes", "tiny", "--steps", "4", "--batch-size", "1", "--seq-len", "16", "--no-plot",
                "--no-raw", "--out", str(tmp_path)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("fp8dist bench: warning: --torchao-api weight_wrapper has no effect here: only the fp8 torchao cells "
            "read it, and --fp8 none has none; add torchao to --fp8.") in done.stderr


def test_the_numerics_probe_says_an_option_no_chosen_axis_reads(tmp_path):
    """measure_fp8_numerics resolved its options and said nothing of one no axis reads (the CLI alone said it)."""
    import torch

    from fp8dist import measure_fp8_numerics

    note = "te_recipe='current' has no effect here (read only when fp8 in ['te']; fp8='torchao')."
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        measure_fp8_numerics(build_llama("tiny", seed=0), [torch.randint(0, 256, (1, 16))], fp8="torchao",
                             te_recipe="current")
    assert [str(w.message) for w in caught if "no effect" in str(w.message)] == [note]
    done = run(["python", "-m", "fp8dist", "probe", "--fp8", "torchao", "--te-recipe", "current", "--model-size",
                "tiny", "--batches", "1", "--seq-len", "16"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("te_recipe='current' has no effect here") == 1, done.stderr
    assert f"fp8dist probe: warning: {note}" in done.stderr
