"""What ``train.py``, ``eval.py`` and the scripts share at the edge: a user's mistake ends in one line.

``run(main)`` is ``absl.app.run`` with

* a flags parser that answers an unknown ``--config.a.b`` override with the valid keys at that level
  (ml_collections raises a bare ``AttributeError`` from deep inside flag parsing), a missing config
  file or a failing preset in one line;
* ``main`` guarded by ``user_errors()``: a ``lmcore.errors.UserError`` prints as ``Name: message`` and
  exits with its code; Ctrl-C (SIGINT) and SIGTERM exit with one line (130 / 143), never a traceback.

Python logs of ``lmcore.*`` at INFO (held-out split counts, the held-out set written, tokenizer
training) are shown; absl's own verbosity stays at WARNING so Orbax does not log every save.
"""

from __future__ import annotations

import contextlib
import importlib
import logging as py_logging
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

from absl import app, flags, logging

from lmcore import xla_flags
from lmcore.train import goodput
from lmcore.config import unknown_key_error
from lmcore.errors import ConfigError, UserError

_CONFIG_FLAG = re.compile(r"^--?config(?:=(.*))?$")
_OVERRIDE_FLAG = re.compile(r"^--?(?:no)?config\.([^=\s]+)")


class Terminated(KeyboardInterrupt):
  """SIGTERM, raised like Ctrl-C so that the same clean exit applies (``except Exception`` passes it on)."""


def _raise_terminated(signum, frame):
  del signum, frame
  raise Terminated()


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
  """Turns user errors and interrupts into one line on stderr and an exit code; bugs keep tracebacks."""
  previous = signal.getsignal(signal.SIGTERM)
  if previous in (signal.SIG_DFL, None):
    signal.signal(signal.SIGTERM, _raise_terminated)
  try:
    yield
  except UserError as e:
    _exit(f"{type(e).__name__}: {e}", e.exit_code)
  except KeyboardInterrupt as e:
    name = "SIGTERM" if isinstance(e, Terminated) else "SIGINT"
    _exit(f"{name} received: stopped. {e}".rstrip(), 143 if isinstance(e, Terminated) else 130)
  finally:
    if previous in (signal.SIG_DFL, None):
      signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)


def _exit(line: str, code: int) -> NoReturn:
  sys.stdout.flush()
  print(line, file=sys.stderr, flush=True)
  sys.exit(code)


def guarded(main: Callable[[list[str]], Any]) -> Callable[[list[str]], Any]:
  def wrapped(argv):
    with user_errors():
      return main(argv)
  return wrapped


def run(main: Callable[[list[str]], Any]) -> None:
  """``absl.app.run(main)`` with one-line answers to user errors (see the module docstring), after
  the project's default XLA flags (``xla_flags.apply_defaults``). The first run the entry point trains
  counts the process's start in its start-up (``goodput.count_process_start``)."""
  goodput.count_process_start()
  xla_flags.apply_defaults()
  with user_errors():  # Ctrl-C while flags are parsed (the config file imports the library)
    app.run(guarded(main), flags_parser=parse_flags)


def show_library_logs() -> None:
  """Shows ``lmcore.*`` INFO logs while absl (and Orbax through it) stay at WARNING."""
  logging.set_verbosity(logging.WARNING)
  py_logging.getLogger("lmcore").setLevel(py_logging.INFO)


def parse_flags(argv: Sequence[str]) -> list[str]:
  """``absl.flags.FLAGS(argv)``, with config mistakes reported in one line (exit 2)."""
  config_arg = _config_argument(argv)
  if config_arg is not None:
    path = config_arg.split(":", 1)[0]
    if path and not os.path.isfile(path):
      _exit(f"ConfigError: --config={config_arg}: no file {path!r} (relative to {os.getcwd()}); "
            "give the path of a config file, e.g. configs/baselines.py:tiny.", 2)
  try:
    return flags.FLAGS(list(argv))
  except flags.Error as e:
    _exit(f"FATAL Flags parsing error: {_last_line(str(e))}", 1)
  except (AttributeError, KeyError):
    error = _override_error(config_arg, argv)
    if error is None:
      raise
    _exit(f"ConfigError: {error}", 2)


def _last_line(message: str) -> str:
  """A multi-line flag error (a traceback from a config file) as its flag and its last line."""
  lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
  if len(lines) <= 1:
    return message.strip()
  last = re.sub(r"^[\w.]+\.(\w+(?:Error|Exception)):", r"\1:", lines[-1])
  return f"{lines[0].rstrip(':')}: {last}"


def _config_argument(argv: Sequence[str]) -> str | None:
  for i, arg in enumerate(argv):
    match = _CONFIG_FLAG.match(arg)
    if match:
      return match.group(1) if match.group(1) is not None else (argv[i + 1] if i + 1 < len(argv) else None)
  return None


def _override_error(config_arg: str | None, argv: Sequence[str]) -> ConfigError | None:
  if config_arg is None:
    return None
  config = flags.FLAGS["config"].parser.parse(config_arg)
  for arg in argv:
    match = _OVERRIDE_FLAG.match(arg)
    if match:
      error = unknown_override(config, match.group(1))
      if error is not None:
        return error
  return None


def config_overrides(argv: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
  """The ``--config.a.b=v`` overrides of a parsed command line ``argv``, in order, each as one
  argument (a value given as the next argument joined with "="): what ``train.py`` takes."""
  overrides, args = [], iter(argv)
  for arg in args:
    if arg == "--":
      break
    match = _OVERRIDE_FLAG.match(arg)
    if match is None:
      continue
    boolean = flag_values[f"config.{match.group(1)}"].boolean  # --config.x / --noconfig.x take no value
    overrides.append(arg if "=" in arg or boolean else f"{arg}={next(args)}")
  return overrides


def override_key(arg: str) -> str:
  """``"--config.train.steps=10"`` (or ``--noconfig.x``) -> ``"train.steps"``."""
  match = _OVERRIDE_FLAG.match(arg)
  if match is None:
    raise ValueError(f"{arg!r} is not a --config.<key> override")
  return match.group(1)


def unknown_override(config: Mapping[str, Any], dotted: str) -> ConfigError | None:
  """The error for override path ``dotted`` (``"train.stpes"``) if it names no field of ``config``."""
  node, walked = config, "config"
  for part in dotted.split("."):
    if not isinstance(node, Mapping) and not hasattr(node, "keys"):
      return ConfigError(f"'{walked}' is a value, not a group of keys; it has no key '{part}'.")
    if part not in node:
      return unknown_key_error(walked, part, list(node.keys()))
    node, walked = node[part], f"{walked}.{part}"
  return None


def import_tasks():
  """``lmcore.train.tasks`` (downstream tasks through lm-evaluation-harness, an optional dependency), or
  one line saying how to install it."""
  try:
    return importlib.import_module("lmcore.train.tasks")
  except ImportError as e:
    raise ConfigError(f"downstream tasks need lm-evaluation-harness ({e}); install it with "
                      "pip install -e '.[eval]'") from None
