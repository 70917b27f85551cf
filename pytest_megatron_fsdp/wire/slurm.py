"""srun-launched ranks: an srun step's Slurm variables mapped to the ones torchrun gives its ranks.

``srun --ntasks=N pytest ...`` starts N copies of pytest with Slurm's task variables and none of
torchrun's. In a step of more than one task, every task is a rank of one torchrun-mode session:

=====================  =============================================================================
torchrun's variable    from Slurm's
=====================  =============================================================================
``RANK``               ``SLURM_PROCID``
``WORLD_SIZE``         ``SLURM_STEP_NUM_TASKS`` (srun sets it for its step; ``SLURM_NTASKS`` agrees)
``LOCAL_RANK``         ``SLURM_LOCALID``
``LOCAL_WORLD_SIZE``   this node's entry (``SLURM_NODEID``) of ``SLURM_STEP_TASKS_PER_NODE`` (else
                       ``SLURM_TASKS_PER_NODE``; ``2(x3),1`` is 2, 2, 2, 1), else
                       ``SLURM_NTASKS_PER_NODE``, else ``WORLD_SIZE`` on a one-node step
``MASTER_ADDR``        ``MASTER_ADDR`` if set, else the first host of ``SLURM_STEP_NODELIST`` (else
                       ``SLURM_JOB_NODELIST`` / ``SLURM_NODELIST``; ``node[01-03,07],gpu5`` starts
                       with ``node01``): task 0 runs there under srun's block distribution
``MASTER_PORT``        ``MASTER_PORT`` if set, else ``20000 + SLURM_JOB_ID mod 10000`` (20000-29999,
                       below Linux's ephemeral ports 32768-60999)
=====================  =============================================================================

Only a step is mapped: ``SLURM_STEP_NUM_TASKS``, which srun sets and an sbatch script's own
environment lacks, must be more than 1, ``SLURM_PROCID`` and ``SLURM_LOCALID`` set, and
``RANK`` unset (torchrun's variables win: a rank set torchrun starts inside a Slurm job is
torchrun's). ``srun --ntasks=1 pytest`` and ``pytest`` in a batch script (``#SBATCH
--ntasks=8`` included) are plain sessions, which launch their own rank sets.

Plain string parsing, no ``scontrol`` and no torch: :func:`step_of` is called where the role is
decided (``wire.role.decide``), and only there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from .torchrun_env import TorchrunEnv

#: derived rendezvous ports: PORT_BASE + SLURM_JOB_ID mod PORT_SPAN
PORT_BASE = 20000
PORT_SPAN = 10000
#: the variables that name the step's hosts, the most specific first
NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
#: the variables that give the tasks per node, the most specific first
TASKS_PER_NODE_VARIABLES = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


class SlurmError(ValueError):
    """A Slurm variable this mapping cannot use: one line naming it, its value and the fix."""


@dataclass(frozen=True)
class SlurmStep:
    """This task's place in its srun step, in torchrun's terms."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_id: int
    master_addr: str
    master_port: int
    #: where the address and port came from, for the session header and error messages
    master_source: str

    def torchrun_variables(self) -> dict[str, str]:
        """The variables torchrun would have given this rank."""
        rank = TorchrunEnv(
            self.rank,
            self.world_size,
            self.local_rank,
            self.local_world_size,
            self.master_addr,
            self.master_port,
        )
        return rank.environ()

    def describe(self) -> str:
        return (
            f"srun task {self.rank} of {self.world_size} (node {self.node_id}, local task "
            f"{self.local_rank} of {self.local_world_size}), rendezvous {self.master_addr}:"
            f"{self.master_port} ({self.master_source})"
        )


