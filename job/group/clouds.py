"""The platforms that start one command per machine: Kubernetes (Kubeflow Trainer v2, the training-operator's
PyTorchJob, JobSet and Indexed Jobs), Google Cloud (Vertex AI, Cloud Batch) and SkyPilot; and Colab, known by name."""

from __future__ import annotations

import json
from collections.abc import Mapping

from job.errors import ConfigError
from job.group.place import DEFAULT_PORT, Place, number, picked, picked_only, within, worker

PET = (
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "PET_RDZV_ENDPOINT",
    "PET_RDZV_BACKEND",
    "PET_MAX_RESTARTS",
)


def kubeflow(env: Mapping[str, str]) -> Place | None:
    """PET_* variables, which torchrun reads, as the Kubeflow operators set them on every pod: Kubeflow Trainer v2's
    TrainJob (its pods belong to a JobSet's Indexed Job: JOB_COMPLETION_INDEX) or the
    training-operator's PyTorchJob (a Master and Workers: MASTER_ADDR, WORLD_SIZE counting pods, RANK the pod's).
    PET_NNODES 'min:max' with PET_RDZV_ENDPOINT: PyTorchJob's elastic policy. Trainer v2 meets at PET_MASTER_ADDR
    (`<trainjob>-node-0-0.<trainjob>`, port 29500), PyTorchJob at its master pod (port 23456 by default)."""
    if "PET_NNODES" not in env and "PET_NODE_RANK" not in env:
        return None
    # Trainer v2's pods are a JobSet's Indexed Job's (JOB_COMPLETION_INDEX) and get no WORLD_SIZE; PyTorchJob's pods
    # get WORLD_SIZE and RANK, which torchrun shadows in its workers
    trainer = "JOB_COMPLETION_INDEX" in env or not worker(env) and "WORLD_SIZE" not in env
    name = "Kubeflow Trainer (TrainJob)" if trainer else "PyTorchJob (Kubeflow training-operator)"
    variables = picked(
        env, PET + (("JOB_COMPLETION_INDEX",) if trainer else ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"))
    )
    nodes_text = env.get("PET_NNODES", "1").strip()
    elastic = None
    if ":" in nodes_text:
        low, _, high = nodes_text.partition(":")
        if not (low.isdigit() and high.isdigit() and 0 < int(low) <= int(high)):
            raise ConfigError(f"PET_NNODES={nodes_text!r}: expected a number of machines, or min:max")
        elastic, nodes = (int(low), int(high)), int(high)
    else:
        nodes = number(env, "PET_NNODES", 1)
    rank = number(env, "PET_NODE_RANK", number(env, "JOB_COMPLETION_INDEX", 0) if trainer else number(env, "RANK", 0))
    if elastic is None:
        within("PET_NODE_RANK", rank, nodes, "PET_NNODES")
    endpoint = env.get("PET_RDZV_ENDPOINT", "") if elastic else ""
    addr = endpoint.rpartition(":")[0] if endpoint else env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR")
    port_name = "PET_MASTER_PORT" if "PET_MASTER_PORT" in env else "MASTER_PORT"
    port = (
        int(endpoint.rpartition(":")[2])
        if endpoint.rpartition(":")[2].isdigit()
        else number(env, port_name, DEFAULT_PORT)
    )
    if not addr:
        raise ConfigError(f"{name}: PET_NNODES={nodes_text} but no PET_MASTER_ADDR names the first machine")
    if not trainer and not worker(env) and "WORLD_SIZE" in env and elastic is None:
        # the operator counts pods in WORLD_SIZE and gives the pod's index in RANK: both must say what PET_* say
        pods, pod = number(env, "WORLD_SIZE"), number(env, "RANK", rank)
        per = env.get("PET_NPROC_PER_NODE", "auto")
        if pod != rank or pods not in (nodes, nodes * int(per) if per.isdigit() else nodes):
            raise ConfigError(
                f"PyTorchJob's variables disagree: WORLD_SIZE={pods} RANK={pod} but PET_NNODES={nodes_text} "
                f"PET_NODE_RANK={rank}: set one layout (docs/distributed.md)"
            )
    return Place(
        name, nodes, rank, addr, port, env.get("PET_NPROC_PER_NODE") or None, elastic=elastic, variables=variables
    )


def jobset(env: Mapping[str, str]) -> Place | None:
    """A pod of an Indexed Job (JOB_COMPLETION_INDEX, which Kubernetes sets; a JobSet's Jobs are Indexed Jobs): this
    machine's rank is its completion index, and the machines meet on the pod of index 0, named as the headless
    service names pods: this pod's host name with its index made 0 (`<jobset>-<job>-0-3` -> `<jobset>-<job>-0-0`,
    `<job>-3` -> `<job>-0`), in this pod's domain. Neither says how many machines there are: --nnodes does."""
    if "JOB_COMPLETION_INDEX" not in env:
        return None
    rank = number(env, "JOB_COMPLETION_INDEX")
    host = env.get("HOSTNAME", "")
    base, _, index = host.rpartition("-")
    addr = "127.0.0.1"
    if base and index == str(rank):
        addr = f"{base}-0"
        domain = pod_domain(host)
        addr += f".{domain}" if domain else ""
    return Place(
        "Kubernetes Indexed Job",
        None,
        rank,
        addr,
        DEFAULT_PORT,
        variables=picked(env, ("JOB_COMPLETION_INDEX", "HOSTNAME")),
    )


def pod_domain(host: str) -> str:
    """The domain of this pod's name in its headless service (`<subdomain>.<namespace>.svc...`), '' where the
    name has none (no subdomain set)."""
    import socket

    try:
        full = socket.getfqdn(host)
    except OSError:
        return ""
    return full[len(host) + 1 :] if full.startswith(host + ".") else ""


# --- Google Cloud and SkyPilot


def skypilot(env: Mapping[str, str]) -> Place | None:
    if "SKYPILOT_NODE_RANK" not in env:
        return picked_only(env, "SkyPilot", ("SKYPILOT_TASK_ID",))
    ips = env.get("SKYPILOT_NODE_IPS", "").split()
    nodes = number(env, "SKYPILOT_NUM_NODES", len(ips) or 1)
    gpus = number(env, "SKYPILOT_NUM_GPUS_PER_NODE", 0)
    rank = number(env, "SKYPILOT_NODE_RANK")
    variables = picked(env, ("SKYPILOT_TASK_ID", "SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES"))
    return Place(
        "SkyPilot", nodes, rank, ips[0] if ips else "127.0.0.1", None, str(gpus) if gpus else None, variables=variables
    )


def cloud_batch(env: Mapping[str, str]) -> Place | None:
    """Cloud Batch: a task group with requireHostsFile (BATCH_HOSTS_FILE) is a group of machines; tasks alone
    (BATCH_TASK_INDEX) are named, each its own run or part."""
    keys = ("BATCH_TASK_INDEX", "BATCH_TASK_COUNT", "BATCH_TASK_RETRY_ATTEMPT", "BATCH_HOSTS_FILE")
    if "BATCH_HOSTS_FILE" not in env:
        return picked_only(env, "Cloud Batch", keys)
    try:
        with open(env["BATCH_HOSTS_FILE"]) as f:
            hosts = f.read().split()
    except OSError as e:
        raise ConfigError(f"BATCH_HOSTS_FILE={env['BATCH_HOSTS_FILE']}: cannot read it: {e.strerror}") from None
    if not hosts:
        raise ConfigError(f"BATCH_HOSTS_FILE={env['BATCH_HOSTS_FILE']}: lists no hosts")
    rank = number(env, "BATCH_TASK_INDEX", 0)
    within("BATCH_TASK_INDEX", rank, len(hosts), "hosts in BATCH_HOSTS_FILE")
    return Place("Cloud Batch", len(hosts), rank, hosts[0], variables=picked(env, keys))


def vertex(env: Mapping[str, str]) -> Place | None:
    """Vertex AI: CLUSTER_SPEC ({"cluster": {"workerpool0": ["host:port"], ...}, "task": {"type": "workerpool1",
    "index": 0}}: the machines in pool order, workerpool0's first being the first node; MASTER_ADDR and MASTER_PORT,
    where Vertex sets them, name it too), or MASTER_ADDR with WORLD_SIZE and RANK counting machines where no other
    platform (and no torchrun) set them (Volcano's pytorch plugin sets them so too: VC_TASK_INDEX names it); its
    job and trial ids alone name it."""
    keys = ("CLOUD_ML_JOB_ID", "CLOUD_ML_TRIAL_ID")
    if "CLUSTER_SPEC" in env:
        try:
            spec = json.loads(env["CLUSTER_SPEC"])
            pools = sorted((k for k in spec["cluster"] if k.startswith("workerpool")), key=lambda k: int(k[10:]))
            hosts = [h for k in pools for h in spec["cluster"][k]]
            task = spec["task"]
            rank = sum(len(spec["cluster"][k]) for k in pools[: pools.index(task["type"])]) + int(task["index"])
            first, _, port = hosts[0].rpartition(":")
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise ConfigError(f"CLUSTER_SPEC: not Vertex AI's cluster description ({type(e).__name__}: {e})") from None
        within("CLUSTER_SPEC's task", rank, len(hosts), "machines in it")
        addr = env.get("MASTER_ADDR") or first
        port_n = number(env, "MASTER_PORT", int(port) if port.isdigit() else DEFAULT_PORT)
        return Place("Vertex AI", len(hosts), rank, addr, port_n, variables=picked(env, keys))
    bare = all(k in env for k in ("MASTER_ADDR", "WORLD_SIZE", "RANK"))
    others = "SLURM_JOB_ID" in env or "RAY_RAYLET_PID" in env or any(k.startswith("PET_") for k in env)
    if bare and not worker(env) and not others:  # (an sbatch script may export them for its own use)
        nodes, rank = number(env, "WORLD_SIZE"), number(env, "RANK")
        within("RANK", rank, nodes, "WORLD_SIZE")
        port = number(env, "MASTER_PORT", DEFAULT_PORT)
        volcano = "VC_TASK_INDEX" in env or "VK_TASK_INDEX" in env  # Volcano's pytorch plugin counts pods alike
        name = "Volcano" if volcano and not any(k in env for k in keys) else "Vertex AI"
        return Place(
            name,
            nodes,
            rank,
            env["MASTER_ADDR"],
            port,
            variables=picked(env, (*keys, "MASTER_ADDR", "WORLD_SIZE", "RANK", "VC_TASK_INDEX", "VK_TASK_INDEX")),
        )
    return picked_only(env, "Vertex AI", keys)


def colab(env: Mapping[str, str]) -> Place | None:
    return picked_only(env, "Colab", ("COLAB_RELEASE_TAG", "COLAB_GPU"))
