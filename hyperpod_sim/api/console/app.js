// The console: hash routes (#/ and #/clusters/NAME), conditional polling of the overview routes,
// forms and fault buttons that call the public REST routes (api/overview.py, api/rest.py).

import { ApiError, bearerToken, call, poll, setToken, token } from "/console/api.js";
import {
  checkpointMap, clustersTable, eventsList, faultsList, h, jobsTable, nodesTable, status,
} from "/console/views.js";

const POLL_MS = 500;
const $ = (id) => document.getElementById(id);
const state = { stops: [], cluster: null, view: null, filter: { level: "", resource: "", text: "" },
  formsFor: null, lastUpdate: 0 };

function replace(id, node) {
  $(id).replaceChildren(node);
}

function say(id, text, isError = false) {
  const node = $(id);
  node.textContent = text;
  node.className = isError ? "error-text" : "ok-text";
}

function live(ok, text) {
  $("live").textContent = text;
  $("live").className = ok ? "live ok" : "live down";
}

function failed(error) {
  if (error instanceof ApiError && error.status === 401) {
    askLogin(token() ? "The token was refused: sign in again." : "");
    return;
  }
  const outage = error instanceof ApiError && error.status === 503;
  $("banner").hidden = false;
  $("banner").textContent = outage
    ? `⚠ The control plane answers 503 ${error.code || ""}: ${error.message}`
    : `⚠ ${error.message}`;
  live(false, outage ? "✖ control plane unavailable" : "✖ disconnected");
}

function updated(data, render) {
  state.lastUpdate = Date.now();
  $("banner").hidden = true;
  live(true, `● live · updated ${new Date().toLocaleTimeString([], { hour12: false })}`);
  if (data) render(data);
}

function stopPolling() {
  for (const stop of state.stops) stop();
  state.stops = [];
}

async function act(resultId, what, fn) {
  say(resultId, `${what}…`);
  try {
    await fn();
    say(resultId, `✓ ${what}: done.`);
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) askLogin("");
    say(resultId, `✖ ${what}: ${error.code ? `${error.code}: ` : ""}${error.message}`, true);
  }
}

// ------------------------------------------------------------------ auth

function askLogin(message) {
  stopPolling();
  $("login-error").textContent = message;
  if (!$("login").open) $("login").showModal();
}

$("login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const form = event.target.elements;
  try {
    const pasted = form.token.value.trim();
    const made = pasted || await bearerToken(form.key.value.trim(), form.secret.value);
    setToken(made);
    await call("GET", "/overview");
    form.secret.value = "";
    $("login").close();
    $("sign-out").hidden = false;
    route();
  } catch (error) {
    setToken(null);
    $("login-error").textContent = error instanceof ApiError
      ? `✖ ${error.code || error.status}: ${error.message}` : `✖ ${error.message}`;
  }
});

$("sign-out").addEventListener("click", () => {
  setToken(null);
  $("sign-out").hidden = true;
  askLogin("Signed out.");
});

// ------------------------------------------------------------------ the clusters

async function deleteCluster(name) {
  if (!window.confirm(`Delete cluster ${name}? Its nodes and their in-memory checkpoints go.`)) return;
  await act("create-result", `Delete ${name}`, () => call("DELETE", `/clusters/${encodeURIComponent(name)}`));
}

function renderClusters(data) {
  replace("clusters", clustersTable(data.Clusters, {
    onOpen: (name) => { location.hash = `#/clusters/${encodeURIComponent(name)}`; },
    onDelete: deleteCluster,
  }));
}

function createRequest(form) {
  const e = form.elements;
  const request = {
    ClusterName: e.name.value.trim(),
    InstanceGroups: [{
      InstanceGroupName: e.group.value.trim(), InstanceType: e.type.value.trim(),
      InstanceCount: Number(e.count.value), ExecutionRole: e.role.value.trim(),
      LifeCycleConfig: { SourceS3Uri: "s3://hpsim-lifecycle/", OnCreate: "on_create.sh" },
    }],
    Orchestrator: e.orchestrator.value === "Eks"
      ? { Eks: { ClusterArn: "arn:aws:eks:us-east-1:123456789012:cluster/hpsim" } } : { Slurm: {} },
    NodeRecovery: e.recovery.value,
  };
  if (e.tiered.checked) {
    request.TieredStorageConfig = { Mode: "Enable", InstanceMemoryAllocationPercentage: Number(e.percentage.value) };
  }
  return request;
}

