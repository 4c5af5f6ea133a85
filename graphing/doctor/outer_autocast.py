"""autocast_cache: an autocast with its weight cache on, entered around the step by the caller.

Casts cached before a capture are read by the graph, stale (and freed when that autocast region
ends). An autocast entered inside the step captures and replays like eager: no finding.
"""
from __future__ import annotations

import ast
import functools
import os
from typing import Optional, Tuple

import torch

from graphing.doctor.attribution import is_user_file
from graphing.doctor.findings import WRONG, Findings


def outer_autocast_site(frame, device: torch.device) -> Optional[Tuple[str, int]]:
    """Where an autocast with its cache on was entered around ``frame`` (the doctor's caller), if one is active."""
    if not (torch.is_autocast_enabled(device.type) and torch.is_autocast_cache_enabled()):
        return None
    first = None
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            file = os.path.abspath(frame.f_code.co_filename)
            first = first or (file, frame.f_lineno)
            line = enclosing_autocast_with(file, frame.f_lineno)
            if line is not None:
                return file, line
        frame = frame.f_back
    return first or ("", 0)


def report_outer_autocast(findings: Findings, site: Tuple[str, int]) -> None:
    findings.add("autocast_cache", WRONG, *site,
                 "autocast with its weight cache on is active when the step starts (entered outside "
                 "the step): casts cached before the capture are read by the graph, stale (and "
                 "freed when that autocast region ends)")


def enclosing_autocast_with(filename: str, line: int) -> Optional[int]:
    """The line of the innermost ``with ...autocast...`` statement around ``line`` in ``filename``, or None."""
    tree = _parse(filename)
    best = None
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, (ast.With, ast.AsyncWith)) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if any("autocast" in ast.unparse(item.context_expr).lower() for item in node.items):
                if best is None or node.lineno > best:
                    best = node.lineno
    return best


@functools.lru_cache(maxsize=64)
def _parse(filename: str):
    try:
        with open(filename, encoding="utf-8") as f:
            return ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
