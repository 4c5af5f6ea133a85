"""The command line of a script that takes train.py's config: its own options, then train.py's.

    args, cfg = script_config(parser, defaults=["logger=none"])

A script reads train.py's part the way train.py does: Hydra overrides (``key=value``,
``+key=value``, ``~key``), ``--config-dir DIR`` (``-cd``) for a user's own config tree and
``--config-name NAME`` (``-cn``) for another primary config, anywhere on the line or after
``--``. ``--help`` shows the script's options and how to pass train.py's. A config that does
not compose is one line with Hydra's words and train.py's exit code, not a traceback.
Nothing here imports torch: ``--help`` and a bad override answer at once.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List, Optional, Sequence, Tuple, Union

from trainer.run.errors import EXIT_CONFIG


TRAIN_CONFIG_HELP = """\
train.py's config: the rest of the command line (after '--' if you like), as train.py takes it.
  key=value                        set a value: recipe=gpt_tiny graph=eager train.max_steps=500
  +key=value                       add a key the config does not have: +recipe.model.width=64
  ~key                             remove a key: ~recipe.optim.momentum
  --config-dir DIR, -cd DIR        also look for configs in DIR, as `python train.py --config-dir DIR`
                                   does: DIR/recipe/mine.yaml is recipe=mine
  --config-name NAME, -cn NAME     the primary config (default: train, conf/train.yaml)
`python train.py --help` lists the config groups (recipe, graph, experiment, logger) and every key."""

Defaults = Union[Sequence[str], Callable[[argparse.Namespace], Optional[Sequence[str]]]]


def script_config(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None,
                  defaults: Defaults = (), fixed: Sequence[str] = ()) -> Tuple[argparse.Namespace, object]:
    """Parses a script's command line; returns ``(args, cfg)``, cfg being the config train.py would compose.

    ``parser`` holds the script's own options; this adds train.py's ``--config-dir``/``-cd`` and
    ``--config-name``/``-cn`` and the help section on train.py's overrides (``--help`` prints
    both and exits 0). ``argv`` defaults to ``sys.argv[1:]``. What is neither an option of the
    script nor of train.py is a Hydra override; an unknown ``--option`` is argparse's error.

    ``defaults`` are overrides the script puts before the user's (the user's win), or a function
    of the parsed args that returns them, or None when this run needs no config (cfg is None).
    ``fixed`` are overrides the script puts after the user's: what it must hold whatever they say.

    ``args`` gains ``overrides`` (the user's, without ``defaults``), ``config_dir`` (absolute, or
    None), ``config_name`` and ``train_options`` (``--config-dir``/``--config-name`` as train.py
    takes them, for a script that launches it). A config that does not compose (unknown key,
    bad value, unknown group option, missing --config-dir) prints one line, ``<script>: <Hydra's
    words>``, on rank 0 and exits with train.py's code for it (2, trainer/run/errors.py).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    before, after = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    _add_train_options(parser)
    parser.epilog = f"{parser.epilog}\n\n{TRAIN_CONFIG_HELP}" if parser.epilog else TRAIN_CONFIG_HELP
    if parser.formatter_class is argparse.HelpFormatter:  # keep the section's lines as written
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
    if parser.usage is None:
        parser.usage = (parser.format_usage().removeprefix("usage: ").rstrip()
                        + " [--config-dir DIR] [--config-name NAME] [key=value ...]")
    args, overrides = parser.parse_known_args(before)
    if after:  # after '--' only train.py's part: its two options and overrides
        train_part = _add_train_options(argparse.ArgumentParser(prog=parser.prog, add_help=False))
        after_args, after_overrides = train_part.parse_known_args(after, argparse.Namespace(**vars(args)))
        args.config_dir, args.config_name = after_args.config_dir, after_args.config_name
        overrides += after_overrides
    unknown = [item for item in overrides if item.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (train.py's overrides are key=value, "
                     f"+key=value or ~key; see {parser.prog} --help)")
    args.overrides = overrides
    args.config_dir = os.path.abspath(args.config_dir) if args.config_dir else None
    args.train_options = ((["--config-dir", args.config_dir] if args.config_dir else [])
                          + (["--config-name", args.config_name] if args.config_name != "train" else []))

    script_defaults = defaults(args) if callable(defaults) else defaults
    if script_defaults is None:
        return args, None
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from conf.schema import compose

    try:
        cfg = compose([*script_defaults, *overrides, *fixed], config_dir=args.config_dir,
                      config_name=args.config_name)
    except (HydraException, OmegaConfBaseException) as error:
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank composes: one message
            print(f"{parser.prog}: {hydra_error_line(error)}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    return args, cfg


def _add_train_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """train.py's two options; their help is the section in the epilog."""
    parser.add_argument("--config-dir", "-cd", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config-name", "-cn", default="train", help=argparse.SUPPRESS)
    return parser


def hydra_error_line(error: BaseException) -> str:
    """Hydra's message for ``error`` as train.py prints it, on one line.

    train.py prints the exception and its OmegaConf cause over several lines (Hydra's
    run_and_report); this keeps their words and drops the layout: the config search path, and
    the cause's ``full_key``/``reference_type`` lines (the key is in the message already).
    """
    from hydra.errors import OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    lines = str(error).split("Config search path:")[0].splitlines()
    if isinstance(error.__cause__, OmegaConfBaseException):
        lines.append(str(error.__cause__).splitlines()[0])
    parts: List[str] = []
    for line in (line.strip() for line in lines):
        if not line:
            continue
        if parts and parts[-1].endswith(":"):  # "Available options in 'recipe':" and its list
            parts[-1] += " " + line
        elif parts and parts[-1].startswith("Available options"):
            parts[-1] += ", " + line
        else:
            parts.append(line.rstrip("."))
    if isinstance(error, OverrideParseException):  # Hydra does not name the override it could not read
        parts.insert(0, f"cannot parse the override {error.override!r}")
    return "; ".join(parts)
