// Renderers: data in, DOM nodes out. Every state is shown as text and a shape beside its colour.

export function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "class") node.className = value;
    else if (key === "style") node.style.cssText = value; // CSSOM: allowed by the page's CSP
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

const STATUS_SHAPES = {
  InService: "●", Running: "●", Creating: "◔", Updating: "◔", Pending: "◔",
  Deleting: "◌", ShuttingDown: "◌", Failed: "✖", Failure: "✖", SystemUpdating: "◔",
};

export function status(text) {
  return h("span", { class: `status status-${text}` }, h("span", { "aria-hidden": "true" },
    STATUS_SHAPES[text] || "○"), ` ${text}`);
}

export function bytes(n) {
  if (n === null || n === undefined) return "?";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return `${value.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}

export function time(epoch) {
  return new Date(epoch * 1000).toLocaleTimeString([], { hour12: false });
}

export function shortId(id) {
  return id ? `…${id.slice(-5)}` : "";
}

function tiered(config) {
  return config?.Mode === "Enable" ? `on, ${config.InstanceMemoryAllocationPercentage} %` : "off";
}

function generation(applied, desired) {
  const behind = applied < desired;
  return h("span", { class: behind ? "gen behind" : "gen" },
    `${applied} / ${desired}`, behind ? " ◔ rolling out" : " ✓");
}

function counts(nodeCounts) {
  const parts = Object.entries(nodeCounts).map(([state, n]) => `${n} ${state}`);
  return parts.length ? parts.join(", ") : "none";
}

export function clustersTable(clusters, { onOpen, onDelete }) {
  if (!clusters.length) return h("p", { class: "empty" }, "No clusters yet: create one below.");
  return h("table", { class: "clusters" },
    h("caption", { class: "sr-only" }, "Clusters"),
    h("thead", {}, h("tr", {}, ["Name", "Status", "Orchestrator", "Tiered storage",
      "Policy generation (applied / desired)", "Nodes", ""].map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, clusters.map((c) => h("tr", { "data-cluster": c.ClusterName },
      h("th", { scope: "row" }, h("a", { href: `#/clusters/${encodeURIComponent(c.ClusterName)}`,
        onclick: (e) => { e.preventDefault(); onOpen(c.ClusterName); } }, c.ClusterName)),
      h("td", { "data-label": "Status" }, status(c.ClusterStatus)),
      h("td", { "data-label": "Orchestrator" }, c.Orchestrator || "none"),
      h("td", { "data-label": "Tiered storage" }, tiered(c.TieredStorageConfig)),
      h("td", { "data-label": "Generation" }, generation(c.AppliedPolicyGeneration, c.DesiredPolicyGeneration)),
      h("td", { class: "node-counts", "data-label": "Nodes" }, counts(c.NodeCounts)),
      h("td", {}, h("button", { type: "button", class: "danger",
        "aria-label": `Delete cluster ${c.ClusterName}`,
        disabled: !["InService", "Failed"].includes(c.ClusterStatus),
        onclick: () => onDelete(c.ClusterName) }, "Delete"))))));
}

function memoryBar(node) {
  const budget = node.MemoryBudgetBytes;
  const held = node.MemoryHeldBytes;
  if (!budget) return h("span", { class: "muted" }, "no tier");
  const share = held === null ? 0 : Math.min(100, (100 * held) / budget);
  return h("div", { class: "bar-wrap" },
    h("div", { class: "bar", role: "meter", "aria-valuemin": 0, "aria-valuemax": budget,
      "aria-valuenow": held ?? 0, "aria-label": `memory held by ${node.InstanceId}` },
      h("div", { class: share > 90 ? "fill high" : "fill", style: `width: ${share.toFixed(1)}%` })),
    h("span", { class: "bar-text" }, `${bytes(held)} / ${bytes(budget)}`));
}

const NODE_FAULTS = ["AgentCrash", "NodeLoss", "AgentHang", "NetworkPartition"];

