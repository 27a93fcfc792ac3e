"""What a checkpoint may make a load read, and what it may not switch off:

- every file name a checkpoint gives (meta.json's ``files`` and ``checksums`` maps, DCP's ``.metadata``, the
  ``latest`` pointer, the files fp8dist reads by their own names) must be a file inside its folder: an absolute
  path, ``..`` or a symbolic link leading out is refused naming the entry and the folder, before that file is read
  (its size, checksum or contents would leak otherwise);
- a meta.json without checksums, with fewer than it lists files, or a folder holding a file meta.json does not list,
  is refused unless the caller passes ``verify=False`` (so a flipped byte cannot load by deleting the record); a
  LoRA (trainable-only) checkpoint alike, naming the damaged adapter file.

One process, strategy "none" (DCP as a single process), each load on a fresh model that the refusal leaves as it
was."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from fp8dist import CheckpointError, load_checkpoint, save_checkpoint, wrap_model
from fp8dist.checkpoint.manifest import file_checksum

STEP = "step_00000001"


def _model_and_optimizer():
    torch.manual_seed(0)
    model = wrap_model(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)), strategy="none")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.fixture
def saved(tmp_path) -> Path:
    """A one-step checkpoint in ``tmp_path/ckpt``, and a stranger's file beside it (``tmp_path/secret``)."""
    torch.set_num_threads(1)
    model, opt = _model_and_optimizer()
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path / "ckpt", model, opt, step=1)
    (tmp_path / "secret").write_bytes(b"not yours to read\n")
    return tmp_path / "ckpt"


def _edit_meta(step: Path, edit) -> None:
    meta = json.loads((step / "meta.json").read_text())
    edit(meta)
    (step / "meta.json").write_text(json.dumps(meta))


def _refused(path: Path, **kwargs) -> str:
    """The refusal of loading ``path`` into a fresh model, which it leaves untouched."""
    model, opt = _model_and_optimizer()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(path, model, opt, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before)), "nothing was loaded"
    return str(refused.value)


def _flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def _flip_weight_byte(step: Path, tmp: Path) -> str:
    """Flip a byte inside a saved weight's data, where torch's reader cannot see it (a byte in a zip header would
    fail the load anyway); the weight's name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step), str(tmp / "whole.pt"))
    name, weight = next((n, t) for n, t in torch.load(tmp / "whole.pt", weights_only=True)["model"].items())
    shard = step / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    at = data.find(weight.numpy().tobytes())
    assert at >= 0, "the weight's bytes are stored as they are"
    data[at + 1] ^= 0x01  # the low mantissa bits of its first element
    shard.write_bytes(bytes(data))
    return name


# ---- item 1: names that lead outside the checkpoint

def _point_outside(secret: Path, name: str):
    """meta.json edited as the issue did: a map entry naming ``name``, with the stranger file's true size and
    crc32 (today: read in full and loaded past, its size and checksum shown when they differ)."""
    def edit(meta):
        meta["files"][name] = secret.stat().st_size
        meta["checksums"][name] = file_checksum(secret)
    return edit


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_a_meta_json_naming_a_file_outside_the_checkpoint_is_refused_naming_the_entry(saved, how):
    step, secret = saved / STEP, saved.parent / "secret"
    name = "../../secret" if how == "dotdot" else str(secret)
    _edit_meta(step, _point_outside(secret, name))
    why = "climbs out of the folder ('..')" if how == "dotdot" else "is an absolute path"
    for verify in (True, False):  # the names are checked whether or not the files are
        assert _refused(saved, verify=verify) == (
            f"{step}: meta.json's 'files' entry {name!r} {why}. A checkpoint names only files inside its own folder, "
            "so none was read. It was edited by hand or not written by fp8dist: load another checkpoint.")


def test_a_checksums_entry_outside_is_refused_too(saved):
    step = saved / STEP
    _edit_meta(step, lambda meta: meta["checksums"].update({"../../secret": "00000000"}))
    assert f"{step}: meta.json's 'checksums' entry '../../secret' climbs out of the folder" in _refused(saved)


def test_a_file_replaced_by_a_symbolic_link_leading_out_is_refused_though_its_bytes_are_the_saved_ones(saved):
    """rng_rank0.pt moved out and linked back: size and crc32 match, so today it loads from outside."""
    step, outside = saved / STEP, saved.parent / "rng_rank0.pt"
    shutil.move(step / "rng_rank0.pt", outside)
    (step / "rng_rank0.pt").symlink_to(outside)
    assert _refused(saved).startswith(
        f"{step}: meta.json's 'files' entry 'rng_rank0.pt' leads out of the folder through a symbolic link. ")
    inner = step / "moved.pt"  # a link that stays inside loads (with verify=False: meta.json does not list it)
    shutil.move(outside, inner)
    (step / "rng_rank0.pt").unlink()
    (step / "rng_rank0.pt").symlink_to(inner.name)
    model, opt = _model_and_optimizer()
    assert load_checkpoint(saved, model, opt, verify=False).step == 1


def test_a_latest_naming_a_folder_outside_the_checkpoint_directory_is_refused(saved):
    other = saved.parent / "other"
    shutil.copytree(saved, other)
    (saved / "latest").write_text(f"../other/{STEP}\n")
    assert _refused(saved).startswith(f"{saved}: the 'latest' entry '../other/{STEP}' climbs out of the folder "
                                      "('..'). ")


def test_a_dcp_metadata_naming_a_shard_outside_is_refused_before_dcp_reads_it(saved):
    """.metadata rewritten to read its shard from outside, meta.json's record of it updated to match."""
    step, outside = saved / STEP, saved.parent / "__0_0.distcp"
    shutil.copy(step / "__0_0.distcp", outside)
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(step)).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "../../__0_0.distcp"
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    _edit_meta(step, lambda meta: (meta["files"].update({".metadata": (step / ".metadata").stat().st_size}),
                                   meta["checksums"].update({".metadata": file_checksum(step / ".metadata")})))
    assert (f"{step}: the .metadata entry '../../__0_0.distcp' climbs out of the folder ('..'). A checkpoint names "
            "only files inside its own folder") in _refused(saved)


