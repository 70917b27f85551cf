"""A stand-in for ``srun``: starts a step's tasks with the variables Slurm gives them, no Slurm needed.

    python tests/srun_sim.py --nodes 2 --ntasks-per-node 2 -- python -m pytest tests/x.py

Each "node" is a loopback address (127.0.0.1, 127.0.0.2, ...; the step's node list is given in
Slurm's compressed form, ``127.0.0.[1-2]``), each task a process with ``SLURM_PROCID``,
``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_NODELIST``,
``SLURM_STEP_TASKS_PER_NODE`` and the rest of what srun sets (tasks placed in blocks, as srun's
default distribution does: task 0 on the first node). By default it waits for every task, however
the others end, and exits with the highest exit code (a signal N counts as 128 + N): the ranks must
notice a peer that is gone by themselves. ``--kill-on-bad-exit`` (srun's ``-K``, Slurm's
KillOnBadExit) ends the step once a task exits non-zero or by a signal: the others get SIGTERM,
then SIGKILL after ``--kill-wait`` seconds (Slurm's KillWait).

For tests: ``--kill TASK:FILE`` sends SIGKILL to task TASK once FILE exists (a test writes it
mid-test); ``--timeout`` bounds the whole step (every task is killed past it, exit code 124).
Every task runs in its own process group, and the step's end kills what is left of each group.
It prints each task's output prefixed with its number (as ``srun --label``) after the step, and
one line per task: how it ended.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def slurm_environment(
    procid: int, nodes: int, per_node: int, job_id: int, base: dict[str, str]
) -> dict[str, str]:
    """What srun sets for task ``procid`` of a step of ``nodes`` x ``per_node`` tasks (block
    distribution), on loopback "nodes" 127.0.0.1 .. 127.0.0.N."""
    ntasks = nodes * per_node
    node = procid // per_node
    nodelist = "127.0.0.1" if nodes == 1 else f"127.0.0.[1-{nodes}]"
    tasks_per_node = f"{per_node}(x{nodes})" if nodes > 1 else str(per_node)
    env = {k: v for k, v in base.items() if not k.startswith("SLURM_")}
    env.update(
        {
            "SLURM_JOB_ID": str(job_id),
            "SLURM_JOBID": str(job_id),
            "SLURM_STEP_ID": "0",
            "SLURM_STEPID": "0",
            "SLURM_NTASKS": str(ntasks),
            "SLURM_NPROCS": str(ntasks),
            "SLURM_STEP_NUM_TASKS": str(ntasks),
            "SLURM_NNODES": str(nodes),
            "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_STEP_NUM_NODES": str(nodes),
            "SLURM_NODELIST": nodelist,
            "SLURM_JOB_NODELIST": nodelist,
            "SLURM_STEP_NODELIST": nodelist,
            "SLURM_TASKS_PER_NODE": tasks_per_node,
            "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
            "SLURM_PROCID": str(procid),
            "SLURM_LOCALID": str(procid % per_node),
            "SLURM_NODEID": str(node),
            "SLURMD_NODENAME": f"127.0.0.{node + 1}",
        }
    )
    return env


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def describe(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def run_step(
    command: list[str],
    nodes: int,
    per_node: int,
    job_id: int,
    kill: tuple[int, Path] | None = None,
    kill_on_bad_exit: bool = False,
    kill_wait: float = 30.0,
    timeout: float = 600.0,
) -> tuple[int, list[str], list[int | None]]:
    """Run the step; (srun's exit code, each task's output, each task's return code)."""
    ntasks = nodes * per_node
    outputs = [tempfile.TemporaryFile(mode="w+") for _ in range(ntasks)]  # noqa: SIM115 - closed after the step
    tasks = [
        subprocess.Popen(
            command,
            env=slurm_environment(procid, nodes, per_node, job_id, dict(os.environ)),
            stdout=outputs[procid],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for procid in range(ntasks)
    ]
    started = time.monotonic()
    terminating_since: float | None = None
    timed_out = False
    try:
        while any(t.poll() is None for t in tasks):
            if kill is not None and kill[1].exists() and tasks[kill[0]].poll() is None:
                tasks[kill[0]].send_signal(signal.SIGKILL)
                kill = None
            codes = [t.poll() for t in tasks]
            bad = kill_on_bad_exit and any(c not in (None, 0) for c in codes)
            if bad and terminating_since is None:
                terminating_since = time.monotonic()
                for t in tasks:
                    if t.poll() is None:
                        _kill_group(t, signal.SIGTERM)
            if terminating_since is not None and time.monotonic() - terminating_since > kill_wait:
                for t in tasks:
                    _kill_group(t, signal.SIGKILL)
            if time.monotonic() - started > timeout:
                timed_out = True
                for t in tasks:
                    _kill_group(t, signal.SIGKILL)
                for t in tasks:
                    t.wait()
                break
            time.sleep(0.05)
    finally:
        for t in tasks:  # the step is over: nothing of it stays (what a task left in its group too)
            _kill_group(t, signal.SIGKILL)
            if t.poll() is None:
                t.kill()
            t.wait()
    texts = []
    for output in outputs:
        output.seek(0)
        texts.append(output.read())
        output.close()
    codes = [t.returncode for t in tasks]
    if timed_out:
        return 124, texts, codes
    worst = max((128 - c if c < 0 else c) for c in codes)
    return worst, texts, codes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--ntasks-per-node", type=int, default=2)
    parser.add_argument("--job-id", type=int, default=4242)
    parser.add_argument("--kill", metavar="TASK:FILE", help="SIGKILL task TASK once FILE exists")
    parser.add_argument("--kill-on-bad-exit", action="store_true", help="srun -K")
    parser.add_argument("--kill-wait", type=float, default=30.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command (put it after --)")
    kill = None
    if args.kill:
        task, _, path = args.kill.partition(":")
        kill = (int(task), Path(path))
    code, texts, codes = run_step(
        command,
        args.nodes,
        args.ntasks_per_node,
        args.job_id,
        kill,
        args.kill_on_bad_exit,
        args.kill_wait,
        args.timeout,
    )
    for procid, text in enumerate(texts):
        for line in text.splitlines():
            print(f"{procid}: {line}")
    for procid, returncode in enumerate(codes):
        print(f"srun-sim: task {procid}: {describe(returncode)}")
    if code == 124:
        print(f"srun-sim: step timed out after {args.timeout:g} s")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