export function nodesTable(nodes, { onFault }) {
  return h("table", { class: "nodes" },
    h("caption", { class: "sr-only" }, "Nodes"),
    h("thead", {}, h("tr", {}, ["Ring", "Node", "Status", "Replica peers", "Agent endpoint",
      "Applied generation", "Memory held / budget", "S3 lag", "Last error", "Faults"]
      .map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, nodes.map((n) => h("tr", { "data-node": n.InstanceId, "data-status": n.Status },
      h("td", { "data-label": "Ring" }, n.RingPosition ?? "–"),
      h("th", { scope: "row" }, h("code", { title: n.InstanceType }, n.InstanceId),
        h("div", { class: "muted" }, `${n.InstanceGroupName} · ${n.InstanceType}`)),
      h("td", { "data-label": "Status" }, status(n.Status), n.StatusMessage ? h("div", { class: "muted" }, n.StatusMessage) : null),
      h("td", { "data-label": "Replica peers" }, n.ReplicaPeers.length ? n.ReplicaPeers.map((p) => h("code", { title: p }, shortId(p), " "))
        : "–"),
      h("td", { "data-label": "Agent" }, n.Endpoint ? h("code", {}, n.Endpoint) : "–"),
      h("td", { "data-label": "Applied generation" }, n.AppliedPolicyGeneration),
      h("td", { "data-label": "Memory" }, memoryBar(n)),
      h("td", { "data-label": "S3 lag" }, n.S3LagSeconds === null || n.S3LagSeconds === undefined ? "–"
        : `${n.S3LagSeconds.toFixed(1)} s (${n.S3PendingSteps ?? 0} pending)`),
      h("td", { class: "error-text", "data-label": "Last error" }, n.LastError || "–"),
      h("td", { class: "fault-buttons" }, NODE_FAULTS.map((type) => h("button", {
        type: "button", "data-fault": type, disabled: n.Status !== "Running",
        "aria-label": `${type} on ${n.InstanceId}`, onclick: () => onFault(type, n.InstanceId),
      }, type)))))));
}

// One cell of the map: where this rank's shard of this step is.
function cell(step, rank) {
  const primary = step.Memory[rank];
  const replicas = step.Replica[rank] || [];
  const parts = [];
  let kind = "missing";
  if (primary) {
    kind = "primary";
    parts.push(h("span", { class: "tier" }, "■ P"), " ", h("code", { title: primary }, shortId(primary)));
  } else if (replicas.length) {
    kind = "replica";
    parts.push(h("span", { class: "tier" }, "◆ R"), " ", h("code", { title: replicas[0] }, shortId(replicas[0])));
  } else if (step.S3) {
    kind = "s3";
    parts.push(h("span", { class: "tier" }, "▲ S3"));
  } else {
    parts.push(h("span", { class: "tier" }, "✖ missing"));
  }
  if (kind !== "s3" && step.S3) parts.push(h("span", { class: "s3-badge", title: "also on S3" }, " +S3"));
  if (primary && replicas.length) parts.push(h("span", { class: "muted", title: replicas.join(", ") },
    ` +${replicas.length}R`));
  return h("td", { class: `cell ${kind}`, "data-rank": rank, "data-kind": kind }, parts);
}

// Who put the step on S3: the agents (their commit marker) or the trainer itself (the library's
// own S3 writes: the listing's S3WrittenBy "Trainer"); "–" when it is not on S3, and "unknown"
// when S3 could not be listed (the listing's S3 null, with the namespace's S3Error saying why).
export function s3Writer(step) {
  if (step.S3 === null) return "unknown";
  if (!step.S3) return null;
  return step.S3WrittenBy === "Trainer" ? "trainer" : "agents";
}

function s3Cell(step) {
  const writer = s3Writer(step);
  const text = writer === "unknown" ? "? S3 unreachable" : writer ? `▲ written by ${writer}` : "–";
  return h("td", { class: "s3-writer", "data-s3-written-by": writer ?? "none" }, text);
}

export function checkpointMap(namespaces, unreachable) {
  if (!namespaces.length) return h("p", { class: "empty" }, "No checkpoints yet: a trainer's first save creates its namespace.");
  return h("div", {},
    unreachable.length ? h("p", { class: "warn" }, "⚠ Agents that did not answer: ",
      unreachable.map((id) => h("code", {}, id, " "))) : null,
    namespaces.map((ns) => {
      const ranks = [...Array(ns.NumRanks).keys()].map(String);
      const newest = ns.Restore?.Step;
      return h("section", { class: "namespace", "data-namespace": ns.Namespace },
        h("h4", {}, `Namespace ${ns.Namespace}`, h("span", { class: "muted" },
          ` · ${ns.NumRanks} ranks · ${ns.StepsRetained} steps kept in memory`)),
        ns.S3Error ? h("p", { class: "warn s3-error" }, `⚠ S3 could not be listed: ${ns.S3Error}`) : null,
        ns.Restore ? h("p", { class: "restore" }, `A restore now reads step ${ns.Restore.Step}: `,
          ranks.map((r) => {
            const source = ns.Restore.Ranks[r];
            return h("span", { class: `source ${source.Tier.toLowerCase()}`, "data-rank": r },
              `rank ${r} ← ${source.Tier}${source.InstanceId ? ` ${shortId(source.InstanceId)}` : ""}`);
          })) : h("p", { class: "warn" }, "✖ No complete step: nothing to restore."),
        h("div", { class: "scroll" }, h("table", { class: "map" },
          h("caption", { class: "sr-only" }, `Checkpoint map of ${ns.Namespace}: steps by ranks`),
          h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "Step"), h("th", { scope: "col" }, "Complete"),
            h("th", { scope: "col" }, "On S3"), ranks.map((r) => h("th", { scope: "col" }, `rank ${r}`)))),
          h("tbody", {}, ns.Steps.map((step) => h("tr", {
            class: step.Step === newest ? "newest" : "", "data-step": step.Step,
            "data-complete": step.Complete },
          h("th", { scope: "row" }, step.Step,
            step.WorldSize ? h("span", { class: "muted world-size" }, ` · saved by ${step.WorldSize} ranks`) : null,
            step.Step === newest ? h("span", { class: "star" }, " ★ newest complete") : null),
          h("td", {}, step.Complete ? "✓ yes" : "✗ no"),
          s3Cell(step),
          ranks.map((r) => cell(step, r))))))));
    }),
    h("p", { class: "legend" }, "■ P primary copy in memory (node) · ◆ R only a replica (node) · ▲ S3 only on S3 · ✖ missing · +S3 also committed on S3 · On S3: ? when S3 could not be listed; written by the agents (their commit marker) or by the trainer (the library's own S3 writes)"));
}

