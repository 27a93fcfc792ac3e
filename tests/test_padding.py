"""FSDP2's per-rank padding (fp8dist/strategies/padding.py): the shapes arithmetic, what the estimate and
``fp8dist plan`` say for Mixtral 8x7B on 64 ranks, and what FSDP2 really allocates on 3 CPU ranks when the fused
experts' dim 0 is shorter than the world size."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from dist_harness import run_ranks
from transformers import MixtralConfig, MixtralForCausalLM

from fp8dist import cli, estimate_memory
from fp8dist.strategies.padding import padding_note, shard_padding

# Mixtral-8x7B's shape: 8 experts of intermediate 14336 fused as (8, 2*14336, 4096) and (8, 4096, 14336)
MIXTRAL_8X7B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _mixtral(meta: bool = True, **dims) -> MixtralForCausalLM:
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return MixtralForCausalLM(MixtralConfig(**dims))


def test_every_rank_allocates_the_first_chunk():
    padded = {p.name: p for p in shard_padding({"one": (1, 8), "three": (3, 8), "even": (4, 8), "scalar": ()}, 2)}
    # dim 0 = 1 on 2 ranks: both allocate the one row (2x); 3 rows: 2 per rank, rank 1 holds 1 real row
    assert [(p.rows_per_rank, p.padded_numel, p.rows_on(0), p.rows_on(1)) for p in padded.values()] == [
        (1, 8, 1, 0), (2, 16, 2, 1), (2, 16, 2, 2), (1, 1, 1, 0)]
    assert (padded["one"].factor, padded["three"].factor, padded["even"].factor) == (2.0, 4 / 3, 1.0)
    with pytest.raises(ValueError, match=r"world_size=0 must be a positive integer \(the ranks FSDP2 shards over\)"):
        shard_padding({"w": (4, 4)}, 0)


def test_the_note_appears_only_when_the_padding_is_large():
    assert padding_note(shard_padding({"embed": (41, 32), "norm": (32,)}, 2)) is None  # 42/41 rows: 1.02x
    assert padding_note([]) is None
    note = padding_note(shard_padding({"experts": (2, 96, 32), "norm": (32,)}, 3))
    allocated, even = 1 * 96 * 32 + math.ceil(32 / 3), (2 * 96 * 32 + 32) / 3  # one of 2 expert rows, 11 of 32
    assert f"every rank allocates {allocated:,} elements where an even split is {even:,.0f} " \
           f"({allocated / even:.2f}x)" in note
    assert "1 parameters have dim 0 < 3 ranks" in note and "(2, 96, 32) like experts (1.5x)" in note
    assert "shard them on dim 1, which 3 divides" in note and "Shard(1)" in note
    odd = padding_note(shard_padding({"experts": (2, 95, 31)}, 3))  # no dim 3 divides: FSDP2 refuses uneven dim 1
    assert "shard each on a dim 3 divides" in odd and "Shard(1)" not in odd


def test_mixtral_8x7b_on_64_fsdp2_ranks_shows_the_padding_and_the_way_out():
    model = _mixtral(**MIXTRAL_8X7B)
    est = estimate_memory(model, strategy="fsdp", fp8="none", world_size=64, seq_len=4096)
    # expected from the shapes: a parameter of dim 0 = d holds ceil(d / 64) of its d rows on every rank
    rows = {n: math.ceil(p.shape[0] / 64) * p.numel() // p.shape[0] for n, p in model.named_parameters()}
    experts = sum(v for n, v in rows.items() if n.endswith(EXPERTS))
    assert experts == 32 * (2 * 14336 * 4096 + 4096 * 14336)  # one of 8 rows of each fused tensor: 1/8, not 1/64
    padded, n, tensors = sum(rows.values()), sum(p.numel() for p in model.parameters()), len(rows)
    # fp32 weights and gradients on the padded rows, AdamW's two fp32 states on rank 0's (full) rows, a step each
    assert est.rank == 0 and est.model_state_bytes == 16 * padded + 4 * tensors
    per_param = est.model_state_bytes / n
    assert per_param == pytest.approx(16 * padded / n, rel=1e-6) and per_param > 7 * 16 / 64  # 8x the even 0.25
    note = next(x for x in est.notes if x.startswith("FSDP2 pads"))
    assert f"every rank allocates {padded:,} elements" in note
    assert "32 x (8, 28672, 4096) like model.layers.0.mlp.experts.gate_up_proj (8.0x)" in note
    assert "32 x (8, 4096, 14336) like model.layers.0.mlp.experts.down_proj (8.0x)" in note
    assert "shard_placement_fn=lambda p: Shard(1) if p.dim() > 1 and p.shape[0] < 64 else None" in note
    assert "expert parallelism" in note
    assert not any(x.startswith("FSDP2 pads") for x in estimate_memory(model, strategy="fsdp", world_size=8).notes)


def test_plan_prints_the_padding_note_for_the_world_size(tmp_path, capsys):
    config = tmp_path / "mixtral.json"
    config.write_text(json.dumps({"model_type": "mixtral", **MIXTRAL_8X7B}))
    argv = ["plan", "--strategy", "fsdp", "--fp8", "none", "--model-config", str(config)]
    assert cli.main([*argv, "--world-size", "64"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: FSDP2 pads")]
    assert len(notes) == 1 and "Shard(1)" in notes[0] and "expert parallelism" in notes[0]
    assert cli.main(argv) == 0 and "FSDP2 pads" not in capsys.readouterr().out  # one rank: nothing to pad
    assert cli.main([*argv, "--world-size", "0"]) == 2
    assert "world_size=0 must be a positive integer" in capsys.readouterr().err


# --- what FSDP2 really allocates ---------------------------------------------------------------------------------

TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            num_local_experts=2, num_experts_per_tok=1, vocab_size=40, max_position_embeddings=64)


def _step_and_compare(rank: int, world: int) -> tuple[dict, dict, tuple[str, ...], list[str]]:
    """One AdamW step of a tiny Mixtral whose 2 experts are sharded over 3 ranks; the report vs the estimate."""
    import fp8dist

    base = _mixtral(meta=False, **TINY)
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(rank))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fp8dist.wrap_model(base, strategy="fsdp", fp8="none")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    measured = fp8dist.report(model, optimizer)
    estimated = estimate_memory(_mixtral(**TINY), strategy="fsdp", fp8="none", world_size=world, rank=rank)
    return (dict(measured.bytes), dict(estimated.bytes), fp8dist.get_wrap_info(model).sharding.notes,
            [str(w.message) for w in caught])


@pytest.mark.slow
def test_fsdp2_allocates_the_padded_rows_the_estimate_counts():
    results = run_ranks(_step_and_compare, world_size=3, timeout=300)
    shapes = {n: tuple(p.shape) for n, p in _mixtral(**TINY).named_parameters()}
    expected_note = padding_note(shard_padding(shapes, 3))
    assert expected_note is not None and "(2, 96, 32) like model.layers.0.mlp.experts.gate_up_proj (1.5x)" in \
        expected_note
    for rank, (measured, estimated, notes, warned) in enumerate(results):
        assert measured == estimated, f"rank {rank}"  # to the byte, rank 2's empty expert rows padded too
        assert expected_note in notes, f"rank {rank}: recorded as data on every rank"
        assert (expected_note in warned) == (rank == 0), f"rank {rank}: warned once, by rank 0"
    assert results[2][0]["parameters"] == results[0][0]["parameters"], "rank 2 allocates rows it does not hold"
