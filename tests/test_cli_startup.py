"""The ``fp8dist`` command parses its flags before it imports an engine: a bad flag, a bad choice and ``--help``
answer without importing torch, transformers, torchao, deepspeed or peft (issue 50 item 9). The engines load once the
flags parse.

Measured on the 2-core development machine shared by 7 engineers (2026-12-01), ``python -m fp8dist train
--bad-flag``: 11.2-14.2 s before at load average 7-8 (1,985 modules imported, torch and transformers among them;
``-X importtime``: 18.3 s of imports), 2.7-2.9 s before at load 2; after, 0.44-0.79 s at load 7-8 and 0.12-0.14 s at
load 2 (193 modules, 0.43 s of imports under load). In a warm process (torch imported, as the in-process CLI tests
run) ``main(["train", "--bad-flag"])`` went from 230 ms to 73 ms: only the named command's parser is built. Each
subprocess below is one such start. ``fp8dist bench``, whose flags read the engines' facts (the strategies each
device runs, each backend's variant options: registered beside each built-in now) and whose lists are checked outside
argparse (``check_flags``), went from 5.7-6.6 s to 0.24-0.38 s at load 6 (1,983 modules to 196; 2026-12-02)."""

from __future__ import annotations

import sys

import pytest

from cli_helpers import run

ENGINES = ("torch", "transformers", "torchao", "deepspeed", "peft")


def _engines_imported(stderr: str) -> list[str]:
    """The engine modules ``python -X importtime`` reported importing (one ``import time: ... | module`` line each)."""
    modules = (line.rpartition("|")[2].strip() for line in stderr.splitlines() if line.startswith("import time:"))
    return sorted({m for m in modules if m.partition(".")[0] in ENGINES})


def _command(*argv: str):
    return run(["python", "-X", "importtime", "-m", "fp8dist", *argv], timeout=120)


def _said(stderr: str) -> str:
    """stderr without ``-X importtime``'s lines: what the user reads."""
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("import time:"))


@pytest.mark.parametrize("argv,message", [
    (["train", "--bad-flag"], "fp8dist: error: unrecognized arguments: --bad-flag"),
    (["plan", "--bad-flag"], "fp8dist: error: unrecognized arguments: --bad-flag"),
    (["estimate", "--bad-flag"], "fp8dist: error: unrecognized arguments: --bad-flag"),
    (["probe", "--bad-flag"], "fp8dist: error: unrecognized arguments: --bad-flag"),
    (["ds-config", "--bad-flag"], "fp8dist: error: unrecognized arguments: --bad-flag"),
    (["env", "--bad-flag"], "fp8dist: error: unrecognized arguments: --bad-flag"),
    (["launch", "nowhere"], "fp8dist launch: error: argument target: invalid choice: 'nowhere'"),
    (["trian"], "fp8dist: error: argument COMMAND: invalid choice: 'trian' (choose from 'train', 'plan'"),
    # choices read from the registries and a backend's own Config, not from a copy of their names
    (["train", "--strategy", "fsdp3"], "fp8dist train: error: argument --strategy: strategy='fsdp3' is not valid; "
                                       "choose one of: 'none', 'ddp', 'fsdp', 'fsdp1', 'deepspeed'. Did you mean"),
    (["plan", "--memory", "leaner"], "fp8dist plan: error: argument --memory: memory='leaner' is not valid; choose "
                                     "one of: 'standard', 'lean'."),
    (["estimate", "--te-recipe", "fast"], "fp8dist estimate: error: argument --te-recipe: te_recipe='fast' is not "
                                          "valid; choose one of: 'delayed', 'current', 'mxfp8', 'blockwise', 'nvfp4'."),
    (["estimate", "--optimizer", "adam8bit"], "argument --optimizer: invalid choice: 'adam8bit' (choose from "
                                              "'adamw', 'adam', 'sgd_momentum', 'sgd')"),
    (["bench", "--bad-flag"], "fp8dist: error: unrecognized arguments: --bad-flag"),
    # a list item checked against the registry's names; the example is the strategies it registered for a GPU
    (["bench", "--strategies", "fsdp,fsdp3"], "fp8dist bench: error: --strategies: 'fsdp3' is not one of none, ddp, "
                                              "fsdp, fsdp1, deepspeed (comma-separated, e.g. --strategies ddp,fsdp)."),
    # torchao's variant options as registered, their values from its Config
    (["bench", "--torchao-recipe", "tensorwise,fast"],
     "fp8dist bench: error: --torchao-recipe: 'fast' is not one of tensorwise, rowwise, rowwise_with_gw_hp, mxfp8, "
     "mxfp8_emulated, nvfp4, auto (comma-separated, e.g. --torchao-recipe tensorwise,rowwise)."),
    (["bench", "--zero-stage", "4"], "fp8dist bench: error: --zero-stage 4 is not one of 1, 2, 3 (one value, e.g. "
                                     "--zero-stage 3)."),
    (["bench", "--steps", "3"], "fp8dist bench: error: --steps 3: needs at least 4 (2 warm-up steps, at least 1 "
                                "timed step and 1 counted step)."),
], ids=lambda value: " ".join(value) if isinstance(value, list) else "error")
def test_a_bad_flag_is_refused_before_any_engine_is_imported(argv, message):
    done = _command(*argv)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in _said(done.stderr)
    assert "Traceback" not in done.stderr
    assert _engines_imported(done.stderr) == []


