"""What the tests import or run that is not a test.

Imported as ``helpers`` (``from helpers.launches import launch``): pytest.ini's ``pythonpath`` puts the
checkout and tests/ on sys.path, so no file edits it. A launch that must import from here (a recipe of
``doctor_gallery`` named by ``recipe._target_``) puts ``helpers.paths.TESTS`` on its PYTHONPATH.

- ``paths``: where the checkout and tests/ are.
- ``launches``: the tests' one way to start a process (python or torchrun), run it with a time limit and read
  its outputs.
- ``processes``: finding a launch's processes by the variable they carry, and what a hung one is doing.
- ``shared_runs``: the arguments of the session's shared launches (conftest's fixtures).
- ``availability``: what this machine has (CUDA devices, optional extras), for skips.
- ``checkpoints``: the tests' own oracle for a checkpoint file.
- ``wandb_offline``: reads W&B's offline run files back; ``mnist_files``: a small MNIST in torchvision's format;
  ``doctor_gallery``: one small step per kind of graph-doctor finding.

The other modules are scripts the tests launch (``python tests/helpers/X.py``, or under torchrun):
fault_injection.py (train.py with faults), the 2-rank helper scripts. A launched script finds the repo's
packages itself (it puts the checkout on sys.path), whatever the launch's cwd or PYTHONPATH.
"""
