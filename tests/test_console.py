"""The web console (``/console``) in a real headless browser: Playwright driving the system's
chromium (Debian's package; .ci/run installs it), against a real control plane with real agents.

The demo's story through the console alone: create a 3-node tiered cluster, see it InService, a
trainer saves steps and the checkpoint map fills in, NodeLoss by a click, the node fails and is
replaced and the map shows the replica serving, a fault injected and cleared, a database outage
seen and survived, the cluster deleted. Then the auth-on login path. Every wait is a condition with a deadline
(Playwright's ``expect``); the run leaves a screenshot in docs/console.png for the README.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hyperpod_sim.contracts.s3layout import WRITTEN_BY_AGENTS, WRITTEN_BY_TRAINER
from hyperpod_sim.domain.checkpoints.listing import NamespaceCheckpoints, StepLocation
from hyperpod_sim.domain.overview import restore_plan
from hyperpod_sim.sdk.auth import bearer_token
from tests.conftest import ControlPlane, wait_for
from tests.job_runs import run_job
from tests.jobs import run
from tests.s3_checkpoints import CREDENTIALS
from tests.tier import cluster, members, url

playwright_sync = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
expect = playwright_sync.expect
# A page's own updates (a render after a poll) within 30 s, not Playwright's 5: CI's two cores run
# this browser beside four test workers.
expect.set_options(timeout=30_000)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT = ROOT / "docs" / "console.png"
SLOW = 90_000  # ms: cluster creation, node replacement (agents start, heartbeat timeout)
KEY, SECRET = "AKIDCONSOLE", "console-secret-key"

pytestmark = [
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install -y chromium)"),
]


@pytest.fixture
def browser() -> Iterator[Any]:
    with playwright_sync.sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start.
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    yield opened
    context.close()
    assert not errors, errors  # no script error on the way


@pytest.fixture
def agent_settings(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    return {"s3": {"endpoint_url": moto_url, "embedded": False}}


def overview_with_a_node(plane: ControlPlane, name: str) -> dict[str, Any]:
    """The cluster's overview once it shows a node: CreateCluster answers before the node exists
    (the reconciler makes it)."""
    overview: dict[str, Any] = wait_for(
        lambda: (o := httpx.get(f"{plane.url}/clusters/{name}/overview").json())["Nodes"] and o,
        timeout=60,
        what=f"a node of {name}",
    )
    return overview


def create_through_the_form(page: Any, name: str, count: int) -> None:
    page.get_by_text("Create a cluster").click()
    form = page.locator("#create-form")
    form.get_by_label("Name").fill(name)
    form.get_by_label("Instance type").fill("ml.g5.2xlarge")
    form.get_by_label("Instance count").fill(str(count))
    expect(form.get_by_label("Tiered storage")).to_be_checked()
    form.get_by_role("button", name="Create").click()
    expect(page.locator("#create-result")).to_contain_text("done")


def test_the_demo_story_through_the_console(
    agent_plane: ControlPlane, page: Any, tmp_path: Path, bucket: str
) -> None:
    page.goto(f"{agent_plane.url}/console")
    expect(page.get_by_role("heading", name="Clusters")).to_be_visible()
    create_through_the_form(page, "demo", 3)
    row = page.locator('tr[data-cluster="demo"]')
    expect(row).to_contain_text("InService", timeout=SLOW)
    expect(row).to_contain_text("3 Running")
    expect(row).to_contain_text("on, 20 %")

    row.get_by_role("link", name="demo").click()
    expect(page.get_by_role("heading", name="Cluster demo")).to_be_visible()
    expect(page.locator('#nodes tr[data-status="Running"]')).to_have_count(3)

    # TieredStorageConfig from the update form: 30 %, rolled out to every node.
    page.get_by_text("Update counts and tiered storage").click()
    update = page.locator("#update-form")
    expect(update.get_by_label(re.compile("workers .* count"))).to_have_value("3")
    update.get_by_label("Memory allocation %").fill("30")
    update.get_by_role("button", name="Update cluster").click()
    expect(page.locator("#summary")).to_contain_text("on, 30 %")
    expect(page.locator("#summary")).to_contain_text("InService", timeout=SLOW)

    # The checkpoint policy from its form: S3 every 2 steps. The rollout shows as generations.
    page.get_by_text("Checkpoint policy").click()
    policy = page.locator("#policy-form")
    policy.get_by_label("S3 base URI").fill(f"s3://{bucket}/demo")
    policy.get_by_label("Persist every N steps").fill("2")
    policy.get_by_role("button", name="Save policy").click()
    expect(page.locator("#action-result")).to_contain_text("done")
    expect(page.locator("#summary")).to_contain_text(re.compile(r"(\d+) applied / \1 desired"), timeout=SLOW)

    # A trainer (2 ranks, rank r on the r-th node of the ring) saves steps 1..4: the map fills in.
    nodes = members(agent_plane, "demo")
    urls = [url(n) for n in nodes]
    run(tmp_path, urls, 2, "job", "--save", "1,2,3,4")
    namespace = page.locator('section.namespace[data-namespace="job"]')
    newest = namespace.locator('tr[data-step="4"]')
    expect(newest).to_have_class("newest")
    expect(newest).to_contain_text("newest complete")
    expect(newest.locator('td[data-rank="1"]')).to_have_attribute("data-kind", "primary")
    expect(namespace.locator('tr[data-step="4"] .s3-badge').first).to_be_visible(timeout=SLOW)
    expect(page.locator('#nodes tr[data-status="Running"] .bar-text').first).not_to_contain_text("0 B /")

    # NodeLoss on rank 1's node, with a click: it fails, is replaced, and rank 1 of step 4 is now
    # served by the replica the next node of the ring holds.
    lost = nodes[1]["InstanceId"]
    page.locator(f'tr[data-node="{lost}"]').get_by_role("button", name=f"NodeLoss on {lost}").click()
    events = page.locator("#events")
    expect(events).to_contain_text(f"Node {lost} failed", timeout=SLOW)
    expect(events).to_contain_text(f"Node {lost} is replaced by", timeout=SLOW)
    expect(page.locator(f'tr[data-node="{lost}"]')).to_have_count(0, timeout=SLOW)
    expect(page.locator('#nodes tr[data-status="Running"]')).to_have_count(3, timeout=SLOW)
    expect(newest.locator('td[data-rank="1"]')).to_have_attribute("data-kind", "replica")
    expect(namespace.locator('.restore .source[data-rank="1"]')).to_contain_text("Replica")
    page.locator("#event-filter").get_by_label("Text").fill(lost)
    expect(events.locator("li").first).to_contain_text(lost)
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    page.locator("#event-filter").get_by_label("Text").fill("")

    # A fault injected and cleared from the buttons.
    page.get_by_role("button", name="Inject S3Latency").click()
    fault = page.locator('#faults li[data-type="S3Latency"]')
    expect(fault).to_be_visible()
    fault.get_by_role("button", name=re.compile("Clear fault")).click()
    expect(page.locator("#faults")).to_contain_text("No fault in force")
    expect(events).to_contain_text("ended")

    # The control plane's database goes away for 3 s: the console says so, then recovers.
    page.get_by_role("link", name="All clusters").click()
    page.locator("#db-outage").get_by_label("Database fault for").fill("3")
    page.get_by_role("button", name="Inject DatabaseOutage").click()
    expect(page.locator("#banner")).to_contain_text("503")
    expect(page.locator("#banner")).to_be_hidden(timeout=30_000)
    expect(page.locator("#live")).to_contain_text("live")

    # A database that hangs for 3 s: the fault is listed while in force (the fault routes answer
    # from memory), then gone, and the console is live again.
    page.get_by_role("button", name="Inject DatabaseHang").click()
    expect(page.locator('#cp-faults li[data-type="DatabaseHang"]')).to_be_visible()
    expect(page.locator("#cp-faults")).to_contain_text("No fault in force", timeout=30_000)
    expect(page.locator("#live")).to_contain_text("live")

    # Delete, confirmed in the browser's dialog: the cluster goes.
    page.on("dialog", lambda dialog: dialog.accept())
    row.get_by_role("button", name="Delete cluster demo").click()
    expect(row).to_have_count(0, timeout=SLOW)
    expect(page.locator("#clusters")).to_contain_text("No clusters yet")


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"auth": {"credentials": {KEY: SECRET}}}


def test_with_auth_on_the_console_asks_for_a_key_and_sends_its_token(
    control_plane: ControlPlane, page: Any
) -> None:
    # Nothing of the data is open: the overview routes are behind the gate like every route.
    for path in ("/overview", "/clusters/c/overview", "/clusters"):
        assert httpx.get(control_plane.url + path).status_code == 401, path
    # The page itself is, like /docs: it holds nothing.
    assert httpx.get(control_plane.url + "/console").status_code == 200
    token = bearer_token(KEY, SECRET)
    headers = {"Authorization": f"Bearer {token}"}
    created = httpx.post(
        control_plane.url + "/clusters",
        headers=headers,
        json={
            "ClusterName": "guarded",
            "InstanceGroups": [
                {
                    "InstanceGroupName": "w",
                    "InstanceType": "ml.c5.large",
                    "InstanceCount": 1,
                    "ExecutionRole": "arn:aws:iam::123456789012:role/x",
                }
            ],
        },
    )
    assert created.status_code == 200, created.text

    page.goto(f"{control_plane.url}/console")
    dialog = page.get_by_role("dialog", name="Sign in")
    expect(dialog).to_be_visible()
    dialog.get_by_label("Access key id").fill(KEY)
    dialog.get_by_label("Secret access key").fill("not-the-secret")
    dialog.get_by_role("button", name="Sign in").click()
    expect(dialog).to_contain_text("UnrecognizedClientException")
    dialog.get_by_label("Secret access key").fill(SECRET)
    dialog.get_by_role("button", name="Sign in").click()
    expect(dialog).to_be_hidden()
    expect(page.locator('tr[data-cluster="guarded"]')).to_contain_text("Creating")
    # The browser computed exactly the token `hyperpod-sim auth-token` prints, and keeps only it.
    assert page.evaluate("sessionStorage.getItem('hpsim.console.token')") == token

    page.get_by_role("button", name="Sign out").click()
    expect(dialog).to_be_visible()
    dialog.get_by_label("Bearer token").fill(token)
    dialog.get_by_role("button", name="Sign in").click()
    expect(page.locator('tr[data-cluster="guarded"]')).to_be_visible()

    # A pasted CreateCluster request goes out with the token too.
    page.get_by_text("Create a cluster").click()
    request = {
        "ClusterName": "pasted",
        "InstanceGroups": [
            {
                "InstanceGroupName": "w",
                "InstanceType": "ml.c5.large",
                "InstanceCount": 2,
                "ExecutionRole": "arn:aws:iam::123456789012:role/x",
            }
        ],
        "Orchestrator": {"Slurm": {}},
    }
    page.get_by_label("paste a CreateCluster request").fill(json.dumps(request))
    page.get_by_role("button", name="Create from JSON").click()
    expect(page.locator('tr[data-cluster="pasted"]')).to_contain_text("Slurm")
    expect(page.locator('tr[data-cluster="pasted"]')).to_contain_text("2 Pending")


class TestTheCheckpointMap:
    """The map's own rendering, on a view the test sets (the server's wire code makes it): what a
    trainer cannot be made to write here in seconds, a step it wrote to S3 itself."""

    @pytest.fixture
    def settings_overrides(self) -> dict[str, Any]:
        return {}  # auth off, unlike the module's other tests

    def test_it_says_who_wrote_each_step_to_s3(self, control_plane: ControlPlane, page: Any) -> None:
        created = httpx.post(
            control_plane.url + "/clusters",
            json={
                "ClusterName": "map",
                "InstanceGroups": [
                    {
                        "InstanceGroupName": "w",
                        "InstanceType": "ml.c5.large",
                        "InstanceCount": 1,
                        "ExecutionRole": "arn:aws:iam::123456789012:role/x",
                    }
                ],
            },
        )
        assert created.status_code == 200, created.text
        served = overview_with_a_node(control_plane, "map")
        node = served["Nodes"][0]["InstanceId"]
        namespace = NamespaceCheckpoints(
            "job",
            2,
            3,
            [
                StepLocation(step=3, memory={0: node, 1: node}, replica={}, on_s3=False, complete=True),
                StepLocation(
                    step=2, memory={}, replica={}, on_s3=True, complete=True, s3_written_by=WRITTEN_BY_TRAINER
                ),
                StepLocation(
                    step=1,
                    memory={0: node},
                    replica={},
                    on_s3=True,
                    complete=True,
                    s3_written_by=WRITTEN_BY_AGENTS,
                ),
            ],
        )
        view = {**served, "Checkpoints": [{**namespace.to_wire(), "Restore": restore_plan(namespace)}]}
        page.route("**/clusters/map/overview", lambda route: route.fulfill(json=view))
        page.goto(f"{control_plane.url}/console#/clusters/map")
        section = page.locator('section.namespace[data-namespace="job"]')
        writers = {step: section.locator(f'tr[data-step="{step}"] td.s3-writer') for step in ("1", "2", "3")}
        expect(writers["2"]).to_have_text("▲ written by trainer")
        expect(writers["2"]).to_have_attribute("data-s3-written-by", "trainer")
        expect(writers["1"]).to_have_text("▲ written by agents")
        expect(writers["3"]).to_have_text("\N{EN DASH}")  # not on S3
        expect(section.locator("thead")).to_contain_text("On S3")

    def test_it_tells_s3_unreachable_from_not_on_s3(self, control_plane: ControlPlane, page: Any) -> None:
        created = httpx.post(
            control_plane.url + "/clusters",
            json={
                "ClusterName": "dark",
                "InstanceGroups": [
                    {
                        "InstanceGroupName": "w",
                        "InstanceType": "ml.c5.large",
                        "InstanceCount": 1,
                        "ExecutionRole": "arn:aws:iam::123456789012:role/x",
                    }
                ],
            },
        )
        assert created.status_code == 200, created.text
        served = overview_with_a_node(control_plane, "dark")
        node = served["Nodes"][0]["InstanceId"]
        namespace = NamespaceCheckpoints(
            "job",
            1,
            3,
            [StepLocation(step=1, memory={0: node}, replica={}, on_s3=None, complete=True)],
            s3_error="no agent could list S3: connection refused",
        )
        view = {**served, "Checkpoints": [{**namespace.to_wire(), "Restore": restore_plan(namespace)}]}
        page.route("**/clusters/dark/overview", lambda route: route.fulfill(json=view))
        page.goto(f"{control_plane.url}/console#/clusters/dark")
        section = page.locator('section.namespace[data-namespace="job"]')
        writer = section.locator('tr[data-step="1"] td.s3-writer')
        expect(writer).to_have_text("? S3 unreachable")
        expect(writer).to_have_attribute("data-s3-written-by", "unknown")
        expect(section.locator("p.s3-error")).to_contain_text("connection refused")


@pytest.mark.usefixtures("no_job_left")
def test_it_shows_a_jobs_attempts_beside_the_checkpoint_map(
    agent_plane: ControlPlane, page: Any, tmp_path: Path
) -> None:
    cluster(agent_plane.client(), agent_plane, "jobs", 1)
    # Fails its first attempt (exit 5), succeeds its second: auto-resume with one restart.
    flaky = "import os, sys; sys.exit(0 if os.environ['HPSIM_JOB_ATTEMPT'] == '2' else 5)"
    done = run_job(
        agent_plane,
        tmp_path,
        "--cluster",
        "jobs",
        "--auto-resume",
        "--max-restarts",
        "1",
        "--name",
        "flaky",
        command=[sys.executable, "-c", flaky],
    )
    assert done.returncode == 0, done.stdout + done.stderr
    page.goto(f"{agent_plane.url}/console#/clusters/jobs")
    row = page.locator('#jobs tr[data-job="flaky"]')
    expect(row).to_have_attribute("data-status", "Succeeded", timeout=SLOW)
    expect(row).to_contain_text("1 of 1")  # restarts
    expect(row.locator('li[data-attempt="1"]')).to_contain_text("RankExit (rank 0)")
    expect(row.locator('li[data-attempt="1"]')).to_contain_text("exit 5")
    expect(row.locator('li[data-attempt="2"]')).to_have_attribute("data-status", "Succeeded")
    # Beside the checkpoint map, as the issue asks: both on the cluster's page.
    expect(page.get_by_role("heading", name="Jobs", exact=True)).to_be_visible()
    expect(page.get_by_role("heading", name="Checkpoint map")).to_be_visible()
