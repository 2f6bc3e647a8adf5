"""``TOKENRELAY_TEST_BACKEND=docker``: a Redis 7 cluster in containers via testcontainers.

Six ``redis:7.2`` containers on the host network (so the addresses the nodes announce
are the ones the tests dial), formed by :func:`devstack.cluster.launcher.form_cluster`, the same
code that forms local clusters. Skips with a reason when no Docker engine answers.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from devstack.cluster.form import Node
from devstack.cluster.launcher import ClusterInfo, find_free_base_port, form_cluster

IMAGE = "redis:7.2"


def _docker_or_skip() -> None:
    try:
        import docker

        docker.from_env().ping()
    except Exception as exc:  # no engine, no socket, no permission: all mean skip
        pytest.skip(f"TOKENRELAY_TEST_BACKEND=docker but no Docker engine answers: {exc}")


@contextlib.asynccontextmanager
async def docker_cluster(masters: int = 3, replicas: int = 1) -> AsyncIterator[ClusterInfo]:
    _docker_or_skip()
    from testcontainers.core.container import DockerContainer

    count = masters * (1 + replicas)
    base = find_free_base_port(count)
    nodes = [
        Node("127.0.0.1", base + i, "master" if i < masters else "replica") for i in range(count)
    ]
    for i, node in enumerate(nodes[masters:]):
        node.master_port = nodes[i % masters].port
    containers = []
    try:
        for node in nodes:
            container = (
                DockerContainer(IMAGE)
                .with_kwargs(network_mode="host")
                .with_command(
                    f"redis-server --port {node.port} --bind 127.0.0.1 --cluster-enabled yes "
                    "--save '' --appendonly no --cluster-node-timeout 2000"
                )
            )
            container.start()
            containers.append(container)
        await form_cluster(nodes)
        yield ClusterInfo(
            nodes=nodes, data_dir="", binary=IMAGE, flavor="redis", version=IMAGE.split(":")[1]
        )
    finally:
        for container in containers:
            container.stop()