$("create-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const request = createRequest(event.target);
  $("create-json").elements.json.value = JSON.stringify(request, null, 2);
  act("create-result", `Create ${request.ClusterName}`, () => call("POST", "/clusters", { body: request }));
});

$("create-json").addEventListener("submit", (event) => {
  event.preventDefault();
  let request;
  try { request = JSON.parse(event.target.elements.json.value); } catch (error) {
    say("create-result", `✖ Not JSON: ${error.message}`, true);
    return;
  }
  act("create-result", `Create ${request.ClusterName}`, () => call("POST", "/clusters", { body: request }));
});

$("db-outage").addEventListener("submit", (event) => {
  event.preventDefault();
  const seconds = Number(event.target.elements.duration.value);
  // Which of the form's buttons: DatabaseOutage (refused at once) or DatabaseHang (no answer).
  const type = event.submitter?.dataset.fault || "DatabaseOutage";
  act("create-result", type, () => call("POST", "/faults", { body: { Type: type, DurationSeconds: seconds } }));
});

function renderControlPlaneFaults(data) {
  replace("cp-faults", faultsList(data.Faults, {
    onClear: (f) => act("create-result", `Clear ${f.FaultId}`, () => call("DELETE", `/faults/${f.FaultId}`)),
  }));
}

// ------------------------------------------------------------------ one cluster

function clusterPath(suffix = "") {
  return `/clusters/${encodeURIComponent(state.cluster)}${suffix}`;
}

function injectNodeFault(type, instanceId) {
  const body = { Type: type, InstanceId: instanceId };
  if (type === "AgentHang" || type === "NetworkPartition") {
    body.DurationSeconds = Number($("s3-faults").elements.duration.value);
  }
  act("action-result", `${type} on ${instanceId}`, () => call("POST", clusterPath("/faults"), { body }));
}

for (const button of $("s3-faults").querySelectorAll("button[data-fault]")) {
  button.addEventListener("click", () => {
    const e = $("s3-faults").elements;
    const type = button.dataset.fault;
    const body = { Type: type, DurationSeconds: Number(e.duration.value) };
    if (type === "S3Latency") body.LatencyMs = Number(e.latency.value);
    if (type === "S3Errors") body.ErrorRate = Number(e.rate.value);
    act("action-result", type, () => call("POST", clusterPath("/faults"), { body }));
  });
}

function fillForms(view) {
  // Forms are filled once per cluster shown (and after a save), never under the user's fingers.
  state.formsFor = view.ClusterName;
  const policy = $("policy-form").elements;
  for (const [key, value] of Object.entries(view.CheckpointPolicy)) {
    if (policy[key]) policy[key].value = value ?? "";
  }
  const tiered = view.TieredStorageConfig;
  replace("update-form", h("div", { class: "grid" },
    view.InstanceGroups.map((g) => h("label", {}, `${g.InstanceGroupName} (${g.InstanceType}) count `,
      h("input", { name: `count:${g.InstanceGroupName}`, type: "number", min: 0, max: 256, value: g.TargetCount }))),
    h("label", { class: "check" }, h("input", { name: "tiered", type: "checkbox", checked: tiered.Mode === "Enable" }),
      " Tiered storage"),
    h("label", {}, "Memory allocation % ", h("input", { name: "percentage", type: "number", min: 20, max: 100,
      value: tiered.InstanceMemoryAllocationPercentage ?? 20 })),
    h("button", { type: "submit" }, "Update cluster")));
}

