"""The TF_CONFIG each worker starts with: free ports, --hosts, GPUs per worker, SLURM."""

import json
import os

import pytest

from kerasmulti._src.multi_worker import tf_config as _tf_config
from kerasmulti._src.multi_worker.tf_config import LaunchError


@pytest.mark.parametrize("hosts", [",", "", " , "])
def test_hosts_that_name_no_worker_are_refused_before_the_index_is_checked(hosts):
    with pytest.raises(LaunchError, match=rf"^--hosts names no worker\. List each as host:port, e.g\. --hosts a:2222,b:2222\. Received: hosts='{hosts}'$"):
        _tf_config.parse_hosts(hosts, 0)


def test_free_ports_are_distinct():
    ports = _tf_config.free_ports(5)
    assert len(set(ports)) == 5


def test_tf_config_names_the_cluster_and_this_worker():
    config = json.loads(_tf_config.tf_config(["a:1", "b:2"], 1))
    assert config == {"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}}


def test_each_local_worker_gets_its_own_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _tf_config.gpus_per_worker(3, 2, gpus=6) == ["0,1", "2,3", "4,5"]
    assert _tf_config.gpus_per_worker(2, 1, gpus=4) == ["0", "1"]  # the rest stay unused
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert _tf_config.gpus_per_worker(2, 1, gpus=2) == ["3", "5"]  # of those already visible
    hosts = ["localhost:1", "localhost:2"]
    env = _tf_config.worker_environment(hosts, 1, ["3", "5"])
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and json.loads(env["TF_CONFIG"])["task"]["index"] == 1
    assert "CUDA_VISIBLE_DEVICES" not in _tf_config.worker_environment(hosts, 1, None)


def test_without_gpus_one_device_per_worker_is_what_there_is():
    assert _tf_config.gpus_per_worker(2, None, gpus=0) is None
    assert _tf_config.gpus_per_worker(2, 1, gpus=0) is None  # one replica per worker on the CPU anyway


def test_more_devices_per_worker_without_gpus_is_refused():
    with pytest.raises(LaunchError, match=r"start more workers instead \(workers=6\).*Received: devices_per_worker=2"):
        _tf_config.gpus_per_worker(3, 2, gpus=0)


@pytest.mark.parametrize(
    "visible, gpus, message",
    [
        ("3,5", 2, r"need 4 GPUs, but CUDA_VISIBLE_DEVICES makes 2 visible \(3,5\)"),
        (None, 3, "need 4 GPUs, but this machine has 3"),
    ],
)
def test_devices_per_worker_beyond_the_gpus_is_refused(monkeypatch, visible, gpus, message):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if visible:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(LaunchError, match=f"{message}.*Received: devices_per_worker=2"):
        _tf_config.gpus_per_worker(2, 2, gpus=gpus)


def _slurm_step(monkeypatch, rank, nodes="localhost", tasks_per_node="2", tasks="2", **more):
    for name in ("SLURM_JOB_ID", "SLURMD_NODENAME", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    variables = {
        "SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": tasks,
        "SLURM_STEP_NODELIST": nodes, "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, **more,
    }
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def test_a_slurm_task_is_the_worker_of_its_rank(monkeypatch):
    _slurm_step(monkeypatch, 3, nodes="node[07-08]", tasks_per_node="2(x2)", tasks="4", SLURM_JOB_ID="4242")
    assert _tf_config.in_slurm_step()
    port = 15000 + 8 * (4242 % 2000)
    config = json.loads(_tf_config.slurm_tf_config())
    assert config["cluster"]["worker"] == [f"node07:{port}", f"node07:{port + 1}", f"node08:{port}", f"node08:{port + 1}"]
    assert config["task"] == {"type": "worker", "index": 3}
    assert json.loads(_tf_config.slurm_tf_config(port=2222))["cluster"]["worker"][1] == "node07:2223"
    # The resolver assigns no GPUs: a task keeps those srun gave it.
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_jobs_that_share_a_node_get_ports_of_their_own(monkeypatch):
    ports = []
    for job in ("100", "101"):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        ports.append(_tf_config.slurm_port())
    assert ports[1] - ports[0] == _tf_config.SLURM_PORTS_PER_JOB and max(ports) < 32768


def test_a_slurm_step_without_its_node_list_is_refused(monkeypatch):
    _slurm_step(monkeypatch, 0)
    monkeypatch.delenv("SLURM_STEP_NODELIST")
    with pytest.raises(LaunchError, match="SLURM_STEP_NODELIST not found.*under srun.*Received: SLURM_STEP_NODELIST=None"):
        _tf_config.slurm_tf_config()


@pytest.mark.parametrize(
    "nodes, tasks_per_node, placed",
    [
        ("node[1-2]", "2(x2)", ["node1", "node1", "node2", "node2"]),  # srun's default, block
        ("node[1-2]", "2(x2)", ["node1", "node2", "node1", "node2"]),  # --distribution=cyclic
        ("node[9-10]", "2(x2)", ["node9", "node9", "node10", "node10"]),  # name order is not node order
    ],
)
def test_every_task_of_a_slurm_step_is_the_worker_at_its_own_address(monkeypatch, nodes, tasks_per_node, placed):
    configs = []
    for rank, node in enumerate(placed):
        local = placed[:rank].count(node)
        _slurm_step(monkeypatch, rank, nodes, tasks_per_node, "4", SLURMD_NODENAME=node, SLURM_LOCALID=str(local))
        configs.append(json.loads(_tf_config.slurm_tf_config(port=2222)))
    hosts = configs[0]["cluster"]["worker"]
    assert all(config["cluster"]["worker"] == hosts for config in configs)  # one cluster
    indices = [config["task"]["index"] for config in configs]
    assert sorted(indices) == [0, 1, 2, 3]
    for rank, node in enumerate(placed):
        assert hosts[indices[rank]] == f"{node}:{2222 + placed[:rank].count(node)}"


@pytest.mark.parametrize("rank", ["5", "2", "-1"])
def test_a_slurm_rank_outside_the_steps_tasks_is_refused(monkeypatch, rank):
    _slurm_step(monkeypatch, rank)
    with pytest.raises(LaunchError, match=rf"rank is not one of the job step's 2 task\(s\) \(0 to 1\).*Received: SLURM_PROCID='{rank}'"):
        _tf_config.slurm_tf_config()


def test_a_slurm_task_on_a_node_outside_its_step_is_refused(monkeypatch):
    _slurm_step(monkeypatch, 1, nodes="node[1-2]", tasks_per_node="1(x2)", SLURMD_NODENAME="node2.cluster", SLURM_LOCALID="0")
    with pytest.raises(LaunchError, match=r"not among the job step's nodes \(node1, node2\).*Received: SLURMD_NODENAME='node2.cluster'"):
        _tf_config.slurm_tf_config()


@pytest.mark.parametrize(
    "rank, local, message",
    [
        ("5", "5", r"rank is not one of the job step's 2 task\(s\) \(0 to 1\).*Received: SLURM_PROCID='5'"),
        ("1", "5", r"local id on vm is not one of the step's 2 task\(s\) there \(0 to 1\)\. "
                   r"Run directly under srun.*Received: SLURM_LOCALID='5'"),
        ("1", "x", r"local id on vm is not one of the step's 2 task\(s\).*Received: SLURM_LOCALID='x'"),
    ],
)
def test_a_slurm_task_whose_rank_or_local_id_is_out_of_range_is_refused(monkeypatch, rank, local, message):
    # Its node is the step's: the refusal names the number that is wrong, not the node.
    _slurm_step(monkeypatch, rank, nodes="vm", SLURMD_NODENAME="vm", SLURM_LOCALID=local)
    with pytest.raises(LaunchError, match=message):
        _tf_config.slurm_tf_config()


def test_the_launcher_loads_without_tensorflow():
    # `kerasmulti launch` only starts processes: TensorFlow (seconds, and a
    # GPU driver a forked worker could not use) loads in the workers.
    import subprocess
    import sys

    script = (
        "import sys; from kerasmulti._src.commands import launch; "
        "from kerasmulti._src.multi_worker import supervisor, tf_config; "
        # `launch()` too (a notebook's kernel, before it forks): its ClusterError loaded TensorFlow.
        "import kerasmulti; kerasmulti.launch; print('tensorflow' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False"]
