"""Errors a user can fix. Their message is one line naming the field (or file) and the fix.

The entry points print one as that line and exit with ``exit_code`` (``lmcore.cli``); anything else
is a bug and keeps its traceback. Each class also derives from the builtin a caller would expect.
"""

from __future__ import annotations


class UserError(Exception):
  """Raised for input the user can correct; printed as one line by the entry points."""

  exit_code = 2


class ConfigError(UserError, ValueError):
  """A configuration value a user can fix: the message names the key and the fix."""


class DataError(UserError, ValueError):
  """Data or a tokenizer that does not fit the configuration."""


class MissingFileError(UserError, FileNotFoundError):
  """A configured path (data glob, tokenizer, checkpoint) that holds nothing usable."""


class MissingKeyError(UserError, KeyError):
  """A configured JSON key, parquet column or dataset feature that the data does not have."""

  def __str__(self) -> str:  # KeyError would quote the message
    return str(self.args[0]) if self.args else ""


class ConfigChanged(ConfigError):
  """A resume whose config differs from the one its checkpoints were trained with in fields that define
  the run; the message names each field (old -> new) and the flag that accepts the change."""


class WorkdirInUse(UserError, RuntimeError):
  """Another process holds the run directory; the message names it (pid, host, since when). The exit
  code is sysexits' EX_TEMPFAIL (try again later), so that a caller tells it from a failed run."""

  exit_code = 75


class Diverged(UserError, FloatingPointError):
  """Training produced a non-finite loss; checkpoints already written are kept."""

  exit_code = 3