$("update-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const e = event.target.elements;
  const view = state.view;
  act("action-result", `Update ${view.ClusterName}`, async () => {
    // Each group as DescribeCluster has it (role, lifecycle scripts), with the count asked for.
    const described = (await call("GET", clusterPath())).data;
    const groups = described.InstanceGroups.map((g) => {
      const group = {
        InstanceGroupName: g.InstanceGroupName, InstanceType: g.InstanceType,
        InstanceCount: Number(e[`count:${g.InstanceGroupName}`]?.value ?? g.TargetCount),
        ExecutionRole: g.ExecutionRole,
      };
      if (g.LifeCycleConfig) group.LifeCycleConfig = g.LifeCycleConfig;
      return group;
    });
    const body = {
      InstanceGroups: groups,
      TieredStorageConfig: e.tiered.checked
        ? { Mode: "Enable", InstanceMemoryAllocationPercentage: Number(e.percentage.value) } : { Mode: "Disable" },
    };
    await call("PATCH", clusterPath(), { body });
  });
});

$("policy-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const body = {};
  for (const input of event.target.querySelectorAll("[name]")) {
    if (input.value === "") continue;
    body[input.name] = input.type === "number" ? Number(input.value) : input.value;
  }
  act("action-result", "Save checkpoint policy", async () => {
    await call("PUT", clusterPath("/checkpoint-policy"), { body });
    state.formsFor = null;
  });
});

$("event-filter").addEventListener("input", (event) => {
  const e = event.currentTarget.elements;
  state.filter = { level: e.level.value, resource: e.resource.value, text: e.text.value };
  if (state.view) replace("events", eventsList(state.view.Events, state.filter));
});
$("event-filter").addEventListener("submit", (event) => event.preventDefault());

function summary(view) {
  return h("dl", { class: "summary" },
    h("dt", {}, "Status"), h("dd", {}, status(view.ClusterStatus)),
    h("dt", {}, "Orchestrator"), h("dd", {}, view.Orchestrator || "none"),
    h("dt", {}, "Tiered storage"), h("dd", {}, view.TieredStorageConfig.Mode === "Enable"
      ? `on, ${view.TieredStorageConfig.InstanceMemoryAllocationPercentage} %` : "off"),
    h("dt", {}, "Policy generation"), h("dd", {}, `${view.AppliedPolicyGeneration} applied / ${view.DesiredPolicyGeneration} desired`),
    h("dt", {}, "Nodes"), h("dd", { id: "node-counts" }, Object.entries(view.NodeCounts).map(([s, n]) => `${n} ${s}`).join(", ") || "none"),
    h("dt", {}, "Node recovery"), h("dd", {}, view.NodeRecovery));
}

function renderCluster(view) {
  state.view = view;
  $("cluster-title").textContent = `Cluster ${view.ClusterName}`;
  replace("summary", summary(view));
  replace("nodes", nodesTable(view.Nodes, { onFault: injectNodeFault }));
  replace("faults", faultsList(view.Faults, {
    onClear: (f) => act("action-result", `Clear ${f.FaultId}`, () => call("DELETE", clusterPath(`/faults/${f.FaultId}`))),
  }));
  replace("jobs", jobsTable(view.Jobs));
  replace("map", checkpointMap(view.Checkpoints, view.Unreachable));
  replace("events", eventsList(view.Events, state.filter));
  if (state.formsFor !== view.ClusterName) fillForms(view);
}

// ------------------------------------------------------------------ routes

function route() {
  stopPolling();
  const match = location.hash.match(/^#\/clusters\/([^/]+)$/);
  state.cluster = match ? decodeURIComponent(match[1]) : null;
  state.view = null;
  state.formsFor = null;
  $("clusters-view").hidden = Boolean(state.cluster);
  $("cluster-view").hidden = !state.cluster;
  if (state.cluster) {
    $("cluster-title").textContent = `Cluster ${state.cluster}`;
    state.stops.push(poll(clusterPath("/overview"), POLL_MS, (d) => updated(d, renderCluster), failed));
  } else {
    state.stops.push(poll("/overview", POLL_MS, (d) => updated(d, renderClusters), failed));
  }
  state.stops.push(poll("/faults", POLL_MS * 2, (d) => d && renderControlPlaneFaults(d), () => {}));
}

window.addEventListener("hashchange", route);
if (token()) $("sign-out").hidden = false;
route();
