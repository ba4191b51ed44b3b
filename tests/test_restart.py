"""State and in-flight transitions survive a killed control plane."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ServerProcess, group, wait_for


def test_creating_cluster_finishes_after_restart(database_url: str, tmp_path: Path) -> None:
    # Real time here: nodes take 2 s to launch, and the service is killed before they do.
    env = {"HPSIM_PROVISIONING__MODE": "simulated", "HPSIM_PROVISIONING__NODE_READY_DELAY_S": "2"}
    first = ServerProcess(database_url, tmp_path, env).start()
    try:
        sm = first.client()
        arn = sm.create_cluster(
            ClusterName="survivor",
            InstanceGroups=[group("a", 2)],
            Tags=[{"Key": "team", "Value": "research"}],
        )["ClusterArn"]
        assert sm.describe_cluster(ClusterName="survivor")["ClusterStatus"] == "Creating"
    finally:
        first.kill()

    second = ServerProcess(database_url, tmp_path, env).start()
    try:
        sm = second.client()
        described = sm.describe_cluster(ClusterName="survivor")
        assert described["ClusterArn"] == arn
        assert described["ClusterStatus"] == "Creating"

        def in_service() -> bool:
            return sm.describe_cluster(ClusterName="survivor")["ClusterStatus"] == "InService"

        wait_for(in_service, timeout=60, what="the cluster to finish creating after the restart")
        assert described["InstanceGroups"][0]["TargetCount"] == 2
        assert len(sm.list_cluster_nodes(ClusterName="survivor")["ClusterNodeSummaries"]) == 2
        assert sm.list_tags(ResourceArn=arn)["Tags"] == [{"Key": "team", "Value": "research"}]
    finally:
        second.stop()