@pytest.mark.parametrize("argv,shown", [
    ([], ("train", "ds-config", "launch", "the reference job")),  # every command's line
    (["train"], ("--strategy {none,ddp,fsdp,fsdp1,deepspeed}", "--te-recipe", "--torchao-recipe", "--opt-level",
                 "--lora-rank", "--memory {standard,lean}")),
    (["probe"], ("--batches N", "--min-output-sqnr-db X")),
    # the defaults per device from each strategy's registered bench_devices, torchao's variants from its Config
    (["bench"], ("--strategies LIST", "from none, ddp, fsdp, fsdp1, deepspeed; default: ddp,fsdp,fsdp1,deepspeed on "
                 "CPU, ddp,fsdp on GPU", "--torchao-recipe LIST", "from tensorwise, rowwise, rowwise_with_gw_hp, "
                 "mxfp8, mxfp8_emulated, nvfp4, auto; default: tensorwise", "--torchao-api LIST",
                 "--memory LIST", "default: standard", "--lr-schedule {constant,cosine}", "--eval-every N")),
], ids=lambda value: " ".join(value) or "fp8dist" if isinstance(value, list) else "help")
def test_help_answers_without_importing_an_engine(argv, shown):
    done = _command(*argv, "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    flat = " ".join(done.stdout.split())  # argparse wraps the help at the terminal's width
    assert all(text in flat for text in shown), done.stdout
    assert _engines_imported(done.stderr) == []


def test_the_engines_load_once_the_flags_parse(tmp_path):
    """A command whose flags parse runs as before, its engines imported then (DeepSpeed's bucket sizes from the
    preset's hidden size)."""
    done = _command("ds-config", "--model", "llama-tiny", "-o", str(tmp_path / "ds.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "ds.json").is_file()
    assert "torch" in _engines_imported(done.stderr)


def test_import_fp8dist_loads_the_engines_with_the_first_public_name():
    """``import fp8dist`` imports no engine; ``fp8dist.wrap_model`` (any public name) loads them all, as before."""
    code = ("import sys, fp8dist; before = 'torch' in sys.modules; version = fp8dist.__version__; "
            "light = 'torch' in sys.modules; wrap = fp8dist.wrap_model; "
            "missing = set(fp8dist.__all__) - set(vars(fp8dist)); "
            "print(before, light, 'torch' in sys.modules, wrap.__module__, sorted(missing))")
    done = run([sys.executable, "-c", code], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False", "True", "fp8dist.pipeline.api", "[]"]


def test_a_built_in_registered_by_module_is_checked_against_what_it_registered():
    """The registry answers a built-in's name and registered attributes (an FP8 backend's ``Config``) without
    importing it; on import, an attribute other than the value's own is refused, naming it."""
    from fp8dist.config.axis import Registry
    from fp8dist.fp8.te_config import TEConfig
    from fp8dist.fp8.torchao_config import TorchaoConfig

    registry = Registry("fp8", "FP8 backend")
    registry.register_module("torchao", "fp8dist.fp8.torchao", "BACKEND", Config=TEConfig)
    assert list(registry) == ["torchao"] and registry.attribute("torchao", "Config") is TEConfig
    with pytest.raises(TypeError, match=r"fp8dist\.fp8\.torchao\.BACKEND: registered as fp8='torchao' with Config "
                                        "other than its own"):
        registry["torchao"]
    right = Registry("fp8", "FP8 backend")
    right.register_module("torchao", "fp8dist.fp8.torchao", "BACKEND", Config=TorchaoConfig)
    assert right["torchao"].Config is TorchaoConfig and right.attribute("torchao", "Config") is TorchaoConfig
    # a fact the bench's flags read: equal to the value's own (not the same object) passes, another is refused
    strategies = Registry("strategy", "sharding strategy")
    strategies.register_module("fsdp", "fp8dist.strategies.fsdp", "STRATEGY", bench_devices=tuple(["cpu", "cuda"]))
    strategies.register_module("ddp", "fp8dist.strategies.ddp", "STRATEGY", bench_devices=("cpu",))
    assert strategies.attribute("ddp", "bench_devices") == ("cpu",)  # what it registered, not imported yet
    assert strategies["fsdp"].bench_devices == ("cpu", "cuda")
    with pytest.raises(TypeError, match=r"fp8dist\.strategies\.ddp\.STRATEGY: registered as strategy='ddp' with "
                                        "bench_devices other than its own"):
        strategies["ddp"]


def test_the_built_ins_registered_facts_are_their_own():
    """What the registries answer of a built-in before importing it (the bench's flags: each strategy's
    ``bench_devices`` and ``Config``, each backend's ``Config`` and variant options) is what the value says once
    imported."""
    code = ("import sys; from fp8dist.config.axis import BACKENDS, STRATEGIES; "
            "keys = ((STRATEGIES, ('bench_devices', 'Config')), (BACKENDS, ('Config', 'variant_option', "
            "'more_variant_options'))); "
            "known = [(r, n, k, r.attribute(n, k)) for r, ks in keys for n in r for k in ks]; "
            "light = 'torch' not in sys.modules; "
            "print(light, [(r.option, n, k) for r, n, k, v in known if getattr(r[n], k) != v])")
    done = run([sys.executable, "-c", code], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "[]"]


def test_the_options_know_the_built_in_values_without_importing_an_engine():
    """The config's choices are the registries' names, the built-ins registered when a registry is first read:
    whoever imports only the options sees them, without torch."""
    code = ("import sys; from fp8dist.config.options import FP8Config, StrategyConfig; "
            "s = StrategyConfig(strategy='fsdp1', memory='lean'); p = FP8Config(fp8='msamp', opt_level='O1'); "
            "print(s.strategy, s.memory, p.fp8, p.knobs('msamp').opt_level, 'torch' in sys.modules)")
    done = run([sys.executable, "-c", code], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["fsdp1", "lean", "msamp", "O1", "False"]
