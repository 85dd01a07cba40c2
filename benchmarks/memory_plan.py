"""Where a compiled program's peak memory goes, read from XLA's own dumps of its buffer assignment.

With ``--xla_dump_to=DIR`` in ``XLA_FLAGS`` (set before JAX starts a backend) XLA writes, per compiled
module, the optimised HLO (``*after_optimizations.txt``) and the live ranges of its buffers
(``*after_optimizations-live-range.txt``), whose "Live ranges at N (peak)" section lists every buffer
live at the program point of peak use. ``peak_buffers`` joins the two: each live buffer gets the shape
of the HLO value it holds and the JAX name of the op that made it (``metadata={op_name=...}``: the
named scopes ``mixer`` / ``mlp`` and the primitive, e.g. ``jvp(mlp)/dot_general``), and the buffers
are grouped by (op, shape). The program's arguments (parameters, optimizer state, batch) are one group.
CPU, GPU and TPU compilers write the same files.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re

_LIVE = re.compile(r"^\s+(\S+?)(?:\{(\d*)\})?: (\d+) bytes")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([\w-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_LAYOUT = re.compile(r"\{[^{}]*\}")


@dataclasses.dataclass(frozen=True)
class Group:
  op: str  # the JAX op name of the buffers' values, "" when XLA made them (copies, its own fusions)
  shape: str  # e.g. "bf16[32,2048,4096]"
  count: int
  bytes: int


def dump_files(dump_dir: str, module: str = "train_step") -> tuple[str, str]:
  """The live-range report and the optimised HLO of the largest dumped module whose name has
  ``module`` (a compile may dump small helper modules too)."""
  reports = glob.glob(os.path.join(dump_dir, f"*{module}*after_optimizations-live-range.txt"))
  if not reports:
    raise FileNotFoundError(f"no live-range report of a module named like {module!r} in {dump_dir}")
  report = max(reports, key=os.path.getsize)
  return report, report.replace("-live-range.txt", ".txt")


def _shape(text: str, index: str | None) -> str:
  """The array shape of an HLO result type, element ``index`` of a tuple, layouts removed."""
  text = _LAYOUT.sub("", text.replace("/*index=", "").replace("*/", ""))
  if text.startswith("("):
    parts = [p.strip() for p in text[1:-1].split(", ")]
    parts = [re.sub(r"^\d+", "", p) for p in parts]  # the index markers left by "/*index=5*/"
    return parts[int(index)] if index and int(index) < len(parts) else text
  return text


ARGUMENTS = "(arguments: parameters, optimizer state, batch)"


def _instructions(hlo_path: str) -> dict[str, tuple[str, str]]:
  """Instruction name -> (result type, JAX op name) for every instruction of the optimised HLO; the
  entry computation's parameters are ``ARGUMENTS``."""
  found, entry = {}, False
  with open(hlo_path) as f:
    for line in f:
      if line.startswith(("ENTRY ", "}")):
        entry = line.startswith("ENTRY ")
      match = _INSTRUCTION.match(line)
      if match:
        op = _OP_NAME.search(line)
        argument = entry and match.group(3) == "parameter"
        found[match.group(1)] = (match.group(2), ARGUMENTS if argument else op.group(1) if op else "")
  return found


def _short_op(op: str) -> str:
  """The op name without the jit prefix: "jit(train_step)/jvp(mlp)/dot_general" -> "jvp(mlp)/dot_general"."""
  return op.split("/", 1)[1] if op.startswith("jit(") and "/" in op else op


def peak_buffers(dump_dir: str, module: str = "train_step") -> tuple[int, list[Group]]:
  """The bytes live at the peak and their groups by (op, shape), largest first."""
  report, hlo = dump_files(dump_dir, module)
  instructions = _instructions(hlo)
  groups: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
  total, in_peak = 0, False
  with open(report) as f:
    for line in f:
      if "Live ranges at" in line:
        in_peak = "(peak)" in line
        continue
      if in_peak and not _LIVE.match(line):
        if line.strip():
          break
        continue
      if not in_peak:
        continue
      name, index, size = _LIVE.match(line).groups()
      result, op = instructions.get(name, ("?", name))
      key = (ARGUMENTS, "") if op == ARGUMENTS else (_short_op(op), _shape(result, index))
      groups[key][0] += 1
      groups[key][1] += int(size)
      total += int(size)
  ordered = sorted((Group(op, shape, n, size) for (op, shape), (n, size) in groups.items()),
                   key=lambda g: -g.bytes)
  return total, ordered


def table(total: int, groups: list[Group], top: int = 20) -> str:
  """The ``top`` groups as Markdown: GiB, share of the peak, buffers, shape, op."""
  gib = 2 ** 30
  lines = [f"peak: {total / gib:.2f} GiB live", "", "| GiB | share | buffers | shape | op |", "|---|---|---|---|---|"]
  for g in groups[:top]:
    lines.append(f"| {g.bytes / gib:.2f} | {100 * g.bytes / total:.1f}% | {g.count} | {g.shape} | "
                 f"{g.op or '(XLA)'} |")
  rest = sum(g.bytes for g in groups[top:])
  if rest:
    lines.append(f"| {rest / gib:.2f} | {100 * rest / total:.1f}% | {sum(g.count for g in groups[top:])} | "
                 f"(the other {len(groups) - top} groups) | |")
  return "\n".join(lines)