def _split_top_level(text: str) -> list[str]:
    """``a[1-2],b,c[3,5]`` -> ``['a[1-2]', 'b', 'c[3,5]']``: commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise SlurmError(f"unbalanced ']' at position {i}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise SlurmError("unbalanced '['")
    parts.append(text[start:])
    return parts


def _expand_range(spec: str) -> list[str]:
    """``01-03`` -> 01, 02, 03 (zero padding kept); ``7`` -> 7."""
    low, sep, high = spec.partition("-")
    if not low.isdigit() or (sep and not high.isdigit()):
        raise SlurmError(f"bad range {spec!r} in brackets (expected N or N-M)")
    if not sep:
        return [low]
    if int(high) < int(low):
        raise SlurmError(f"bad range {spec!r}: it counts down")
    width = len(low) if low.startswith("0") else 0
    return [str(n).zfill(width) for n in range(int(low), int(high) + 1)]


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list, expanded in order: ``node[01-03,07],gpu5`` -> ``node01,
    node02, node03, node07, gpu5``; several bracket groups multiply (``r[1-2]n[1-2]`` -> r1n1,
    r1n2, r2n1, r2n2). Raises :class:`SlurmError` on a malformed list."""
    hosts: list[str] = []
    for part in _split_top_level(text.strip()):
        if not part:
            raise SlurmError(f"empty host name in {text!r}")
        expanded = [""]
        for literal, bracket in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", part):
            if not literal and not bracket:
                continue
            choices = [v for spec in bracket.split(",") for v in _expand_range(spec)] if bracket else [""]
            expanded = [f"{head}{literal}{choice}" for head in expanded for choice in choices]
        hosts.extend(expanded)
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE``'s form, one count per node in host-list order: ``2(x3),1`` -> 2, 2,
    2, 1."""
    counts: list[int] = []
    for part in text.strip().split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise SlurmError(f"bad entry {part!r} (expected N or N(xK))")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def port_for_job(job_id: str) -> int:
    """The rendezvous port derived from the job id (every task of the job derives the same)."""
    digits = re.match(r"\d+", job_id.strip())
    if digits is None:
        raise SlurmError(f"SLURM_JOB_ID={job_id!r} is not a job number: set MASTER_PORT for the step")
    return PORT_BASE + int(digits[0]) % PORT_SPAN


def _int(environ: Mapping[str, str], name: str, minimum: int = 0) -> int:
    raw = environ[name]
    try:
        value = int(raw.strip())
    except ValueError:
        raise SlurmError(f"{name}={raw!r} is not a whole number (an srun task's Slurm variables?)") from None
    if value < minimum:
        raise SlurmError(f"{name}={raw!r} must be {minimum} or more")
    return value


def in_multi_task_step(environ: Mapping[str, str]) -> bool:
    """Whether this process is one task of an srun step of more than one task, with no torchrun
    variables of its own (see the module's docstring)."""
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return False
    if not all(name in environ for name in ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID")):
        return False
    try:
        return int(environ["SLURM_STEP_NUM_TASKS"].strip()) > 1
    except ValueError:
        return True  # a step whose count is unreadable: step_of names it


def step_of(environ: Mapping[str, str]) -> SlurmStep | None:
    """This task's :class:`SlurmStep`, or None outside a multi-task srun step. Raises
    :class:`SlurmError` (one line) where the step's variables cannot be mapped."""
    if not in_multi_task_step(environ):
        return None
    world = _int(environ, "SLURM_STEP_NUM_TASKS", minimum=1)
    rank = _int(environ, "SLURM_PROCID")
    if rank >= world:
        raise SlurmError(f"SLURM_PROCID={rank} is not below SLURM_STEP_NUM_TASKS={world}")
    local_rank = _int(environ, "SLURM_LOCALID")
    node_id = _int(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0
    local_world = _local_world_size(environ, world, node_id)
    if local_rank >= local_world:
        raise SlurmError(
            f"SLURM_LOCALID={local_rank} is not below this node's task count {local_world} "
            f"(from {_tasks_per_node_source(environ)})"
        )
    master_addr, addr_source = _master_addr(environ)
    if environ.get("MASTER_PORT"):
        port, port_source = _int(environ, "MASTER_PORT", minimum=1), "MASTER_PORT"
    elif environ.get("SLURM_JOB_ID"):
        port, port_source = port_for_job(environ["SLURM_JOB_ID"]), "derived from SLURM_JOB_ID"
    else:
        raise SlurmError("no SLURM_JOB_ID to derive the rendezvous port from: set MASTER_PORT for the step")
    if port > 65535:
        raise SlurmError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    return SlurmStep(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_id=node_id,
        master_addr=master_addr,
        master_port=port,
        master_source=f"{addr_source}, port {port_source}",
    )


def _tasks_per_node_source(environ: Mapping[str, str]) -> str:
    for name in (*TASKS_PER_NODE_VARIABLES, "SLURM_NTASKS_PER_NODE"):
        if environ.get(name):
            return f"{name}={environ[name]}"
    return "SLURM_STEP_NUM_TASKS on one node"


def _local_world_size(environ: Mapping[str, str], world: int, node_id: int) -> int:
    for name in TASKS_PER_NODE_VARIABLES:
        if environ.get(name):
            try:
                counts = expand_tasks_per_node(environ[name])
            except SlurmError as exc:
                raise SlurmError(f"{name}={environ[name]!r}: {exc}") from None
            if node_id >= len(counts):
                raise SlurmError(
                    f"SLURM_NODEID={node_id} has no entry in {name}={environ[name]!r} ({len(counts)} nodes)"
                )
            return counts[node_id]
    if environ.get("SLURM_NTASKS_PER_NODE"):
        return _int(environ, "SLURM_NTASKS_PER_NODE", minimum=1)
    return world


def _master_addr(environ: Mapping[str, str]) -> tuple[str, str]:
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"], "MASTER_ADDR"
    for name in NODELIST_VARIABLES:
        if environ.get(name):
            try:
                hosts = expand_nodelist(environ[name])
            except SlurmError as exc:
                raise SlurmError(f"{name}={environ[name]!r}: {exc}; set MASTER_ADDR for the step") from None
            return hosts[0], f"first host of {name}"
    raise SlurmError(
        "no SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST to find task 0's host: "
        "set MASTER_ADDR for the step"
    )


def rendezvous_hint(step: SlurmStep | None) -> str:
    """What to check when an srun step's tasks did not all reach the rendezvous."""
    if step is None:
        return ""
    return (
        f"this is {step.describe()}: every one of the step's {step.world_size} tasks must run pytest "
        "with the same arguments (to run pytest once, as a plain session that launches its own rank "
        "sets, start it without srun or with srun --ntasks=1)"
    )
