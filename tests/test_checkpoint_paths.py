"""What a path given as a checkpoint directory is, the same for every entry that takes one: save_checkpoint,
load_checkpoint, latest_checkpoint, the training job (TrainConfig.checkpoint_dir) and `fp8dist train
--checkpoint-dir`. A file, a folder of another kind (a Hugging Face model, a torch.distributed.checkpoint or
DeepSpeed folder) and a folder inside a checkpoint are refused by each, naming what it is and the way out, before
anything is written; one checkpoint (a step_* folder) loads, is refused as a place to save into, and resumes a job
that then saves beside it, never inside."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from fp8dist import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint, wrap_model
from fp8dist.cli import main
from fp8dist.train.models import build_llama
from fp8dist.train.checks import check_checkpoint_dir
from fp8dist.train.config import TrainConfig


def _model():
    torch.set_num_threads(1)
    model = wrap_model(build_llama("tiny", seed=0), strategy="none")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _snapshot(directory: Path) -> dict[str, bytes | None]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(directory.rglob("*"))}


@pytest.fixture
def ck(tmp_path) -> Path:
    """A checkpoint directory holding step 1 and step 2 (the newest)."""
    model, opt = _model()
    for step in (1, 2):
        save_checkpoint(tmp_path / "ck", model, opt, step=step)
    return tmp_path / "ck"


# (what the path is, how to make it under tmp, what every entry says about it)
OTHER_KINDS = [
    ("a file", lambda tmp: (tmp / "notes.txt").write_text("x"), "notes.txt",
     "is a file, and a directory is meant: pass a directory"),
    ("a Hugging Face model folder", lambda tmp: [(tmp / "hf").mkdir(), (tmp / "hf" / "config.json").write_text("{}"),
                                                 (tmp / "hf" / "model.safetensors").write_bytes(b"x")], "hf",
     "is a Hugging Face model folder (config.json), not an fp8dist checkpoint directory: load it as pretrained "
     "weights (fp8dist train --pretrained, from_pretrained); checkpoints go to a directory of their own."),
    ("a DCP folder", lambda tmp: [(tmp / "dcp").mkdir(), (tmp / "dcp" / ".metadata").write_bytes(b"x")], "dcp",
     "is a torch.distributed.checkpoint folder that fp8dist.save_checkpoint did not write (no meta.json)"),
    ("a DeepSpeed folder", lambda tmp: [(tmp / "ds" / "global_step5").mkdir(parents=True),
                                        (tmp / "ds" / "latest").write_text("global_step5")], "ds",
     "is a DeepSpeed engine checkpoint folder (global_step5)"),
    ("inside a checkpoint", lambda tmp: None, "ck/step_00000002/deepspeed",
     "is inside the checkpoint '{tmp}/ck/step_00000002': pass that checkpoint, or the checkpoint directory above it "
     "('{tmp}/ck')"),
]


def _entries(path: Path) -> dict:
    model, opt = _model()
    return {
        "save_checkpoint": lambda: save_checkpoint(path, model, opt, step=3),
        "load_checkpoint": lambda: load_checkpoint(path, model, opt),
        "latest_checkpoint": lambda: latest_checkpoint(path),
        "TrainConfig, resume": lambda: check_checkpoint_dir(TrainConfig(checkpoint_dir=str(path), resume=True)),
        "TrainConfig, new run": lambda: check_checkpoint_dir(TrainConfig(checkpoint_dir=str(path))),
    }


@pytest.mark.parametrize("kind,make,name,message", OTHER_KINDS, ids=[k[0] for k in OTHER_KINDS])
def test_every_entry_refuses_a_file_another_kind_of_folder_and_a_folder_inside_a_checkpoint(ck, kind, make, name,
                                                                                            message):
    tmp = ck.parent
    make(tmp)
    before = _snapshot(tmp)
    for entry, call in _entries(tmp / name).items():
        with pytest.raises(CheckpointError) as refused:
            call()
        assert message.format(tmp=tmp) in str(refused.value), f"{entry}: {refused.value}"
        assert str(tmp / name) in str(refused.value), f"{entry} names the path given"
        assert _snapshot(tmp) == before, f"{entry} changed nothing on disk"


def test_a_step_folder_loads_is_not_saved_into_and_resumes_a_job_that_saves_beside_it(ck):
    step1, step2 = ck / "step_00000001", ck / "step_00000002"
    before = _snapshot(ck.parent)
    entries = _entries(step2)
    assert load_checkpoint(step1, *_model()).step == 1, "an older step folder loads too"
    with pytest.raises(CheckpointError, match=rf"'{step2}' is one checkpoint, not a checkpoint directory: saving "
                                              rf"into it would put checkpoints inside a checkpoint. Save into the "
                                              rf"directory above it \('{ck}'\)"):
        entries["save_checkpoint"]()
    with pytest.raises(CheckpointError, match=rf"'{step2}' is one checkpoint, not a checkpoint directory: .* "
                                              rf"\(pass '{ck}'\)"):
        entries["latest_checkpoint"]()
    assert entries["TrainConfig, resume"]() == (ck, step2), "resumes from it, saves into the directory above"
    with pytest.raises(ValueError, match=rf"checkpoint_dir='{step2}' is a checkpoint \(step 2 of '{ck}'\): pass "
                                         r"--resume to continue from it, or another --checkpoint-dir"):
        entries["TrainConfig, new run"]()
    with pytest.raises(CheckpointError, match=rf"'{step1}' is step 1 of '{ck}', which holds newer checkpoints "
                                              rf"\(step_00000002\): continue from the newest with '{ck}', or to go "
                                              r"back to step 1 move the newer step folders out"):
        check_checkpoint_dir(TrainConfig(checkpoint_dir=str(step1), resume=True))
    assert _snapshot(ck.parent) == before


def _train(capsys, checkpoint_dir: Path, steps: int, *flags: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["train", "--strategy", "none", "--nproc", "1", "--fp8", "none", "--seq-len", "32", "--batch-size",
                 "4", "--steps", str(steps), "--save-every", "1", "--checkpoint-dir", str(checkpoint_dir), *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_train_resumes_from_a_step_folder_saves_beside_it_and_refuses_the_rest_in_one_line(tmp_path, capsys):
    ck = tmp_path / "ck"
    assert _train(capsys, ck, 2)[0] == 0
    step2 = ck / "step_00000002"
    kept = _snapshot(step2)
    code, out, err = _train(capsys, step2, 4, "--resume")
    assert code == 0, err
    assert f"resume: loaded {step2} (step 2, saved on 1 rank)" in out and "(resumed at step 2)" in out
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_00000002", "step_00000003", "step_00000004"]
    assert latest_checkpoint(ck) == ck / "step_00000004" and _snapshot(step2) == kept, "nothing written inside it"
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "file").write_text("x")
    refusals = {step2: f"'{step2}' is step 2 of '{ck}', which holds newer checkpoints (step_00000003, "
                       f"step_00000004): continue from the newest with '{ck}'",
                tmp_path / "hf": "is a Hugging Face model folder (config.json), not an fp8dist checkpoint directory",
                tmp_path / "file": "is a file, and a directory is meant"}
    before = _snapshot(tmp_path)
    for path, message in refusals.items():
        code, out, err = _train(capsys, path, 4, "--resume")
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
        assert "starting" not in out
    assert _snapshot(tmp_path) == before
    # the newest found damaged: moved out, as the damage error says, the one before resumes and `latest` is renewed
    shutil.move(ck / "step_00000004", tmp_path / "damaged")
    code, out, err = _train(capsys, ck / "step_00000003", 4, "--resume")
    assert code == 0 and f"resume: loaded {ck / 'step_00000003'} (step 3" in out, err
    assert latest_checkpoint(ck) == ck / "step_00000004"


def test_ctrl_c_while_an_old_checkpoint_is_pruned_leaves_no_trash_folder(tmp_path, monkeypatch):
    """The interrupt reaches the removal of a pruned checkpoint (keep_last) mid-way: the removal finishes, then the
    interrupt goes on; nothing named ``.trash-*`` is left beside the checkpoints (before: the folder stayed)."""
    from fp8dist.checkpoint import save_load

    old = tmp_path / "step_00000001"
    (old / "model").mkdir(parents=True)
    (old / "model" / "shard.distcp").write_bytes(b"x" * 64)
    real_rmtree, interrupted = shutil.rmtree, []

    def rmtree(path, *args, **kwargs):
        if not interrupted:  # the first removal is cut, as by Ctrl-C
            interrupted.append(path)
            raise KeyboardInterrupt
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(save_load.shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        save_load._discard(old)
    assert interrupted and list(tmp_path.iterdir()) == []
