"use strict";
// The GPU map: fetches /api/map (the same read the plugin's inspect, top and budgets make) and draws
// it. Every name shown comes from the cluster, so text is set with textContent, never as HTML.

const REFRESH_MS = 5000;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "text") node.textContent = value;
    else if (key === "style") Object.assign(node.style, value);
    else node.setAttribute(key, value);
  }
  for (const child of children) if (child) node.appendChild(child);
  return node;
}

function colour(text) {
  let hash = 0;
  for (const c of text) hash = (hash * 31 + c.charCodeAt(0)) >>> 0;
  return `hsl(${hash % 360}, 55%, 42%)`;
}

function usageOf(map) {
  const found = new Map();
  for (const row of map.usage) found.set(`${row.namespace}/${row.pod}|${row.node}|${row.gpu}`, row);
  return found;
}

function gpuRow(node, gpu, usage) {
  const row = el("div", { class: "gpu" + (gpu.healthy ? "" : " unhealthy"), "data-gpu": `${node.name}/${gpu.index}` });
  row.appendChild(el("div", { class: "name", text: `GPU ${gpu.index} ${gpu.model}` }));
  const bars = el("div");
  const compute = el("div", { class: "bar", "data-kind": "compute" });
  const memory = el("div", { class: "bar memory", "data-kind": "memory" });
  for (const holder of gpu.pods) {
    const used = usage.get(`${holder.pod}|${node.name}|${gpu.index}`);
    const width = (100 * holder.milli) / gpu.milli.capacity;
    let title = `${holder.pod}: ${holder.milli}m, ${holder.memoryMiB} MiB given`;
    if (used) title += `; uses ${used.usedMiB} MiB` + (used.smPercent === null ? "" : `, SM ${used.smPercent}%`);
    const share = el("div", { class: "share", title, "data-pod": holder.pod, text: holder.pod,
                              style: { width: `${width}%`, background: colour(holder.pod.split("/")[0]) } });
    if (used && used.smPercent !== null) {
      share.style.position = "relative";
      share.appendChild(el("span", { class: "used", style: { width: `${Math.min(100, (used.smPercent * 1000) / Math.max(1, holder.milli))}%` } }));
    }
    compute.appendChild(share);
    if (gpu.memoryMiB.capacity > 0) {
      memory.appendChild(el("div", { class: "share", title,
        style: { width: `${(100 * holder.memoryMiB) / gpu.memoryMiB.capacity}%`, background: colour(holder.pod.split("/")[0]) } }));
    }
  }
  bars.appendChild(compute);
  bars.appendChild(memory);
  row.appendChild(bars);
  const free = gpu.healthy ? `${gpu.milli.free}m, ${gpu.memoryMiB.free} MiB free` : `unhealthy: ${gpu.reason}`;
  const side = el("div", { class: "free", text: free });
  if (gpu.overcommitted.length) side.appendChild(el("div", { class: "overcommitted", text: "over-committed" }));
  row.appendChild(side);
  return row;
}

function draw(map) {
  const inventory = map.inventory;
  const usage = usageOf(map);
  const t = inventory.totals;
  document.getElementById("totals").textContent =
    `${inventory.nodes.length} node(s), ${t.gpus} GPU(s), ${t.entirelyFree} entirely free; ` +
    `${t.milli.used}/${t.milli.capacity} milli-GPU held`;
  document.getElementById("updated").textContent = `read ${new Date().toLocaleTimeString()}`;
  const nodes = document.getElementById("nodes");
  nodes.replaceChildren(...inventory.nodes.map((node) => {
    const card = el("div", { class: "node", "data-node": node.name });
    card.appendChild(el("h3", { text: node.name }));
    for (const gpu of node.gpus) card.appendChild(gpuRow(node, gpu, usage));
    return card;
  }));
  const pending = document.getElementById("pending");
  pending.replaceChildren(...(map.pending.length ? map.pending.map((p) => {
    const item = el("li", { "data-pod": `${p.namespace}/${p.pod}` });
    item.appendChild(el("strong", { text: `${p.namespace}/${p.pod}` }));
    item.appendChild(el("span", { text: p.asks ? ` (${p.asks}): ` : ": " }));
    item.appendChild(el("span", { class: "why", text: p.message }));
    return item;
  }) : [el("li", { text: "none" })]));
  const idle = document.getElementById("idle");
  idle.replaceChildren(...(map.idle.length ? map.idle.map((i) =>
    el("li", { "data-pod": `${i.namespace}/${i.pod}`,
               text: `${i.namespace}/${i.pod} idle since ${i.since} (policy ${i.policy}: ${i.action})` }))
    : [el("li", { text: "none" })]));
  const table = document.getElementById("budgets");
  const rows = [el("tr", {}, el("th", { text: "namespace" }), el("th", { text: "what" }), el("th", { text: "used / limit" }), el("th", { text: "state" }))];
  for (const b of map.budgets.budgets) {
    rows.push(el("tr", {}, el("td", { text: b.namespace || (b.namespaces || []).join(", ") }), el("td", { text: `budget ${b.name}` }),
      el("td", { text: `${(b.usedGPUSeconds / 3600).toFixed(1)} / ${(b.limitGPUSeconds / 3600).toFixed(1)} GPU-h` }), el("td", { text: b.state })));
  }
  for (const q of map.budgets.quotas || []) {
    rows.push(el("tr", {}, el("td", { text: q.namespace }), el("td", { text: `quota ${q.name} ${q.resource}` }),
      el("td", { text: `${q.held} / ${q.hard}` }), el("td", { text: "" })));
  }
  if (rows.length === 1) rows.push(el("tr", {}, el("td", { text: "none" })));
  table.replaceChildren(...rows);
  document.getElementById("notes").replaceChildren(...map.notes.map((n) => el("li", { text: n })));
}

async function refresh() {
  try {
    const response = await fetch("/api/map", { cache: "no-store" });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error || response.statusText);
    draw(body);
    document.body.setAttribute("data-state", "ready");
  } catch (error) {
    document.getElementById("totals").textContent = `cannot read the cluster: ${error.message}`;
    document.body.setAttribute("data-state", "error");
  }
}

refresh();
setInterval(refresh, REFRESH_MS);
