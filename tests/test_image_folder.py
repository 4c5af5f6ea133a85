"""Images from a folder: export a recipe's data as PNG files, or make a folder of photos of every
size, train on either, and get one clear message for each way a folder can be wrong.

    python scripts/export_images.py recipe=mnist --output DIR [--limit N]
    python train.py recipe=mnist recipe.data.source=folder recipe.data.root=DIR
    python scripts/make_image_folder.py --output DIR --classes 4 --per-class 20
    python train.py recipe=cifar10_resnet18 recipe.data.source=folder recipe.data.root=DIR recipe.data.loader=host
"""
from __future__ import annotations

import io
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from conf.schema import compose
from recipes.mnist import synthetic_mnist
from trainer.run.errors import ConfigError
from trainer.run.runtime import Runtime

from helpers.paths import ROOT
from helpers.processes import MARK, SESSION, marked_pids, stacks

# The exported folder: the first 128 of 300 synthetic training images and all 100 test images.
SOURCE = ["recipe=mnist", "recipe.data.source=synthetic", "recipe.data.train_size=300", "recipe.data.test_size=100"]
TRAIN_FILES, TEST_FILES = 128, 100
RUN = ["logger=none", "recipe.data.batch_size=16", "recipe.data.eval_batch_size=32", "train.max_steps=4",
       "train.log_every=2"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A folder written by scripts/export_images.py (in this process: its main function)."""
    from scripts.export_images import main

    folder = tmp_path_factory.mktemp("export") / "mnist_png"
    assert main([*SOURCE, "--output", str(folder), "--limit", str(TRAIN_FILES)]) == 0
    return folder


def build_mnist(*overrides: str):
    from recipes.mnist import build

    return build(compose(["recipe=mnist", *overrides]), Runtime(0, 0, 1, torch.device("cpu"), False, Path(".")))


def encoded(image: torch.Tensor, **options) -> bytes:
    """``image`` (uint8 [C, H, W]) encoded by Pillow (torchvision's own encoders are deprecated)."""
    from PIL import Image

    out = io.BytesIO()
    array = image.numpy()
    Image.fromarray(array[0] if array.shape[0] == 1 else array.transpose(1, 2, 0)).save(out, **options)
    return out.getvalue()


def png(image: torch.Tensor) -> bytes:
    return encoded(image, format="PNG")


def jpeg(image: torch.Tensor) -> bytes:
    return encoded(image, format="JPEG", quality=95)


def decode(path: Path) -> torch.Tensor:
    """The file's pixels as they are stored: [1, H, W] for a gray image, [3, H, W] for a color one."""
    from PIL import Image

    with Image.open(path) as image:
        pixels = torch.from_numpy(np.array(image))
    return pixels.unsqueeze(0) if pixels.dim() == 2 else pixels.permute(2, 0, 1)


def write_folder(root: Path, layout: dict) -> Path:
    """``layout``: {"train": {"cat": [bytes of each image file, or (name, bytes)]}, "test": {...}}."""
    for split, classes in layout.items():
        for name, files in classes.items():
            (root / split / name).mkdir(parents=True)
            for i, data in enumerate(files):
                file, data = data if isinstance(data, tuple) else (f"{i}.png", data)
                (root / split / name / file).write_bytes(data)
    return root


def gray(seed: int, size: int = 28) -> torch.Tensor:
    return torch.randint(0, 256, (1, size, size), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


# ---- exporting ------------------------------------------------------------------------

@pytest.mark.fast
def test_export_writes_each_image_as_a_png_in_its_class_folder(exported):
    train, test = synthetic_mnist(0, 300, 100)
    assert sorted(p.name for p in exported.iterdir()) == ["test", "train"]
    for split, source, count in (("train", train, TRAIN_FILES), ("test", test, TEST_FILES)):
        files = sorted((exported / split).glob("*/*.png"))
        assert len(files) == count  # --limit 128 of 300; all 100 of the test set
        assert {p.parent.name for p in files} == {str(c) for c in source.y[:count].tolist()}
        for path in files:  # <class>/<index>.png: the label, the position, the very pixels
            index = int(path.stem)
            assert path.stem == f"{index:0{len(str(count - 1))}d}" and path.parent.name == str(int(source.y[index]))
            assert torch.equal(decode(path), source.x[index])


@pytest.mark.fast
def test_export_refuses_a_folder_that_already_holds_files(exported):
    from scripts.export_images import export

    with pytest.raises(ConfigError, match=f"--output {exported} exists and is not an empty folder"):
        export(compose(SOURCE), exported)


def test_export_script_writes_rgb_images_of_the_cifar_recipe(tmp_path, capsys):
    from scripts.export_images import main

    folder = tmp_path / "cifar_png"
    code = main(["recipe=cifar10_resnet18", "recipe.data.source=synthetic", "recipe.data.train_size=40",
                 "recipe.data.test_size=12", "--output", str(folder)])
    done = capsys.readouterr()
    assert code == 0, done.err[-3000:]
    assert f"wrote 40 train and 12 test images (3x32x32 PNG, 10 classes, synthetic data of recipe " \
           f"cifar10_resnet18) to {folder}" in done.out
    from recipes.cifar10 import synthetic_cifar10

    train, _ = synthetic_cifar10(0, 40, 12)
    assert torch.equal(decode(folder / "train" / str(int(train.y[7])) / "07.png"), train.x[7])


# ---- reading ---------------------------------------------------------------------------

@pytest.mark.fast
def test_the_folder_dataset_decodes_every_image_with_its_class_label(exported):
    train, test = synthetic_mnist(0, 300, 100)
    data = build_mnist("recipe.data.source=folder", f"recipe.data.root={exported}").data
    assert data.source == "folder"
    assert (len(data.train), len(data.test)) == (TRAIN_FILES, TEST_FILES)
    assert data.train.classes == sorted(p.name for p in (exported / "train").iterdir())
    for dataset, source in ((data.train, train), (data.test, test)):
        for i in range(len(dataset)):
            x, y = dataset[i]
            index = int(Path(dataset.path(i)).stem)
            assert x.dtype == torch.uint8 and x.shape == (1, 28, 28) and isinstance(y, int)
            assert torch.equal(x, source.x[index]) and dataset.classes[y] == str(int(source.y[index]))
    # The device loader's fast path: every image at once, as two tensors.
    split = data.test.to_split()
    assert torch.equal(split.x, torch.stack([data.test[i][0] for i in range(TEST_FILES)]))
    assert split.y.dtype == torch.int64 and split.y.tolist() == [data.test[i][1] for i in range(TEST_FILES)]
    # DataLoader workers receive the dataset pickled (spawn) or forked.
    again = pickle.loads(pickle.dumps(data.train))
    assert torch.equal(again[5][0], data.train[5][0]) and again[5][1] == data.train[5][1]


@pytest.mark.fast
def test_train_size_picks_a_seeded_random_subset_not_the_first_files(exported):
    def subset(seed):
        data = build_mnist("recipe.data.source=folder", f"recipe.data.root={exported}", f"seed={seed}",
                           "recipe.data.train_size=40", "recipe.data.test_size=20").data
        return [data.train.path(i) for i in range(len(data.train))], data

    paths, data = subset(0)
    assert len(paths) == 40 and len(data.test) == 20
    assert subset(0)[0] == paths and subset(1)[0] != paths
    everything = build_mnist("recipe.data.source=folder", f"recipe.data.root={exported}").data.train
    first = {everything.classes[everything[i][1]] for i in range(40)}  # the sorted files begin with class 0
    picked = {data.train.classes[data.train[i][1]] for i in range(40)}
    assert len(picked) >= 8 > len(first)
    with pytest.raises(ConfigError, match=rf"recipe\.data\.train_size=1000 but {exported / 'train'} has 128 images"):
        build_mnist("recipe.data.source=folder", f"recipe.data.root={exported}", "recipe.data.train_size=1000")


@pytest.mark.fast
def test_a_color_recipe_reads_gray_pngs_and_jpegs_and_a_gray_recipe_reads_color(tmp_path):
    from recipes.image_folder import folder_datasets

    smooth = torch.linspace(0, 255, 32).round().to(torch.uint8).expand(3, 32, 32).contiguous()  # survives JPEG
    root = write_folder(tmp_path / "mixed", {
        "train": {"a": [png(gray(1, 32)), ("b.jpg", jpeg(smooth))], "b": [("c.JPEG", jpeg(smooth))]},
        "test": {"b": [png(gray(2, 32))]},
    })
    color = folder_datasets(str(root), recipe="cifar10_resnet18", shape=(3, 32, 32), num_classes=10, seed=0)
    assert color.train.classes == ["a", "b"] and color.test.classes == ["a", "b"]
    x, y = color.train[0]
    assert x.shape == (3, 32, 32) and y == 0 and all(torch.equal(channel, gray(1, 32)[0]) for channel in x)
    x, y = color.train[1]
    assert x.shape == (3, 32, 32) and y == 0 and (x.int() - smooth.int()).abs().max() <= 8
    assert color.test[0][1] == 1  # test labels are the train classes' numbers
    gray_recipe = folder_datasets(str(root), recipe="x", shape=(1, 32, 32), num_classes=10, seed=0)
    assert gray_recipe.train[2][0].shape == (1, 32, 32)


# ---- training -------------------------------------------------------------------------

@pytest.mark.fast
def test_an_exported_folder_trains_alike_from_the_device_and_host_loaders(exported, train_here, out):
    args = ["recipe=mnist", "recipe.data.source=folder", f"recipe.data.root={exported}", *RUN]
    device = train_here([*args, "recipe.data.loader=device"], out / "device")
    host = train_here([*args, "recipe.data.loader=host", "recipe.data.num_workers=2"], out / "host")
    for done, loader in ((device, "device"), (host, "host")):
        assert done.returncode == 0, done.stderr[-3000:]
        res = done.results()
        assert res["data_source"] == "folder" and res["steps"] == 4
        assert res["final/eval_samples"] == TEST_FILES  # every test image once
        assert OmegaConf.load(done.run_dir / "config.yaml").recipe.data.loader_used == loader
    for key in ("final/loss", "final/eval_loss"):  # the same images in the same order
        assert host.results()[key] == pytest.approx(device.results()[key], rel=1e-5)


# ---- images of any size ------------------------------------------------------------------

@pytest.mark.fast
def test_a_folder_of_mixed_sizes_is_cropped_to_the_recipes_shape_and_the_log_says_how(tmp_path, capsys):
    root = write_folder(tmp_path / "mixed", {
        "train": {"a": [png(gray(1)), png(gray(2, 64))], "b": [("c.jpg", jpeg(gray(3, 40)))]},
        "val": {"a": [png(gray(4, 50))]},  # ImageNet's name for the test split; no images of class b
    })
    data = build_mnist("recipe.data.source=folder", f"recipe.data.root={root}").data
    log = capsys.readouterr().out
    assert callable(data.train.set_epoch) and not hasattr(data.test, "set_epoch")  # crops drawn per epoch
    assert [data.train[i][0].shape for i in range(3)] == [(1, 28, 28)] * 3 and data.test[0][0].shape == (1, 28, 28)
    assert [data.train[i][1] for i in range(3)] == [0, 0, 1] and data.test[0][1] == 0
    assert f"recipe.data.root={root}: 3 images in train/ and 1 in val/ (the test split), 2 classes" in log
    assert "random-resized crops (recipe.data.crop_scale=[0.08,1.0]) and flips drawn anew each epoch, so the host " \
           "loader serves them; evaluating on center crops (shorter side to 32)" in log
    assert "val/ has no images of class b: evaluation leaves it out" in log


@pytest.mark.fast
def test_crop_settings_are_read_for_image_folders_and_refused_where_nothing_reads_them(exported):
    folder = ["recipe.data.source=folder", f"recipe.data.root={exported}"]
    assert not hasattr(build_mnist(*folder).data.train, "set_epoch")  # every image 28x28: read as it is
    asked = build_mnist(*folder, "recipe.data.crop_scale=[0.5,1.0]", "recipe.data.eval_resize_ratio=0.8").data
    assert asked.train.crop_scale == (0.5, 1.0) and asked.test.eval_resize_ratio == 0.8  # crops asked for
    with pytest.raises(ConfigError, match=r"recipe\.data\.eval_resize_ratio=0\.9 is read when a folder's images are "
                                          r"cropped, and every image in .* is 28x28 already"):
        build_mnist(*folder, "recipe.data.eval_resize_ratio=0.9")
    with pytest.raises(ConfigError, match=r"recipe\.data\.crop_scale=\[0\.5, 1\.5\] must be two shares of the "
                                          r"image's area, 0 < low <= high <= 1"):
        build_mnist(*folder, "recipe.data.crop_scale=[0.5,1.5]")
    with pytest.raises(ConfigError, match=r"recipe\.data\.crop_scale=\[0\.5, 1\.0\] is read for image folders only"):
        build_mnist("recipe.data.source=synthetic", "recipe.data.crop_scale=[0.5,1.0]")


def test_a_folder_of_photos_trains_through_the_host_loader_skipping_a_truncated_jpeg(tmp_path, train_here, out):
    """scripts/make_image_folder.py's photos of every size and mode, one of them cut short, into cifar10_resnet18:
    the device loader is refused (crops change every epoch), auto (the recipe's default) picks the host loader,
    the run finishes."""
    from scripts.make_image_folder import main

    root = tmp_path / "photos"
    assert main(["--output", str(root), "--classes", "4", "--per-class", "6", "--test-per-class", "2",
                 "--min-side", "48", "--max-side", "160", "--odd-modes", "--workers", "1"]) == 0
    broken = sorted((root / "train" / "class0").iterdir())[0]  # sample 0: the loader reads it as it starts
    broken.write_bytes(broken.read_bytes()[:600])
    args = ["recipe=cifar10_resnet18", "recipe.data.source=folder", f"recipe.data.root={root}", "logger=none",
            "recipe.data.batch_size=4", "recipe.data.eval_batch_size=8", "train.max_steps=4"]
    refused = train_here([*args, "recipe.data.loader=device"], out / "device")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "recipe.data.loader=device holds the training set as read once, but it draws new items each epoch " \
           f"(random-resized crops of the 24 images in {root}/train, new each epoch): set recipe.data.loader=host " \
           "(or auto)" in refused.stderr
    done = train_here(args, out / "auto")  # the recipe's own recipe.data.loader=auto
    assert done.returncode == 0, done.stderr[-3000:]
    res = done.results()
    assert res["steps"] == 4 and res["final/eval_samples"] == 8
    assert OmegaConf.load(done.run_dir / "config.yaml").recipe.data.loader_used == "host"
    assert f"WARNING: {broken} could not be decoded" in done.stderr and "files skipped so far" in done.stderr


# ---- bad folders -----------------------------------------------------------------------

def _bad_folder(root: Path, case: str) -> str:
    """Makes ``root`` wrong in one way; returns the path the message must name."""
    good = {"train": {"0": [png(gray(1))], "1": [png(gray(2))]}, "test": {"0": [png(gray(3))]}}
    if case == "missing-root":
        return str(root)
    if case == "no-test-folder":
        write_folder(root, {"train": good["train"]})
        return str(root / "test")
    if case == "no-class-folders":
        write_folder(root, {"test": good["test"]})
        (root / "train").mkdir()
        (root / "train" / "notes.txt").write_text("not a class")
        return str(root / "train")
    if case == "class-without-images":
        write_folder(root, {**good, "train": {**good["train"], "7": [("readme.txt", b"no images here")]}})
        return str(root / "train" / "7")
    if case == "unknown-test-class":
        write_folder(root, {**good, "test": {"0": [png(gray(3))], "cat": [png(gray(4))]}})
        return str(root / "test" / "cat")
    if case == "too-many-classes":
        write_folder(root, {**good, "train": {str(c): [png(gray(c))] for c in range(11)}})
        return str(root / "train")
    if case == "not-an-image":
        write_folder(root, {**good, "train": {**good["train"], "2": [b"<html>404</html>"]}})
        return str(root / "train" / "2" / "0.png")
    if case == "one-pixel":
        write_folder(root, {**good, "test": {"1": [png(gray(3)), png(gray(4, 1))]}})
        return str(root / "test" / "1" / "1.png")
    if case == "damaged-jpeg-header":
        write_folder(root, {**good, "train": {**good["train"], "2": [("x.jpg", jpeg(gray(5))[:20])]}})
        return str(root / "train" / "2" / "x.jpg")
    if case == "twelve-bit-jpeg":
        data = bytearray(jpeg(gray(5)))
        data[data.index(b"\xff\xc0") + 4] = 12  # the frame header's sample precision
        write_folder(root, {**good, "train": {**good["train"], "2": [("x.jpg", bytes(data))]}})
        return str(root / "train" / "2" / "x.jpg")
    raise ValueError(case)


BAD_FOLDERS = {  # case: what the message says besides the path
    "missing-root": "recipe.data.root=",
    "no-test-folder": "does not exist",
    "no-class-folders": "has no class folders",
    "class-without-images": "has no images (.png, .jpg, .jpeg)",
    "unknown-test-class": "is a class that",
    "too-many-classes": "has 11 class folders but the mnist model has 10 outputs",
    "not-an-image": "is not an image: its first bytes are neither a PNG's nor a JPEG's signature",
    "one-pixel": "is 1x1 (width x height), too small to crop from: the mnist recipe reads images of at least 7x7",
    "damaged-jpeg-header": "is a damaged JPEG file (no frame header with its size)",
    "twelve-bit-jpeg": "is a 12-bit JPEG, which Pillow cannot decode",
}


@pytest.mark.fast
@pytest.mark.parametrize("case", BAD_FOLDERS)
def test_a_bad_folder_is_named_in_one_message_at_build_time(tmp_path, case):
    named = _bad_folder(tmp_path / "images", case)
    with pytest.raises(ConfigError) as error:
        build_mnist("recipe.data.source=folder", f"recipe.data.root={tmp_path / 'images'}")
    message = str(error.value)
    assert named in message and BAD_FOLDERS[case] in message, message


@pytest.mark.fast
def test_an_unknown_source_lists_folder_among_the_choices():
    with pytest.raises(ConfigError, match=r"recipe\.data\.source='pngs' is not one of auto, mnist, synthetic, folder"):
        build_mnist("recipe.data.source=pngs")


def test_train_py_prints_a_bad_folder_once_and_exits_2(tmp_path, out, train_here):
    named = _bad_folder(tmp_path / "images", "one-pixel")
    done = train_here(["recipe=mnist", "recipe.data.source=folder", f"recipe.data.root={tmp_path / 'images'}",
                       "logger=none"], out)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count(named) == 1 and "Traceback" not in done.stderr, done.stderr
    assert not out.exists() or not any(out.rglob("config.yaml"))  # no run directory for a config error


@pytest.mark.fast
def test_to_split_decodes_a_larger_folder_in_worker_processes(tmp_path):
    from recipes.image_folder import folder_datasets

    images = [png(gray(i)) for i in range(30)]
    write_folder(tmp_path, {split: {str(c): [images[(c * 7 + i) % 30] for i in range(70)] for c in range(10)}
                            for split in ("train", "test")})
    data = folder_datasets(str(tmp_path), recipe="mnist", shape=(1, 28, 28), num_classes=10, seed=0)
    split = data.train.to_split(workers=2)  # 700 images: batches of 512 from two processes
    assert split.x.shape == (700, 1, 28, 28) and torch.bincount(split.y).tolist() == [70] * 10
    for i in (0, 511, 512, 699):
        assert torch.equal(split.x[i], data.train[i][0]) and split.y[i] == data.train[i][1]


A_RANK_WITH_BUSY_THREADS = '''
import os, sys, threading, time, warnings
from concurrent.futures import ThreadPoolExecutor
import torch
sys.path.insert(0, os.getcwd())
from recipes.image_folder import folder_datasets
from trainer.data import HostLoader
from trainer.run.runtime import Runtime


def write_and_warn():  # what tqdm's monitor and a logging thread do: take stderr's and the warnings' locks
    while True:
        sys.stderr.write("")
        sys.stderr.flush()
        warnings.warn("a thread warns", UserWarning)


if __name__ == "__main__":
    warnings.simplefilter("always")
    sys.stderr = open(os.devnull, "w")
    for _ in range(2):
        threading.Thread(target=write_and_warn, daemon=True).start()
    pool = ThreadPoolExecutor(2)
    pool.map(lambda _: time.sleep(0.001), range(10**6))  # a pool's threads and its queue, busy all along
    # 80 workers started while the threads run: each read starts two, and so does each loader (its workers persist
    # across epochs, so every loader reads two epochs and closes); small splits, so that starting is most of it
    data = folder_datasets(sys.argv[1], recipe="mnist", shape=(1, 28, 28), num_classes=10, seed=0, train_size=60)
    for _ in range(20):
        assert len(data.train.to_split(workers=2).y) == 60
    rt = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), distributed=False, run_dir=None)
    for _ in range(20):
        loader = HostLoader(data.train, 20, rt, train=True, seed=0, num_workers=2)
        for epoch in range(2):
            loader.start_epoch(epoch)
            for _ in range(loader.steps):
                loader.stage()
        loader.close()
    print("read", flush=True)
    os._exit(0)  # the busy threads never end
'''


def test_workers_never_inherit_a_lock_that_a_thread_of_their_rank_held(tmp_path):
    """A worker forked while another thread of its rank held a lock (stderr's, the warnings module's, a queue's)
    waits on it forever, and the rank on the worker: the suite once hung so in this folder's reader. Workers start
    from a forkserver of one thread instead; 20 whole reads and 20 host loaders of two epochs each start 80
    workers while the threads are busy."""
    images = [png(gray(i)) for i in range(30)]
    folder = write_folder(tmp_path / "folder", {split: {str(c): [images[(c * 7 + i) % 30] for i in range(60)]
                                                        for c in range(10)} for split in ("train", "test")})
    script = tmp_path / "rank.py"
    script.write_text(A_RANK_WITH_BUSY_THREADS)
    mark = f"{SESSION}-busy-threads"
    rank = subprocess.Popen([sys.executable, str(script), str(folder)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, MARK: mark})
    try:
        out, _ = rank.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading hung with busy threads in the rank:\n{stacks(marked_pids(mark))}")
    finally:
        rank.kill()
        rank.wait()
        for pid in marked_pids(mark):
            os.kill(pid, signal.SIGKILL)
    assert rank.returncode == 0 and out.strip().splitlines()[-1] == "read", out  # after the folder's one-line log
