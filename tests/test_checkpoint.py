"""Checkpoints: what a user relies on when a run is killed and started again."""
from __future__ import annotations

import argparse
import logging
import pickle
import random
import zipfile

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from helpers.checkpoints import torch_loads
from trainer.checkpoint import (ONE_FILE, TEMP_PREFIX, UnreadableCheckpoint, check_compatible, check_same_epochs,
                                checkpoint_exists, format_of, latest_checkpoint, list_checkpoints, load_checkpoint,
                                load_model_state, load_optimizer_state, rng_state, set_rng_state)
from trainer.checkpoint.retention import add_checkpoint
from trainer.run.errors import ConfigError
from trainer.step.optim import build_optimizer
from trainer.step.optim import optimizer_spec

pytestmark = pytest.mark.fast

OPTIMIZERS = {
    "sgd": {"_target_": "torch.optim.SGD", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
    "adamw": {"_target_": "torch.optim.AdamW", "lr": 0.05, "betas": [0.9, 0.999], "weight_decay": 0.01},
}


def _optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    spec = optimizer_spec(OmegaConf.create({"_partial_": True, **OPTIMIZERS[name]}))
    return build_optimizer(spec, model.parameters(), torch.device("cpu"), captured=False)


def _train(model, optimizer, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        x = torch.randn(8, 4)
        loss = torch.nn.functional.dropout(model(x), p=0.2).pow(2).mean()
        loss.backward()
        optimizer.step()


def _state(step: int, recipe: str = "mnist"):
    return {"step": step, "epoch": 0, "position_in_epoch": step, "rng": rng_state(), "wandb_run_id": "abc123",
            "config": {"recipe": {"name": recipe}, "train": {"max_steps": None, "betas": [0.9, 0.999]}},
            "recipe": recipe}


class _OneProcess:
    """What ``CheckpointFormat.stage`` asks of the ranks, for one process (TrainingState in a run)."""
    is_main = True

    def on_every_rank(self, check):
        check()

    def storage_advice(self, said):
        return said


_TINY_MODEL = torch.nn.Linear(2, 1)  # made once: a model made per save would draw from the RNG a test seeded
_TINY_OPTIMIZER = torch.optim.SGD(_TINY_MODEL.parameters(), lr=0.1)


def _save_checkpoint(run_dir, step, extra, keep, model=_TINY_MODEL, optimizer=_TINY_OPTIMIZER):
    """``extra`` with a model's and optimizer's state as the one-file checkpoint of ``step``, written through the
    format's protocol as TrainingState.save writes it; the newest ``keep`` kept."""
    staged = ONE_FILE.stage(_OneProcess(), run_dir, step, model, optimizer)
    return add_checkpoint(run_dir, keep, lambda: ONE_FILE.write(run_dir, step, staged, extra))


def _files(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_save_is_atomic_and_leaves_no_temp_files(tmp_path):
    path = _save_checkpoint(tmp_path, 7, {"step": 7, "recipe": "mnist"}, keep=2)
    assert path == tmp_path / "checkpoints" / "step_00000007.pt"
    assert _files(tmp_path) == ["step_00000007.pt"]


def test_failed_save_leaves_no_file_behind(tmp_path):
    with pytest.raises((pickle.PicklingError, AttributeError), match="pickle"):
        _save_checkpoint(tmp_path, 3, {"step": 3, "bad": lambda: None}, keep=2)  # a lambda cannot be pickled
    assert _files(tmp_path) == []


def test_a_stale_temp_file_from_a_killed_save_is_removed(tmp_path):
    _save_checkpoint(tmp_path, 1, {"step": 1}, keep=2)
    (tmp_path / "checkpoints" / f"{TEMP_PREFIX}00000002_x.pt").write_bytes(b"half a checkpoint")
    _save_checkpoint(tmp_path, 2, {"step": 2}, keep=2)
    assert _files(tmp_path) == ["step_00000001.pt", "step_00000002.pt"]


def test_only_the_newest_keep_checkpoints_remain(tmp_path):
    for step in (5, 10, 15, 20):
        _save_checkpoint(tmp_path, step, {"step": step}, keep=2)
    assert _files(tmp_path) == ["step_00000015.pt", "step_00000020.pt"]
    _save_checkpoint(tmp_path, 25, {"step": 25}, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000025.pt"]


def test_keep_below_one_names_the_setting(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint\.keep=0"):
        _save_checkpoint(tmp_path, 1, {"step": 1}, keep=0)


def test_a_checkpoint_named_by_path_is_any_file_or_a_sharded_directory(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")  # read as one file whatever its name; whether it loads comes later
    (tmp_path / "step_00000001.dcp").mkdir()
    (tmp_path / "folder").mkdir()
    assert checkpoint_exists(tmp_path / "weights.bin") and checkpoint_exists(str(tmp_path / "step_00000001.dcp"))
    assert not checkpoint_exists(tmp_path / "folder") and not checkpoint_exists(tmp_path / "missing.pt")


def test_no_checkpoint_means_none(tmp_path):
    assert latest_checkpoint(tmp_path) is None


def test_latest_is_by_step_not_by_name_length(tmp_path):
    _save_checkpoint(tmp_path, 99_999_999, {"step": 99_999_999}, keep=3)
    _save_checkpoint(tmp_path, 100_000_000, {"step": 100_000_000}, keep=3)  # nine digits
    path, state = latest_checkpoint(tmp_path)
    assert state["step"] == 100_000_000 and path.name == "step_100000000.pt"


def test_truncated_newest_checkpoint_is_skipped_with_a_warning(tmp_path, caplog):
    _save_checkpoint(tmp_path, 10, {"step": 10, "w": torch.arange(1000.0)}, keep=3)
    newest = _save_checkpoint(tmp_path, 20, {"step": 20, "w": torch.arange(1000.0)}, keep=3)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        path, state = latest_checkpoint(tmp_path)
    assert "skipping unreadable checkpoint" in caplog.text and "step_00000020.pt" in caplog.text
    assert path.name == "step_00000010.pt" and state["step"] == 10


def test_all_checkpoints_corrupt_means_none(tmp_path, caplog):
    _save_checkpoint(tmp_path, 1, {"step": 1}, keep=2).write_bytes(b"not a checkpoint")
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        assert latest_checkpoint(tmp_path) is None
    assert "step_00000001.pt" in caplog.text


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _save(run_dir, step, keep):
    return _save_checkpoint(run_dir, step, {"step": step, "w": torch.full((256,), float(step))}, keep=keep)



def test_a_truncated_newest_checkpoint_never_displaces_the_good_one_before_it(tmp_path, caplog):
    for step in (10, 20, 30):
        _save(tmp_path, step, keep=2)
    _truncate(tmp_path / "checkpoints" / "step_00000030.pt")
    assert latest_checkpoint(tmp_path)[1]["step"] == 20  # a resume continues from 20 ...
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        _save(tmp_path, 25, keep=2)  # ... and saves 25, before the damaged file's step
    # 20 and 25 are the newest two readable ones; the truncated 30 is gone, so it never outranks 25.
    assert _files(tmp_path) == ["step_00000020.pt", "step_00000025.pt"]
    assert "removing unreadable checkpoint" in caplog.text and "step_00000030.pt" in caplog.text
    path, state = latest_checkpoint(tmp_path)
    assert path.name == "step_00000025.pt" and state["step"] == 25
    _save(tmp_path, 30, keep=2)
    assert _files(tmp_path) == ["step_00000025.pt", "step_00000030.pt"]
    assert latest_checkpoint(tmp_path)[1]["step"] == 30


def test_keep_one_with_a_truncated_newer_file_keeps_the_new_save(tmp_path):
    _save(tmp_path, 20, keep=1)
    _truncate(_save(tmp_path, 30, keep=2))
    _save(tmp_path, 25, keep=1)
    assert _files(tmp_path) == ["step_00000025.pt"]


def test_when_every_checkpoint_is_corrupt_a_new_save_is_the_only_one_left(tmp_path):
    _save(tmp_path, 10, keep=5).write_bytes(b"not a checkpoint")
    _truncate(_save(tmp_path, 20, keep=5))
    (tmp_path / "checkpoints" / "step_00000030.pt").write_bytes(b"")  # created, never written
    assert latest_checkpoint(tmp_path) is None
    _save(tmp_path, 5, keep=2)  # a fresh start (resume found nothing) saves below the corrupt steps
    assert _files(tmp_path) == ["step_00000005.pt"]
    assert latest_checkpoint(tmp_path)[1]["step"] == 5


def test_mixed_good_and_corrupt_only_good_ones_count_toward_keep(tmp_path):
    for step in (10, 20, 30, 40, 50):
        _save(tmp_path, step, keep=10)
    folder = tmp_path / "checkpoints"
    _truncate(folder / "step_00000020.pt")
    with zipfile.ZipFile(folder / "step_00000040.pt", "w") as z:  # a complete zip, but not a torch file
        z.writestr("notes.txt", "hello")
    _truncate(folder / "step_00000050.pt")
    _save(tmp_path, 45, keep=2)
    assert _files(tmp_path) == ["step_00000030.pt", "step_00000045.pt"]
    _save(tmp_path, 46, keep=3)
    assert _files(tmp_path) == ["step_00000030.pt", "step_00000045.pt", "step_00000046.pt"]


def test_the_file_just_written_stays_even_behind_newer_good_ones(tmp_path):
    # A run resumed explicitly from an older checkpoint: its own save is never pruned at once.
    for step in (20, 30):
        _save(tmp_path, step, keep=2)
    _save(tmp_path, 25, keep=1)
    assert _files(tmp_path) == ["step_00000025.pt", "step_00000030.pt"]


def test_retention_under_random_crashes_keeps_the_newest_readable_checkpoints(tmp_path):
    """Saves, truncations and resumes at random: after every save, what remains is the newest
    ``keep`` readable checkpoints (the new one among them), and no unreadable file."""
    rng = random.Random(0)
    keep, step = 2, 0
    for _ in range(60):
        if rng.random() < 0.3 and list_checkpoints(tmp_path):  # a crash damages some files; the run resumes
            for path in list_checkpoints(tmp_path):
                if rng.random() < 0.4:
                    _truncate(path) if rng.random() < 0.7 else path.write_bytes(b"x" * rng.randrange(0, 64))
            found = latest_checkpoint(tmp_path)
            step = found[1]["step"] if found else 0
            continue
        step += rng.choice([1, 3, 5])
        before = {int(p.stem.split("_")[1]): torch_loads(p) for p in list_checkpoints(tmp_path)}
        readable = sorted({s for s, ok in before.items() if ok and s != step} | {step})
        _save(tmp_path, step, keep)
        after = {int(p.stem.split("_")[1]): torch_loads(p) for p in list_checkpoints(tmp_path)}
        assert all(after.values()), (before, after)
        assert sorted(after) == readable[-keep:], (step, before, after)
        assert latest_checkpoint(tmp_path)[1]["step"] == step


def test_an_unreadable_file_gets_a_one_line_cause_without_torchs_advice(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    foreign = tmp_path / "foreign.pt"
    torch.save({"step": 1, "args": argparse.Namespace(lr=0.1)}, foreign)  # not loadable with weights_only=True
    truncated = _save(tmp_path, 1, keep=1)
    _truncate(truncated)
    causes = {}
    for path in (junk, foreign, truncated):
        with pytest.raises(UnreadableCheckpoint) as err:
            load_checkpoint(path)
        cause = causes[path] = err.value.cause
        assert "\n" not in cause and "weights_only" not in cause and str(path) not in cause, cause
        assert err.value.path == path
    assert causes[junk].startswith("UnpicklingError: ")
    assert causes[foreign].startswith("UnpicklingError: ") and "argparse.Namespace" in causes[foreign]
    assert causes[truncated].startswith("RuntimeError: ") and "zip archive" in causes[truncated]
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(UnreadableCheckpoint, match="no training state"):
        load_checkpoint(tmp_path / "list.pt")


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
def test_full_state_loads_with_weights_only(tmp_path, optimizer_name):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = _optimizer(optimizer_name, model)
    _train(model, optimizer, 3)
    _save_checkpoint(tmp_path, 3, _state(3), keep=2, model=model, optimizer=optimizer)

    path = tmp_path / "checkpoints" / "step_00000003.pt"
    loaded = torch.load(path, weights_only=True)  # what latest_checkpoint does; spelled out here
    _, state = latest_checkpoint(tmp_path)
    for got in (loaded, state):
        assert got["recipe"] == "mnist" and got["wandb_run_id"] == "abc123" and got["step"] == 3
        assert set(got["rng"]) >= {"torch", "python", "numpy"}
        for key, value in model.state_dict().items():
            assert torch.equal(got["model"][key], value)
        saved_opt = got["optimizer"]["state"]
        buffers = ("momentum_buffer",) if optimizer_name == "sgd" else ("exp_avg", "exp_avg_sq", "step")
        for param_state in saved_opt.values():
            assert all(isinstance(param_state[b], torch.Tensor) for b in buffers)


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
def test_resuming_continues_exactly_as_if_never_stopped(tmp_path, optimizer_name):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = _optimizer(optimizer_name, model)
    _train(model, optimizer, 3)
    _save_checkpoint(tmp_path, 3, _state(3), keep=2, model=model, optimizer=optimizer)
    _train(model, optimizer, 3)
    uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(123)  # a fresh process: different RNG, different initial weights
    resumed = torch.nn.Linear(4, 3)
    resumed_opt = _optimizer(optimizer_name, resumed)
    live_lr = resumed_opt.param_groups[0]["lr"]
    path, state = latest_checkpoint(tmp_path)
    read_in = format_of(path)  # as TrainingState.restore reads it: through the format, in place
    read_in.load_model(resumed, state["model"], live=ONE_FILE)
    load_optimizer_state(resumed_opt, state["optimizer"], model=resumed, read_in=read_in, live=ONE_FILE)
    set_rng_state(state["rng"])
    assert resumed_opt.param_groups[0]["lr"] is live_lr  # a captured graph still sees the same lr tensor
    _train(resumed, resumed_opt, 3)
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, uninterrupted[key]), key


def test_set_rng_state_replays_the_same_numbers():
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    saved = rng_state()
    expected = (torch.rand(5), random.random(), np.random.normal(size=3))
    torch.rand(100), random.random(), np.random.normal(size=7)
    set_rng_state(saved)
    got = (torch.rand(5), random.random(), np.random.normal(size=3))
    assert torch.equal(got[0], expected[0])
    assert got[1] == expected[1]
    assert np.array_equal(got[2], expected[2])


def test_rng_state_survives_a_weights_only_round_trip(tmp_path):
    torch.manual_seed(5)
    _save_checkpoint(tmp_path, 1, {"step": 1, "rng": rng_state()}, keep=1)
    expected = torch.rand(4)
    _, state = latest_checkpoint(tmp_path)
    set_rng_state(state["rng"])
    assert torch.equal(torch.rand(4), expected)


def test_checkpoint_of_another_recipe_names_the_settings(tmp_path):
    state = {"step": 5, "recipe": "gpt_tiny"}
    with pytest.raises(ConfigError) as err:
        check_compatible(state, "mnist", resume="auto", path=tmp_path / "step_00000005.pt")
    message = str(err.value)
    assert "recipe 'gpt_tiny'" in message and "recipe=mnist" in message
    assert "checkpoint.resume=never" in message and "recipe=gpt_tiny" in message
    check_compatible(state, "gpt_tiny")  # the same recipe resumes


# ---- storage that cannot take a write (trainer/run/storage.py) ---------------------------------

def test_a_save_without_room_is_refused_before_writing_and_names_the_sizes(tmp_path, monkeypatch):
    import trainer.run.storage as storage
    from trainer.run.errors import StorageError

    _save(tmp_path, 10, keep=2)
    monkeypatch.setattr(storage, "free_bytes", lambda path: 1000)
    with pytest.raises(StorageError) as err:
        _save(tmp_path, 20, keep=2)
    message = str(err.value)
    assert str(tmp_path / "checkpoints" / "step_00000020.pt") in message and "not enough free space" in message
    assert "1000 bytes free" in message and err.value.needed > 1000 and "needs about" in message
    assert _files(tmp_path) == ["step_00000010.pt"]


def test_a_write_that_fails_without_an_errno_leaves_no_temp_file_and_keeps_the_last_good_one(tmp_path, monkeypatch):
    from trainer.run.errors import StorageError

    _save(tmp_path, 10, keep=2)
    real_save = torch.save

    def fails_midway(obj, f):
        real_save(obj, f)  # bytes on disk, then torch's C++ writer gives up without an errno
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(torch, "save", fails_midway)
    with pytest.raises(StorageError, match=r"step_00000020.pt: RuntimeError: \[enforce fail.*free there"):
        _save(tmp_path, 20, keep=2)
    assert _files(tmp_path) == ["step_00000010.pt"] and torch_loads(tmp_path / "checkpoints" / "step_00000010.pt")


def test_results_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    import errno
    import os

    from trainer.run.errors import StorageError
    from trainer.metrics.results import write_json

    write_json(tmp_path / "results.json", {"steps": 1})

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(StorageError, match=r"results.json: ENOSPC \(No space left on device\); it needs about"):
        write_json(tmp_path / "results.json", {"steps": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    assert (tmp_path / "results.json").read_text().strip() == '{\n  "steps": 1\n}'


def test_metrics_rows_a_full_disk_refuses_wait_in_memory_and_never_leave_half_a_row(tmp_path, monkeypatch, capsys):
    import errno
    import json
    import os

    from trainer.run.errors import StorageError
    from trainer.metrics.logger import JsonLines

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "trunc')  # a crash while writing row 2
    rows = JsonLines(path)
    assert "ends in an incomplete row" in capsys.readouterr().err
    rows.append({"step": 3})
    real_write = os.write

    def half_then_full(fd, data):
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    rows.append({"step": 4})
    rows.append({"step": 5})
    assert capsys.readouterr().err.count("kept in memory") == 1
    with pytest.raises(StorageError, match="metrics rows to"):
        rows.write_pending()  # what the next checkpoint does first
    assert path.read_text().endswith('"step": 3}\n')  # cut back to the last whole row
    monkeypatch.setattr(os, "write", real_write)  # space again
    rows.write_pending()
    rows.close()
    lines = path.read_text().splitlines()
    assert lines[1] == '{"step": 2, "trunc'  # the damaged row stays, alone on its line
    assert [json.loads(line)["step"] for line in lines[:1] + lines[2:]] == [1, 3, 4, 5]


def _with_drop_last(drop_last):
    return {"recipe": {"data": {} if drop_last is None else {"drop_last": drop_last}}}


@pytest.mark.parametrize("saved_drop,saved_steps,drop,steps,refused", [
    (None, None, False, 16, True),  # written before the tail was kept (it was dropped): 15 steps per epoch then
    (None, None, True, 15, False),  # the same, resumed dropping it: the same epochs
    (True, 15, False, 16, True),
    (False, 16, True, 15, True),
    (False, 16, False, 16, False),
    (True, 16, False, 16, False),  # no tail either way (the samples fill whole steps): the same epochs
])
def test_a_checkpoint_counting_epochs_of_another_length_is_refused_naming_drop_last(
        saved_drop, saved_steps, drop, steps, refused):
    state = {"step": 20, "config": _with_drop_last(saved_drop)}
    if saved_steps is not None:
        state["steps_per_epoch"] = saved_steps
    if not refused:
        check_same_epochs(state, _with_drop_last(drop), steps)
        return
    with pytest.raises(ConfigError) as err:
        check_same_epochs(state, _with_drop_last(drop), steps, resume="auto")
    want = "true" if saved_drop is None else str(saved_drop).lower()
    assert f"Set recipe.data.drop_last={want} to resume it" in str(err.value) and "step 20" in str(err.value)


def test_a_checkpoint_of_another_model_is_refused_naming_the_model_settings_that_differ():
    from recipes.gpt import GPT, GPTConfig

    tiny = dict(n_layer=1, n_head=2, d_model=16, context=8, vocab=32)
    saved = GPT(GPTConfig(**tiny))  # written before recipe.model.layer_norm_bias existed: biases
    state = {"model": saved.state_dict(), "config": {"recipe": {"model": dict(tiny)}}}
    here = GPT(GPTConfig(**tiny, layer_norm_bias=False))
    with pytest.raises(ConfigError) as err:
        load_model_state(here, state, {"recipe": {"model": {**tiny, "layer_norm_bias": False}}}, read_in=ONE_FILE,
                         live=ONE_FILE, resume="auto")
    assert "recipe.model.layer_norm_bias=unset (the default) there, false here" in str(err.value)
    assert "checkpoint.resume=never" in str(err.value)
    same = GPT(GPTConfig(**tiny))  # the same model loads, every tensor equal
    load_model_state(same, state, {"recipe": {"model": dict(tiny)}}, read_in=ONE_FILE, live=ONE_FILE)
    assert all(torch.equal(a, b) for a, b in zip(same.state_dict().values(), saved.state_dict().values()))