# ---- item 2: integrity cannot be switched off by editing the checkpoint

def _unchecked_message(step: Path, what: str) -> str:
    return (f"{step / 'meta.json'} {what}: the checkpoint cannot be checked for damage, and fp8dist loads none "
            "unchecked unless told. It was saved by an fp8dist that recorded none, or edited by hand. Load another "
            "checkpoint (its step_* folders), or load_checkpoint(..., verify=False) to load it unchecked knowingly.")


@pytest.mark.parametrize("edit, what", [
    (lambda meta: meta.pop("checksums"), "records no checksums"),
    (lambda meta: meta.update(checksums={}), "records no checksums"),
    (lambda meta: meta["checksums"].pop("__0_0.distcp"), "records no checksum for '__0_0.distcp'"),
    (lambda meta: (meta["files"].pop("__0_0.distcp"), meta["checksums"].pop("__0_0.distcp")),
     "does not list '__0_0.distcp', which the folder holds"),
], ids=["deleted", "empty", "partial", "unlisted"])
def test_a_flipped_byte_does_not_load_by_editing_the_checksums_away_unless_verify_false(saved, edit, what):
    step = saved / STEP
    model, opt = _model_and_optimizer()
    load_checkpoint(saved, model, opt)
    intact = dict(model.state_dict())
    name = _flip_weight_byte(step, saved.parent)
    _edit_meta(step, edit)
    assert _refused(saved) == _unchecked_message(step, what)
    model, opt = _model_and_optimizer()
    assert load_checkpoint(saved, model, opt, verify=False).step == 1  # told: loaded as it is, the flip with it
    assert [n for n, t in model.state_dict().items() if not torch.equal(t, intact[n])] == [name]


def test_a_file_added_to_the_checkpoint_is_refused_unless_verify_false(saved):
    (saved / STEP / "added.pt").write_bytes(b"x")
    assert _refused(saved) == _unchecked_message(saved / STEP, "does not list 'added.pt', which the folder holds")


def _lora_saved(root: Path):
    """A PEFT LoRA model's trainable-only checkpoint (the adapters and their optimizer state)."""
    peft = pytest.importorskip("peft")
    from fp8dist.train.models import build_llama

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = peft.get_peft_model(build_llama("tiny", seed=0), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    model = wrap_model(model, strategy="none")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return model, opt, save_checkpoint(root, model, opt, step=1, trainable_only=True)


def test_a_lora_checkpoints_adapter_file_truncated_or_flipped_is_named_and_checksums_cannot_be_deleted(tmp_path):
    model, opt, step = _lora_saved(tmp_path)
    adapters = step / "__0_0.distcp"
    good = adapters.read_bytes()
    adapters.write_bytes(good[:-10])
    with pytest.raises(CheckpointError, match=f"{adapters} is {len(good) - 10} bytes, expected {len(good)} bytes"):
        load_checkpoint(tmp_path, model, opt)
    adapters.write_bytes(good)
    _flip_byte(adapters)
    with pytest.raises(CheckpointError, match=f"{adapters} is damaged: its crc32 is "):
        load_checkpoint(tmp_path, model, opt)
    _edit_meta(step, lambda meta: meta.pop("checksums"))
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(tmp_path, model, opt)
    assert str(refused.value) == _unchecked_message(step, "records no checksums")


def test_deepspeeds_engine_files_are_checked_by_the_same_rule_before_they_are_unpickled(saved):
    """A DeepSpeed checkpoint's engine file that meta.json does not list (loaded with verify=False) but that leads
    outside: refused before DeepSpeed's own loader or the pickle scan opens it (no engine needed to get there)."""
    from fp8dist.checkpoint.io import _read_own
    from fp8dist.strategies.deepspeed_checkpoint import ZeROCheckpoint

    own, step = ZeROCheckpoint(), saved / STEP
    (step / own.tag).mkdir()
    (step / own.tag / "mp_rank_00_model_states.pt").symlink_to(saved.parent / "secret")
    with pytest.raises(CheckpointError) as refused:
        _read_own(step, None, None, own)
    assert str(refused.value).startswith(f"{step}: the engine's file '{own.tag}/mp_rank_00_model_states.pt' leads "
                                         "out of the folder through a symbolic link. ")