export function jobsTable(jobs) {
  if (!jobs.length) return h("p", { class: "empty" }, "No jobs: hyperpod-sim job run --cluster … -- CMD runs one on these nodes.");
  const attempt = (a) => h("li", { "data-attempt": a.Attempt, "data-status": a.Status },
    `attempt ${a.Attempt}: ${a.Status}`, " on ", a.Nodes.map((n) => h("code", {}, shortId(n), " ")),
    a.Cause && a.Cause !== "Succeeded"
      ? `· ${a.Cause}${a.CauseNodeId ? ` (node ${shortId(a.CauseNodeId)})` : a.CauseRank != null ? ` (rank ${a.CauseRank})` : ""}`
      : null,
    a.ExitCode != null ? ` · exit ${a.ExitCode}` : null);
  return h("div", { class: "scroll" }, h("table", { class: "jobs" },
    h("caption", { class: "sr-only" }, "Jobs on this cluster"),
    h("thead", {}, h("tr", {}, ["Job", "Status", "Shape", "Restarts", "Exit", "Attempts"].map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, jobs.map((j) => h("tr", { "data-job": j.JobName, "data-status": j.Status },
      h("th", { scope: "row" }, j.JobName, h("span", { class: "muted" }, ` ${j.JobId}`)),
      h("td", {}, status(j.Status)),
      h("td", {}, `${j.NodeCount ?? "every"} node(s) × ${j.ProcessesPerNode}`),
      h("td", {}, j.AutoResume ? `${j.Restarts} of ${j.MaxRestarts}` : "no auto-resume"),
      h("td", {}, j.ExitCode ?? "–"),
      h("td", {}, h("ol", { class: "attempts" }, j.Attempts.map(attempt))))))));
}

export function eventsList(events, filter) {
  const text = filter.text.toLowerCase();
  const shown = events.filter((e) => (!filter.level || e.EventLevel === filter.level)
    && (!filter.resource || e.ResourceType === filter.resource)
    && (!text || `${e.Description} ${e.InstanceId || ""}`.toLowerCase().includes(text)));
  if (!shown.length) return h("p", { class: "empty" }, "No events match.");
  const marks = { Info: "ℹ", Warn: "⚠", Error: "✖" };
  return h("ol", { class: "events", reversed: true }, shown.map((e) => h("li", { class: `level-${e.EventLevel}` },
    h("time", { datetime: new Date(e.EventTime * 1000).toISOString() }, time(e.EventTime)),
    h("span", { class: "level" }, `${marks[e.EventLevel] || "•"} ${e.EventLevel}`),
    h("span", { class: "resource" }, e.ResourceType),
    h("span", { class: "description" }, e.Description))));
}

export function faultsList(faults, { onClear }) {
  if (!faults.length) return h("p", { class: "empty" }, "No fault in force.");
  return h("ul", { class: "faults" }, faults.map((f) => h("li", { "data-fault-id": f.FaultId, "data-type": f.Type },
    h("strong", {}, `⚡ ${f.Type}`), " ", h("code", {}, f.FaultId),
    f.InstanceId ? [" on ", h("code", {}, f.InstanceId)] : null,
    f.EndsAt ? ` until ${time(f.EndsAt)}` : " until cleared", " ",
    h("button", { type: "button", disabled: f.Type === "NodeLoss",
      title: f.Type === "NodeLoss" ? "A NodeLoss ends when the node has failed" : undefined,
      "aria-label": `Clear fault ${f.FaultId} (${f.Type})`, onclick: () => onClear(f) }, "Clear"))));
}
