"""scripts/bench_decode.py on a CPU: the loader's own reader timed on a small generated folder, its table written;
decoders that cannot run here are said and skipped (the GPU machine's numbers: scripts/results/decode.md)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.availability import cuda_count
from scripts.bench_decode import main

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos") / "shapes"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_image_folder.py"), "--output", str(root),
                    "--classes", "2", "--per-class", "12", "--test-per-class", "2", "--workers", "1"],
                   check=True, capture_output=True, timeout=120)
    return root


@pytest.mark.skipif(cuda_count() > 0, reason="checks that the GPU decoder is skipped without CUDA")
def test_it_times_the_loaders_reader_and_writes_its_table(photos, tmp_path, capsys):
    output = tmp_path / "decode.json"
    assert main(["--root", str(photos), "--decoders", "pillow", "nvjpeg", "--size", "32", "--batch", "4",
                 "--batches", "2", "--warmup", "1", "--workers", "1", "--output", str(output)]) == 0
    said = capsys.readouterr().out
    assert "no CUDA GPU: nvjpeg skipped" in said
    rows = json.loads(output.read_text())["rows"]
    assert [row["decoder"] for row in rows] == ["pillow"] and rows[0]["images_per_s"] > 0
    table = output.with_suffix(".md").read_text()
    assert "| pillow |" in table and "24 JPEGs" in table and "random-resized 32x32 crops" in table


def test_a_folder_that_is_not_there_is_named_with_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--root", str(tmp_path / "nowhere"), "--output", str(tmp_path / "d.json")])
    assert exited.value.code == 2
    assert f"bench_decode.py: --root {tmp_path / 'nowhere'} is not a folder" in capsys.readouterr().err
