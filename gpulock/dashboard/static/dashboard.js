// gpulock's live dashboard: polls dashboard/data once a second and draws each pool (numbers,
// an SVG chart of the last 15 minutes, the leases and the queue). No dependencies, no build.
// The JSON carries bytes and seconds; this file formats them. An admin token (the broker's)
// comes from the URL fragment (#token=...) or the form, is kept in sessionStorage and sent as
// "Authorization: Bearer"; the fragment is removed from the address bar at once.
(function () {
  "use strict";
  var TOKEN_KEY = "gpulock-dashboard-token";
  var INTERVAL_MS = 1000;
  var WINDOW_MS = 15 * 60 * 1000;
  var SVG = "http://www.w3.org/2000/svg";
  var updates = 0;

  function takeFragmentToken() {
    var m = /(?:^#|&)token=([^&]*)/.exec(window.location.hash);
    if (m) {
      sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
      history.replaceState(null, "", window.location.pathname + window.location.search);
    }
  }

  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    var units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    var v = Math.abs(n), i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    var s = i === 0 ? String(v) : v.toFixed(v < 10 ? 2 : v < 100 ? 1 : 0);
    return (n < 0 ? "-" : "") + s + " " + units[i];
  }

  function fmtSeconds(s) {
    if (s === null || s === undefined) return "–";
    if (s < 60) return s.toFixed(1) + " s";
    var m = Math.floor(s / 60);
    return m + " min " + Math.round(s - 60 * m) + " s";
  }

  // a waiter's estimated wait: "~12.0 s", "–" while the pool's drain rate is not measured
  function fmtWait(s) {
    return s === null || s === undefined ? "–" : "~" + fmtSeconds(Math.max(0, s));
  }

  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function svg(tag, attrs, text) {
    var e = document.createElementNS(SVG, tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function holderText(h) {
    var parts = [];
    for (var k in h) parts.push(k + "=" + h[k]);
    return parts.join(" ");
  }

  function stat(label, field, value, shown) {
    var d = el("div", { "class": "stat" });
    d.appendChild(el("span", { "class": "label" }, label));
    var attrs = { "class": "value", "data-field": field };
    if (value !== null && value !== undefined) attrs["data-value"] = String(value);
    d.appendChild(el("span", attrs, shown));
    return d;
  }

  function chart(p) {
    var W = 900, H = 220, L = 70, R = 10, T = 10, B = 24;
    var s = svg("svg", { "class": "chart", viewBox: "0 0 " + W + " " + H, role: "img",
      "aria-label": "capacity, used and resident bytes over the last 15 minutes" });
    var h = p.history, n = h.t.length;
    var top = Math.max(p.capacity, 1);
    for (var i = 0; i < n; i++) top = Math.max(top, h.capacity[i], h.used[i]);
    var now = n ? h.t[n - 1] : 0;
    function x(t) { return L + (W - L - R) * (1 - (now - t) / WINDOW_MS); }
    function y(v) { return T + (H - T - B) * (1 - v / top); }
    for (var g = 0; g <= 4; g++) {
      var v = top * g / 4, yy = y(v);
      s.appendChild(svg("line", { "class": "grid", x1: L, x2: W - R, y1: yy, y2: yy }));
      s.appendChild(svg("text", { "class": "axis", x: L - 6, y: yy + 4, "text-anchor": "end" }, fmtBytes(Math.round(v))));
    }
    for (var m = 0; m <= 15; m += 5) {
      s.appendChild(svg("text", { "class": "axis", x: x(now - (15 - m) * 60000), y: H - 6,
        "text-anchor": m === 0 ? "start" : m === 15 ? "end" : "middle" }, m === 15 ? "now" : "-" + (15 - m) + " min"));
    }
    ["capacity", "resident", "used"].forEach(function (f) {
      if (!n) return;
      var pts = [];
      for (var i = 0; i < n; i++) pts.push(x(h.t[i]).toFixed(1) + "," + y(h[f][i]).toFixed(1));
      s.appendChild(svg("polyline", { "class": f, points: pts.join(" "), "data-series": f }));
    });
    return s;
  }

  function table(cls, heads, rows) {
    var t = el("table", { "class": cls });
    var tr = el("tr");
    heads.forEach(function (h) { tr.appendChild(el("th", { "class": h[1] ? "num" : "" }, h[0])); });
    t.appendChild(el("thead")).appendChild(tr);
    var body = t.appendChild(el("tbody"));
    rows.forEach(function (r) { body.appendChild(r); });
    return t;
  }

  function cell(text, value) {
    var attrs = value === undefined ? {} : { "class": "num", "data-value": String(value) };
    return el("td", attrs, text);
  }

  function poolSection(p) {
    var sec = el("section", { "class": "pool", "data-pool": p.pool });
    sec.appendChild(el("h2", {}, p.pool));
    var st = sec.appendChild(el("div", { "class": "stats" }));
    st.appendChild(stat("capacity", "capacity", p.capacity, fmtBytes(p.capacity)));
    st.appendChild(stat("used", "used", p.used, fmtBytes(p.used)));
    st.appendChild(stat("resident", "resident", p.resident, fmtBytes(p.resident)));
    st.appendChild(stat("free", "free", p.free, fmtBytes(p.free)));
    st.appendChild(stat("outside leases (device)", "external", p.external, fmtBytes(p.external)));
    // kept bytes (docs/SEMANTICS.md, "Kept bytes"): part of used, shown once a holder has kept a lease
    var keptN = p.kept_leases || 0;
    if (keptN || p.releases_kept) {
      st.appendChild(stat("kept (leases)", "kept_bytes", p.kept_bytes || 0,
        fmtBytes(p.kept_bytes || 0) + " (" + keptN + ")"));
    }
    st.appendChild(stat("leases", "lease_count", p.lease_count, String(p.lease_count)));
    st.appendChild(stat("queued", "waiter_count", p.waiter_count, String(p.waiter_count)));
    st.appendChild(stat("grants/s", "grant_rate", p.grant_rate,
      p.grant_rate === null ? "–" : p.grant_rate.toFixed(1)));
    // how fast the queue drains while busy (the estimates' rate; docs/SEMANTICS.md)
    var d = p.drain || null;
    st.appendChild(stat("drains/s", "drain", d === null ? null : d.bytes_per_s,
      d === null ? "–" : fmtBytes(Math.round(d.bytes_per_s)) + ", " + d.grants_per_s.toFixed(2) + " grants"));
    st.appendChild(stat("503s (last min)", "rejected", p.rejected,
      p.rejected + (p.rejected_last_minute === null ? "" : " (" + p.rejected_last_minute + ")")));
    st.appendChild(stat("OOMs (last min)", "oom", p.oom,
      p.oom + (p.oom_last_minute === null ? "" : " (" + p.oom_last_minute + ")")));
    var legend = sec.appendChild(el("div", { "class": "legend" }));
    legend.appendChild(el("span", { "class": "used" }, "— used"));
    legend.appendChild(el("span", { "class": "resident" }, "— resident"));
    legend.appendChild(el("span", { "class": "capacity" }, "- - capacity"));
    sec.appendChild(chart(p));

    (p.overusers || []).forEach(function (o) {
      sec.appendChild(el("p", { "class": "overuser", "data-excess": String(o.excess) },
        "over its lease: " + holderText(o.holder) + " uses " + fmtBytes(o.actual) + " for " +
        fmtBytes(o.leased) + " leased, " + fmtBytes(o.excess) + " over"));
    });

    sec.appendChild(el("h3", {}, "Leases (" + p.lease_count + ")"));
    // preemption (docs/SEMANTICS.md, "Preemption"): the setting and its counters, said once
    // it is on or has asked; a lease asked to yield is marked with when the pool takes it back
    var pre = p.preemption || null, y = p.yields || {};
    if (pre || y.asked) {
      sec.appendChild(el("p", { "class": "preemption", "data-preemption": pre ? "on" : "off",
        "data-asked": String(y.asked || 0), "data-done": String(y.done || 0), "data-taken": String(y.taken || 0) },
        (pre ? "preemption: a head waiter " + pre.gap + " or more priority levels above a holder " +
          "asks it to yield, within " + fmtSeconds(pre.yield_grace_s) : "preemption: off") +
        " · asked " + (y.asked || 0) + ", yielded " + (y.done || 0) +
        (y.mean_time_to_yield === null || y.mean_time_to_yield === undefined ? ""
          : " (mean " + fmtSeconds(y.mean_time_to_yield) + " to yield)") +
        ", taken back " + (y.taken || 0)));
    }
    if (keptN || p.releases_kept) {
      sec.appendChild(el("p", { "class": "kept", "data-kept-leases": String(keptN),
        "data-kept-bytes": String(p.kept_bytes || 0), "data-releases-kept": String(p.releases_kept || 0),
        "data-asked-back": String(p.kept_asked_back || 0) },
        "kept: " + keptN + (keptN === 1 ? " lease, " : " leases, ") + fmtBytes(p.kept_bytes || 0) +
        " (their holders give them back when a request does not fit) · releases kept " +
        (p.releases_kept || 0) + ", asked back " + (p.kept_asked_back || 0)));
    }
    var asked = p.leases.some(function (l) { return l.yield_in !== null && l.yield_in !== undefined; });
    var anyKept = p.leases.some(function (l) { return !!l.kept; });
    var leases = p.leases.map(function (l) {
      var yielding = l.yield_in !== null && l.yield_in !== undefined;
      var attrs = { "data-token": String(l.token) };
      var cls = (yielding ? ["yielding"] : []).concat(l.kept ? ["kept"] : []);
      if (cls.length) attrs["class"] = cls.join(" ");
      if (yielding) attrs["data-yield-in"] = String(l.yield_in);
      if (l.kept) attrs["data-kept"] = "1";
      var tr = el("tr", attrs);
      tr.appendChild(cell(holderText(l.holder)));
      tr.appendChild(cell(fmtBytes(l.amount), l.amount));
      tr.appendChild(cell(String(l.token), l.token));
      tr.appendChild(cell(fmtSeconds(l.expires_in), l.expires_in));
      if (asked) {
        tr.appendChild(yielding ? cell("asked to yield: taken back in " + fmtSeconds(Math.max(0, l.yield_in)) +
          " (by " + new Date(Date.now() + 1000 * Math.max(0, l.yield_in)).toLocaleTimeString() + ")")
          : cell("–"));
      }
      if (anyKept) tr.appendChild(cell(l.kept ? "kept by its holder" : "–"));
      return tr;
    });
    var lcols = [["holder"], ["amount", 1], ["token", 1], ["expires in", 1]].concat(asked ? [["yield"]] : [],
      anyKept ? [["kept"]] : []);
    sec.appendChild(leases.length ? table("leases", lcols, leases)
      : el("p", { "class": "empty leases" }, "no leases"));

    sec.appendChild(el("h3", {}, "Queue (" + p.waiter_count + ")"));
    var policy = p.policy || "fifo";
    sec.appendChild(el("p", { "class": "policy", "data-policy": policy }, "policy: " + policy +
      (policy === "backfill" ? " (window " + p.backfill_window + " s: while the head does not fit, " +
        "later requests that fit are granted)" : " (nothing passes the head of the queue)")));
    // a growth column only while a growth of a held lease is queued (named by the lease's token)
    var growths = p.waiters.some(function (w) { return !!w.growth_token; });
    var waiters = p.waiters.map(function (w) {
      var prio = w.priority || 0;
      var tr = el("tr", { "data-position": String(w.position) });
      tr.appendChild(cell(String(w.position), w.position));
      tr.appendChild(cell(fmtBytes(w.amount), w.amount));
      if (growths) {
        tr.appendChild(cell(w.growth_token ? "token " + w.growth_token + " +" + fmtBytes(w.amount) : "-"));
      }
      tr.appendChild(cell(String(prio), prio));
      tr.appendChild(cell(fmtSeconds(w.waited), w.waited));
      var est = w.estimated_wait_s === undefined ? null : w.estimated_wait_s;
      tr.appendChild(cell(fmtWait(est), est === null ? undefined : est));
      tr.appendChild(cell(holderText(w.holder)));
      return tr;
    });
    var wcols = [["position", 1], ["amount", 1]].concat(growths ? [["growth of"]] : [],
      [["priority", 1], ["waited", 1], ["est. wait", 1], ["holder"]]);
    sec.appendChild(waiters.length ? table("waiters", wcols, waiters)
      : el("p", { "class": "empty waiters" }, "nobody waiting"));
    return sec;
  }

  function setStatus(state, text) {
    var s = document.getElementById("status");
    s.setAttribute("data-state", state);
    s.setAttribute("data-updates", String(updates));
    s.textContent = text;
  }

  function slotsText(slots) {
    return slots.map(function (r) { return r[0] === r[1] ? String(r[0]) : r[0] + "–" + r[1]; }).join(", ");
  }

  // A shard of a Redis Cluster that did not answer: its pools are not in the view.
  function shardSection(u) {
    var sec = el("section", { "class": "shard unreachable", "data-node": u.node || "" });
    sec.appendChild(el("h2", {}, "shard " + (u.node || "(no master)") + " unreachable"));
    sec.appendChild(el("p", { "class": "error" }, "slots " + slotsText(u.slots) + ": " + u.error +
      ". The pools of this shard are not shown."));
    return sec;
  }

  function render(view) {
    var main = document.getElementById("pools");
    var next = document.createDocumentFragment();
    var down = view.unreachable || [];
    down.forEach(function (u) { next.appendChild(shardSection(u)); });
    view.pools.forEach(function (p) { next.appendChild(poolSection(p)); });
    Object.keys(view.errors).forEach(function (name) {
      var sec = el("section", { "class": "pool", "data-pool": name });
      sec.appendChild(el("h2", {}, name));
      sec.appendChild(el("p", { "class": "error" }, view.errors[name]));
      next.appendChild(sec);
    });
    if (!view.pools.length && !Object.keys(view.errors).length && !down.length) next.appendChild(el("p", { "class": "empty" }, "no pools"));
    main.replaceChildren(next);
    updates++;
    var when = "updated " + new Date().toLocaleTimeString();
    if (down.length) setStatus("partial", "partial: " + down.length + " shard(s) unreachable · " + when);
    else setStatus("ok", "live · " + when);
  }

  function tick() {
    var headers = { "Accept": "application/json" };
    var token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers["Authorization"] = "Bearer " + token;
    fetch("dashboard/data", { headers: headers, cache: "no-store", credentials: "omit" })
      .then(function (r) {
        if (r.status === 401 || r.status === 403) {
          document.getElementById("login").hidden = false;
          setStatus("unauthorized", r.status === 401 ? "an admin token is required" : "this token is not an admin token");
          return null;
        }
        if (!r.ok) throw new Error("HTTP " + r.status);
        document.getElementById("login").hidden = true;
        return r.json();
      })
      .then(function (view) { if (view) render(view); })
      .catch(function (e) { setStatus("error", "no data: " + e.message); })
      .then(function () { window.setTimeout(tick, INTERVAL_MS); });
  }

  document.addEventListener("DOMContentLoaded", function () {
    takeFragmentToken();
    document.getElementById("login").addEventListener("submit", function (ev) {
      ev.preventDefault();
      sessionStorage.setItem(TOKEN_KEY, document.getElementById("token").value);
      document.getElementById("token").value = "";
    });
    tick();
  });
})();
