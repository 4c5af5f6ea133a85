"""Train a recipe with DDP, eagerly or as one CUDA graph per rank.

    python train.py                                   # one process
    torchrun --standalone --nproc_per_node=2 train.py recipe=mnist graph=full
    python train.py --cfg job                         # print the composed config

Every rank composes the same Hydra config; bad settings are reported once, by rank 0.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import traceback


def _silence_other_ranks_stderr():
    """Config errors are the same on every rank: let only rank 0 print Hydra's message."""
    if int(os.environ.get("RANK", "0")) == 0:
        return None
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    return saved


_saved_stderr = _silence_other_ranks_stderr()

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from conf.schema import register_configs  # noqa: E402

register_configs()
log = logging.getLogger("train")

EXIT_CONFIG, EXIT_CAPTURE, EXIT_NONFINITE, EXIT_CRASH = 2, 3, 4, 1


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    if _saved_stderr is not None:
        os.dup2(_saved_stderr, 2)
    code = run(cfg)
    if code:
        sys.exit(code)


def run(cfg: DictConfig) -> int:
    import torch  # after Hydra: `--help` and config errors stay fast

    from graphing import CaptureError, resolve_mode
    from recipes.loop import NonFiniteLossError, Trainer, check_loop_config, write_json
    from recipes.checkpoint import check_checkpoint_config
    from recipes.metrics_logger import MetricsLogger
    from recipes.runtime import ConfigError, env_rank, pick_device, print_once, seed_everything, start

    rt = trainer = logger = None
    code = 0
    try:
        # Everything that can be checked without data is checked before the ranks meet.
        check_loop_config(cfg)
        check_checkpoint_config(cfg)
        device = pick_device(cfg.device)
        mode = resolve_mode(cfg.graph, device, int(os.environ.get("WORLD_SIZE", "1")))
        if mode == "full" and torch.__version__ < "2.2":
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")  # older watchdogs break capture
        rt = start(device, cfg.output_root, cfg.run_dir, f"{cfg.recipe.name}_{mode}")
        _log_to_files(rt)
        seed_everything(cfg.seed, cfg.deterministic)
        trainer = Trainer(cfg, rt)
        config = trainer.config
        config["recipe"]["data"]["source_used"] = trainer.recipe.data.source
        config["graph"]["mode_used"] = mode
        config["world_size"] = rt.world_size
        if rt.is_main:
            (rt.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(config))
            (rt.run_dir / "overrides.yaml").write_text(OmegaConf.to_yaml(list(HydraConfig.get().overrides.task)))
        print_once(f"run {rt.run_dir} | recipe {cfg.recipe.name} ({trainer.recipe.data.source} data) | "
                   f"mode {mode} | {rt.world_size} x {device.type} | "
                   f"{trainer.steps_per_epoch} steps/epoch of {trainer.global_batch} samples")
        log.info("config:\n%s", OmegaConf.to_yaml(config))
        logger = MetricsLogger(cfg.logger, rt.run_dir, config, rank=rt.rank, job_type=mode,
                               run_id=trainer.wandb_run_id)
        summary = trainer.fit(logger)
        log.info("summary: %s", summary)
        if rt.is_main:
            write_json(rt.run_dir / "results.json", summary)
            _print_summary(summary)
    except ConfigError as e:
        code = EXIT_CONFIG
        print_once(f"Error: {e}", file=sys.stderr)
    except CaptureError as e:
        code = EXIT_CAPTURE
        print_once(f"Error: {e}", file=sys.stderr)
    except NonFiniteLossError as e:
        code = EXIT_NONFINITE
        print_once(f"Error: {e}", file=sys.stderr)
    except Exception:
        code = EXIT_CRASH
        text = traceback.format_exc()
        log.error("crashed:\n%s", text)  # the rank's log file; rank 0's console too
        if rt is None or not rt.is_main:
            print(f"[rank {env_rank()}] {text}", file=sys.stderr, flush=True)
    finally:
        if trainer is not None:
            trainer.close()  # graphs before the process group, or exit can hang
        if logger is not None:
            logger.finish(exit_code=code)
        if rt is not None:
            rt.close(clean=code == 0)
    return code


def _log_to_files(rt) -> None:
    handler = logging.FileHandler(rt.run_dir / f"rank{rt.rank}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    if rt.is_main:  # warnings (synthetic data, W&B) reach the console once
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.WARNING)
        root.addHandler(console)


def _print_summary(summary) -> None:
    keys = [k for k in summary if k.startswith(("perf/", "graph/", "final/", "time/", "speedup"))]
    width = max(len(k) for k in keys) if keys else 0
    lines = [f"  {k:<{width}}  {summary[k]:.4g}" if isinstance(summary[k], float) else f"  {k:<{width}}  {summary[k]}"
             for k in keys]
    print(f"done: {summary['steps']} steps in {summary['train_loop_s']:.2f} s ({summary['mode']})\n" + "\n".join(lines),
          flush=True)


def _exit_now(code: int) -> None:
    """Ends a torchrun worker without interpreter finalization.

    Graphs, W&B and the process group are already closed explicitly (see ``run``); what
    remains are C++ destructors of communication threads, which have been seen to abort
    ("terminate called without an active exception") when a peer is already gone.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    try:
        main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if code and int(os.environ.get("RANK", "0")) != 0:
            # torchrun stops the whole job when the first rank exits: give rank 0 time to
            # print the one message everybody would have printed.
            time.sleep(3)
        if under_torchrun:
            _exit_now(code)
        raise
    if under_torchrun:
        _exit_now(0)
