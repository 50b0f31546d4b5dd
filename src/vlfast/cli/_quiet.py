"""Third-party chatter off unless ``--verbose``: transformers' progress bars, Ray's and DeepSpeed's INFO and
WARNING lines, which buried a command's own progress and summary (Ray's session logs keep everything).
Set through the environment where it can be, so decode and Ray workers inherit it, never over a user's value.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # transformers' and the Hub's tqdm bars, in every process


class _ErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


_set_here: list[str] = []  # what quiet_third_party set, so that a later --verbose can take it back


def quiet_third_party(verbose: bool) -> None:
    """Silence what other libraries print on the console, or (``verbose``) undo exactly that; a value the
    user set is never touched either way."""
    hf_logging = None
    if "transformers" in sys.modules:  # already imported: it read the variable below at import
        from transformers.utils import logging as hf_logging
    if verbose:
        for key in _set_here:
            os.environ.pop(key, None)
        if _set_here and hf_logging is not None:
            with warnings.catch_warnings():  # the Hub read the variable at import: its own bars stay off
                warnings.simplefilter("ignore")
                hf_logging.enable_progress_bar()
        _set_here.clear()
        deepspeed_logger = logging.getLogger("DeepSpeed")
        for f in [f for f in deepspeed_logger.filters if isinstance(f, _ErrorsOnly)]:
            deepspeed_logger.removeFilter(f)
        return
    for key, value in QUIET_ENV.items():
        if key not in os.environ:
            os.environ[key] = value
            _set_here.append(key)
    if hf_logging is not None and "HF_HUB_DISABLE_PROGRESS_BARS" in _set_here:
        hf_logging.disable_progress_bar()
    # DeepSpeed (imported by accelerate in save_pretrained) says "Setting accelerator to CPU" without a GPU.
    # A filter, made before it is imported: DeepSpeed resets its logger's level but keeps its filters.
    deepspeed_logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _ErrorsOnly) for f in deepspeed_logger.filters):
        deepspeed_logger.addFilter(_ErrorsOnly())


def quiet_ray(verbose: bool) -> None:
    """Keep Ray's and Ray Data's console handlers to errors, by a filter on the handlers: ``ray.init`` resets
    the ``ray`` logger's level, and Ray Data configures its own logger when it is imported."""
    if verbose:
        return
    try:
        import ray.data  # noqa: F401 - configures the "ray.data" logger and its console handler
    except ImportError:
        return  # the engine says how to install it
    # Ray Data's note that a pool has more actors than input blocks is about Ray's tuning, not the run.
    warnings.filterwarnings("ignore", message="The minimum number of concurrent actors", category=UserWarning)

    for name in ("ray", "ray.data"):
        for handler in logging.getLogger(name).handlers:
            console = isinstance(handler, logging.StreamHandler) and not isinstance(
                handler, logging.FileHandler
            )
            if console and not any(isinstance(f, _ErrorsOnly) for f in handler.filters):
                handler.addFilter(_ErrorsOnly())
