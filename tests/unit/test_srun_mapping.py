"""srun-launched ranks, in process: Slurm's host-list and tasks-per-node forms, the mapping to
torchrun's variables, when a process counts as a task of a multi-task step, and the role it gets."""

from __future__ import annotations

import pytest

from pytest_megatron_fsdp.wire import role as roles
from pytest_megatron_fsdp.wire import slurm


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node01", ["node01"]),
        ("localhost,127.0.0.1", ["localhost", "127.0.0.1"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a[1]-ib,b", ["a1-ib", "b"]),
        ("dgx-h100-[3,5]", ["dgx-h100-3", "dgx-h100-5"]),
        (" node[1-2] ", ["node1", "node2"]),
    ],
)
def test_host_lists_expand_in_order(text, hosts):
    assert slurm.expand_nodelist(text) == hosts


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("node[01-03", "unbalanced '['"),
        ("node01]", "unbalanced ']'"),
        ("node[3-1]", "counts down"),
        ("node[a-b]", "bad range 'a-b'"),
        ("node1,,node2", "empty host name"),
    ],
)
def test_malformed_host_lists_are_named(text, problem):
    with pytest.raises(slurm.SlurmError, match=problem.replace("[", r"\[")):
        slurm.expand_nodelist(text)


@pytest.mark.parametrize(
    ("text", "counts"),
    [("2", [2]), ("2(x3),1", [2, 2, 2, 1]), ("4,2(x2)", [4, 2, 2]), ("1(x1)", [1])],
)
def test_tasks_per_node_expand(text, counts):
    assert slurm.expand_tasks_per_node(text) == counts


def test_bad_tasks_per_node_is_named():
    with pytest.raises(slurm.SlurmError, match=r"bad entry '2\(3\)'"):
        slurm.expand_tasks_per_node("2(3)")


def test_the_derived_port_is_in_its_documented_range_and_shared_by_the_job():
    assert slurm.port_for_job("1234567") == 20000 + 4567
    assert slurm.port_for_job("40000") == 20000  # wraps
    assert slurm.port_for_job("123_4") == 20123  # an array task's id form: the digits before "_"
    ports = {slurm.port_for_job(str(job)) for job in range(0, 100000, 7)}
    assert min(ports) >= slurm.PORT_BASE
    assert max(ports) < slurm.PORT_BASE + slurm.PORT_SPAN < 32768
    with pytest.raises(slurm.SlurmError, match="set MASTER_PORT"):
        slurm.port_for_job("abc")


def _task(**overrides: str) -> dict[str, str]:
    """Task 3 of a 2x2 step on two nodes (what srun -N2 -n4 sets, among others)."""
    environ = {
        "SLURM_JOB_ID": "987654",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NODELIST": "gpu[01-08]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_TASKS_PER_NODE": "8(x8)",
    }
    environ.update(overrides)
    return {k: v for k, v in environ.items() if v is not None}


def test_a_task_of_a_two_node_step_maps_to_torchruns_variables():
    step = slurm.step_of(_task())
    assert step is not None
    assert step.torchrun_variables() == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07",  # the step's first node, not the job's
        "MASTER_PORT": str(20000 + 7654),
    }
    assert step.node_id == 1


def test_master_addr_and_port_given_win():
    step = slurm.step_of(_task(MASTER_ADDR="10.0.0.5", MASTER_PORT="29500"))
    assert (step.master_addr, step.master_port) == ("10.0.0.5", 29500)


@pytest.mark.parametrize(
    ("overrides", "local_world_size", "addr"),
    [
        # no step-specific lists: the job's (srun copies the step's into these too)
        ({"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_TASKS_PER_NODE": "1,3"}, 3, "gpu07"),
        (
            {"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_TASKS_PER_NODE": None, "SLURM_NTASKS_PER_NODE": "2"},
            2,
            "gpu07",
        ),
        ({"SLURM_STEP_NODELIST": None}, 2, "gpu01"),
        ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None, "SLURM_NODELIST": "x[5-6]"}, 2, "x5"),
    ],
)
def test_fallbacks(overrides, local_world_size, addr):
    step = slurm.step_of(_task(**overrides))
    assert (step.local_world_size, step.master_addr) == (local_world_size, addr)


def test_one_node_without_tasks_per_node_is_all_local():
    environ = _task(SLURM_STEP_TASKS_PER_NODE=None, SLURM_TASKS_PER_NODE=None, SLURM_NODEID="0")
    step = slurm.step_of({**environ, "SLURM_PROCID": "1"})
    assert (step.rank, step.local_world_size) == (1, 4)


@pytest.mark.parametrize(
    "environ",
    [
        {},  # no Slurm at all
        _task(SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0"),  # srun -n1
        # an sbatch script running pytest itself: the job's variables, no step's (--ntasks=4 or not)
        _task(SLURM_STEP_NUM_TASKS=None, SLURM_STEP_ID=None, SLURM_PROCID="0", SLURM_LOCALID="0"),
        _task(RANK="1", WORLD_SIZE="4"),  # torchrun inside a Slurm job: torchrun's variables win
        _task(SLURM_LOCALID=None),
    ],
    ids=["no-slurm", "srun-n1", "sbatch-script", "torchrun-inside", "no-localid"],
)
def test_outside_a_multi_task_step_nothing_is_mapped(environ):
    assert slurm.step_of(environ) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not a whole number"),
        ({"SLURM_PROCID": "4"}, "SLURM_PROCID=4 is not below SLURM_STEP_NUM_TASKS=4"),
        ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 is not below this node's task count 2"),
        ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 has no entry in SLURM_STEP_TASKS_PER_NODE"),
        ({"SLURM_STEP_NODELIST": "gpu[07-"}, "SLURM_STEP_NODELIST='gpu[07-': unbalanced"),
        (
            {"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None},
            "no SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST",
        ),
        ({"SLURM_JOB_ID": None}, "no SLURM_JOB_ID to derive the rendezvous port from: set MASTER_PORT"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
        ({"SLURM_STEP_NUM_TASKS": "four"}, "SLURM_STEP_NUM_TASKS='four' is not a whole number"),
    ],
)
def test_unusable_variables_are_named_in_one_line(overrides, message):
    with pytest.raises(slurm.SlurmError) as caught:
        slurm.step_of(_task(**overrides))
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


class _Config:
    """decide() asks the config only whether the parent launched this rank (it did not)."""

    def getoption(self, name, default=None):
        return default


def test_an_srun_task_is_a_torchrun_mode_rank_with_the_mapped_environment():
    role = roles.decide(_Config(), _task())
    assert role.role is roles.Role.TORCHRUN_RANK
    assert role.srun is not None
    t = role.torchrun
    assert (t.rank, t.world_size, t.local_rank, t.local_world_size) == (3, 4, 1, 2)
    assert (t.master_addr, t.master_port, t.agent_store) == ("gpu07", 27654, False)  # task 0 hosts the store
    assert "srun task 3 of 4" in t.launched_by


def test_an_sbatch_script_and_srun_n1_stay_plain_parents():
    for environ in (
        _task(SLURM_STEP_NUM_TASKS=None, SLURM_STEP_ID=None, SLURM_PROCID="0", SLURM_LOCALID="0"),
        _task(SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0"),
    ):
        assert roles.decide(_Config(), environ).role is roles.Role.PARENT


def test_bad_slurm_variables_are_a_usage_error():
    with pytest.raises(pytest.UsageError, match="an srun task's Slurm variables: SLURM_PROCID='x'"):
        roles.decide(_Config(), _task(SLURM_PROCID="x"))
