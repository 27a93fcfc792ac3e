"""A strategy with a knob of its own, defined here alone: its nested ``Config`` makes the knob a flat key, a flag and
a YAML key of every command, read by the strategy through ``cfg.parallel.knobs(name)``; ``fp8dist plan`` and
``fp8dist estimate`` run for real with it, in this process (no rank: neither shards anything).

The strategy replicates the model like DDP and splits the optimizer states over ``state_shards`` ranks (ZeRO-1's
layout): the plan names the split, the estimate's optimizer states shrink by it. The registration is undone after each
test, so the suite's registries stay as they were. The three tests cost about 7 s together (in-process)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from fp8dist import cli
from fp8dist.config.axis import ALWAYS, STRATEGIES, StrategyFacts
from fp8dist.strategies import Strategy, register_strategy

NAME = "split_states"


class SplitStates(Strategy):
    """Every rank holds the whole model; the optimizer states are split over ``state_shards`` ranks."""

    name = NAME
    options = {"state_shards": ALWAYS}

    @dataclass(kw_only=True, frozen=True)
    class Config:
        state_shards: int = field(default=1, metadata={"min": 1})
        """Ranks the optimizer states are split over (ZeRO-1's layout); 1: every rank holds them all."""

    def facts(self, cfg, world_size=None):
        return StrategyFacts(autocast_forward=True, broadcasts_weights=True,
                             shard_degree=None if world_size is None else 1)

    def _shards(self, cfg, world_size: int) -> int:
        shards = cfg.parallel.knobs(self.name).state_shards
        if world_size % shards:
            raise ValueError(f"state_shards={shards} does not split world size {world_size} into equal groups: "
                             "pass a divisor of the world size.")
        return shards

    def layout_notes(self, model, cfg, world_size):
        return (f"optimizer states split over {self._shards(cfg, world_size)} ranks",)

    def rank_state_bytes(self, params, cfg, world_size, engine, *, step, level_states, backend_optimizer):
        shards = self._shards(cfg, world_size)
        rows = super().rank_state_bytes(params, cfg, world_size, engine, step=step, level_states=level_states,
                                        backend_optimizer=backend_optimizer)
        return [{**row, "optimizer_states": row["optimizer_states"] // shards} for row in rows]


@pytest.fixture
def split_states():
    """SplitStates registered for one test, the registry restored after it."""
    STRATEGIES.names()  # the built-ins registered first: they stay
    before = dict(STRATEGIES._values), {name: dict(known) for name, known in STRATEGIES._known.items()}
    try:
        yield register_strategy(SplitStates())
    finally:
        for now, then in zip((STRATEGIES._values, STRATEGIES._known), before):
            now.clear()
            now.update(then)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_strategys_own_knob_is_a_flag_a_key_and_read_by_plan_and_estimate(split_states, capsys, tmp_path):
    from fp8dist import resolve_config

    plan = ("plan", "--model-size", "tiny", "--fp8", "none", "--strategy", NAME, "--world-size", "4")
    code, out, _ = _run(capsys, *plan, "--state-shards", "2")
    assert code == 0 and "note: optimizer states split over 2 ranks" in out, out
    estimate = ("estimate", "--model-size", "tiny", "--fp8", "none", "--strategy", NAME, "--world-size", "4",
                "--json")
    states = {}
    for shards in ("1", "4"):
        code, out, _ = _run(capsys, *estimate, "--state-shards", shards)
        assert code == 0, out
        found = json.loads(out)
        assert found["strategy"] == NAME
        states[shards] = found["bytes"]["optimizer_states"]
    assert states["1"] == 4 * states["4"] > 0  # the knob reached the strategy's memory figures
    config = tmp_path / "split.yaml"
    config.write_text(f"strategy: {NAME}\n{NAME}:\n  state_shards: 4\n")  # nested under its strategy, or flat
    code, out, _ = _run(capsys, "plan", "--model-size", "tiny", "--fp8", "none", "--world-size", "4", "--config",
                        str(config))
    assert code == 0 and "note: optimizer states split over 4 ranks" in out, out
    assert resolve_config(config).to_dict()["state_shards"] == resolve_config({"state_shards": 4}).to_dict()[
        "state_shards"] == 4
    cfg = resolve_config(strategy=NAME, state_shards=2)  # a keyword, read flat or as the strategy's Config
    assert cfg.parallel.state_shards == cfg.parallel.knobs(NAME).state_shards == 2


def test_a_bad_value_of_the_knob_is_refused_and_under_another_strategy_it_is_said_unread(split_states, capsys):
    plan = ("plan", "--model-size", "tiny", "--fp8", "none", "--world-size", "4")
    code, _, err = _run(capsys, *plan, "--strategy", NAME, "--state-shards", "0")  # the Config's own minimum
    assert code == 2 and "state_shards=0 must be at least 1." in err, err
    code, _, err = _run(capsys, *plan, "--strategy", NAME, "--state-shards", "3")  # the strategy's own check
    assert code == 2 and "state_shards=3 does not split world size 4" in err, err
    code, out, err = _run(capsys, *plan, "--strategy", "ddp", "--state-shards", "2")
    assert code == 0 and "optimizer states split" not in out
    assert (f"fp8dist plan: note: state_shards=2 has no effect here (read only when strategy in [{NAME!r}]; "
            "strategy='ddp')." in err), err
    with pytest.raises(SystemExit):  # not an integer: argparse's usage error, naming the flag
        cli.main([*plan, "--strategy", NAME, "--state-shards", "two"])
    assert "state_shards='two' must be an integer" in capsys.readouterr().err


def test_a_knob_its_strategy_does_not_say_it_reads_is_refused_at_registration():
    """Else the knob set under another strategy would change nothing and say nothing."""
    class Forgetful(SplitStates):
        name = "forgetful"
        options = {}

    names = STRATEGIES.names()
    with pytest.raises(ValueError) as caught:
        register_strategy(Forgetful())
    assert "Forgetful.Config's knob 'state_shards' is in none of its options: add 'state_shards': ALWAYS" in \
        str(caught.value)
    assert STRATEGIES.names() == names
