"""PNG plots of a benchmark run (matplotlib, Agg backend): ``make(out_dir, peers, service)``
returns the paths it wrote. Called by ``benchmarks/run.py``; each plot reads only the result
dicts that ``peers.py`` and ``service.py`` write as JSON, so ``python benchmarks/plots.py DIR``
redraws them from ``DIR/peers.json`` and ``DIR/service.json``."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {
    "gpulock-async": "#1f6feb",
    "gpulock-sync": "#58a6ff",
    "rs-sem": "#d29922",
    "rs-multi": "#bf8700",
    "redislock": "#8250df",
    "redispy": "#cf222e",
    "asyncio-sem": "#6e7781",
}
LABELS = {
    "gpulock-async": "gpulock AsyncPool",
    "gpulock-sync": "gpulock Pool (sync)",
    "rs-sem": "redis-semaphore Semaphore",
    "rs-multi": "redis-semaphore MultiSemaphore",
    "redislock": "python-redis-lock",
    "redispy": "redis-py Lock",
    "asyncio-sem": "asyncio.Semaphore (1 process only)",
}


def _ok(x: Any) -> bool:
    return isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x))


def _title(fig, text: str, R: dict) -> None:
    la = R.get("machine", {}).get("loadavg_start", [math.nan])[0]
    fig.suptitle(text, fontsize=12, fontweight="bold")
    fig.text(
        0.99,
        0.005,
        f"{'quick' if R.get('quick') else 'full'} run; load avg {la:.2f} at start",
        ha="right",
        va="bottom",
        fontsize=7,
        color="#57606a",
    )


def plot_uncontended(P: dict, path: Path) -> None:
    rows = [r for r in (P.get("uncontended_rows") or []) if r["subject"] != "asyncio-sem"]
    if not rows:
        return
    U = P["uncontended"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1, 1.15]})
    ax = axes[0]
    y = list(range(len(rows)))
    ax.barh(y, [r["ratio"] * 100 for r in rows], color=[COLORS[r["subject"]] for r in rows])
    for i, r in enumerate(rows):
        ax.text(r["ratio"] * 100, i, f" {r['ratio']:.0%}", va="center", fontsize=8)
    ax.axvline(45, color="#1f6feb", ls="--", lw=0.9)
    ax.text(45, len(rows) - 0.45, " 45 %: gpulock's target", color="#1f6feb", fontsize=7)
    ax.axvline(50, color="k", ls=":", lw=0.9)
    ax.text(50, -0.6, " 50 %: two round trips", fontsize=7)
    ax.set_yticks(y, [LABELS[r["subject"]] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 85)
    ax.set_xlabel("% of its own client's single-connection EVALSHA rate")
    ax.set_title("pairs/s as a share of the client's ceiling", fontsize=9)
    ax = axes[1]
    bars = [
        (f"ceiling: {lab}", U[part]["ceiling"], "#d0d7de")
        for part, lab in (
            ("sync", "redis-py sync"),
            ("async", "redis-py asyncio"),
            ("node", "ioredis"),
        )
        if part in U
    ]
    bars += [(LABELS[r["subject"]], r["rate"], COLORS[r["subject"]]) for r in rows]
    yy = list(range(len(bars)))
    ax.barh(yy, [b[1] for b in bars], color=[b[2] for b in bars])
    for i, b in enumerate(bars):
        ax.text(b[1], i, f" {b[1]:,.0f}/s", va="center", fontsize=8)
    ax.set_yticks(yy, [b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(b[1] for b in bars) * 1.3)
    ax.set_xlabel("per second, one connection, no contention")
    ax.set_title("absolute: EVALSHA 'return 1' ceilings and acquire+release pairs", fontsize=9)
    sem = next((r for r in P["uncontended_rows"] if r["subject"] == "asyncio-sem"), None)
    if sem:
        ax.text(
            0.99,
            0.02,
            f"asyncio.Semaphore, no Redis, one process only: {sem['rate']:,.0f}/s",
            transform=ax.transAxes,
            ha="right",
            fontsize=7,
            color="#57606a",
        )
    _title(fig, "Uncontended acquire+release", P)
    fig.tight_layout(rect=(0, 0.02, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_handoff(P: dict, path: Path) -> None:
    H = P.get("chains") or {}
    if not H:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    for ax, key, what in ((axes[0], "p50_ms", "p50"), (axes[1], "p99_ms", "p99")):
        for s, d in H.items():
            ns = sorted((int(n) for n in d if int(n) <= 100), key=int)
            ys = [d[str(n)].get(key) for n in ns]
            pts = [(n, max(v, 0.003)) for n, v in zip(ns, ys) if _ok(v)]
            if not pts:
                continue
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                color=COLORS[s],
                label=LABELS[s],
                lw=2.2 if s.startswith("gpulock") else 1.3,
                ls=":" if s == "asyncio-sem" else "-",
            )
        tgt = {"p50_ms": [(10, 0.1)], "p99_ms": [(10, 0.5), (100, 1.0)]}[key]
        for n, v in tgt:
            ax.plot([n], [v], marker="*", ms=13, color="#1f6feb", mec="k", ls="none")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks([1, 10, 100], ["1", "10", "100"])
        ax.set_xlabel("waiters")
        ax.set_title(f"hand-off latency {what}: release returns -> next holder", fontsize=9)
        ax.grid(True, which="both", alpha=0.25)
    axes[0].set_ylabel("ms (log)")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[0].text(
        0.02,
        0.02,
        "stars: gpulock's targets (docs/BENCHMARKS.md)",
        transform=axes[0].transAxes,
        fontsize=7,
        color="#1f6feb",
    )
    _title(
        fig,
        "Hand-off latency (capacity 1, each holder holds "
        f"{P.get('config', {}).get('chain_hold_ms', '?')} ms)",
        P,
    )
    fig.tight_layout(rect=(0, 0.02, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_commands(P: dict, path: Path) -> None:
    H = P.get("chains") or {}
    if not H:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for s, d in H.items():
        if s == "asyncio-sem":
            continue
        ns = sorted((int(n) for n in d if int(n) >= 10))
        a = [(n, d[str(n)].get("cmds_per_grant")) for n in ns]
        a = [p for p in a if _ok(p[1])]
        b = [(n, d[str(n)].get("stall", {}).get("per_waiter_second")) for n in ns]
        b = [(n, max(v, 1e-3)) for n, v in b if _ok(v)]
        kw = dict(
            marker="o", color=COLORS[s], label=LABELS[s], lw=2.2 if s.startswith("gpulock") else 1.3
        )
        if a:
            axes[0].plot([p[0] for p in a], [p[1] for p in a], **kw)
        if b:
            axes[1].plot([p[0] for p in b], [p[1] for p in b], **kw)
    axes[0].axhline(4, color="#1f6feb", ls="--", lw=0.8)
    axes[0].text(10, 4.3, "gpulock target: <= 4, flat", fontsize=7, color="#1f6feb")
    for ax, t, yl in (
        (axes[0], "client commands per grant", "commands (log)"),
        (
            axes[1],
            "client commands per waiter per second, lock held",
            "commands/s (log; 0 drawn at 0.001)",
        ),
    ):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks([10, 100, 1000], ["10", "100", "1,000"])
        ax.set_xlabel("waiters")
        ax.set_ylabel(yl)
        ax.set_title(t, fontsize=9)
        ax.grid(True, which="both", alpha=0.25)
    axes[1].legend(fontsize=7, loc="center right")
    _title(fig, "Redis commands (INFO commandstats, script-internal calls excluded)", P)
    fig.tight_layout(rect=(0, 0.02, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_reclaim(P: dict, path: Path) -> None:
    RC = P.get("reclaim") or {}
    short = RC.get("short") or {}
    subs = [s for s in short if isinstance(short[s], dict) and "lag_p50_ms" in short[s]]
    if not subs:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    for i, s in enumerate(subs):
        d = short[s]
        lags = [t["expiry_to_regain_ms"] for t in d["trials"] if "expiry_to_regain_ms" in t]
        ax.scatter([max(x, 0.1) for x in lags], [i] * len(lags), color=COLORS[s], alpha=0.6, s=18)
        if _ok(d["lag_p50_ms"]):
            ax.plot([max(d["lag_p50_ms"], 0.1)], [i], marker="|", ms=18, color="k")
    ax.axvline(5, color="#1f6feb", ls="--", lw=0.8)
    ax.set_yticks(range(len(subs)), [LABELS[s] for s in subs], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("ms from the dead holder's expiry to the waiter holding (log; bar = p50)")
    ax.set_title(
        f"lag after expiry, {RC.get('short_ttl_s', 1):.0f} s expiry for every one", fontsize=9
    )
    ax.invert_yaxis()
    ax.grid(True, which="both", axis="x", alpha=0.25)
    ax = axes[1]
    dflt = RC.get("default") or {}
    names, vals, notes = [], [], []
    for s in ("gpulock-async", "rs-sem", "rs-multi", "redislock", "redispy"):
        d = dflt.get(s)
        bound = (P.get("defaults") or {}).get(s, {}).get("free_after_s")
        names.append(LABELS[s])
        if isinstance(d, dict) and d.get("n"):
            vals.append(d["kill_to_regain_p50_ms"] / 1000)
            notes.append(f"{vals[-1]:.1f} s (measured)")
        elif isinstance(d, dict) and d.get("not_regained_after_s"):
            vals.append(d["not_regained_after_s"])
            notes.append(f"not in {d['not_regained_after_s']:.0f} s (measured)")
        else:
            vals.append(bound if bound else 40)
            notes.append(f"<= {bound:.0f} s (documented)" if bound else "never (documented)")
    ax.barh(
        range(len(names)),
        vals,
        color=[COLORS[s] for s in ("gpulock-async", "rs-sem", "rs-multi", "redislock", "redispy")],
        hatch=[None if "measured" in n else "//" for n in notes],
    )
    for i, n in enumerate(notes):
        ax.text(vals[i], i, "  " + n, va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(vals) * 1.8)
    ax.set_xlabel("s from the crash to a waiter holding")
    ax.text(
        0.99,
        0.02,
        "hatched: from the docs, not run (--quick)",
        transform=ax.transAxes,
        ha="right",
        fontsize=7,
        color="#57606a",
    )
    ax.set_title("time to regain a crashed holder's permits, defaults", fontsize=9)
    _title(fig, "Crash reclaim", P)
    fig.tight_layout(rect=(0, 0.02, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fairness(P: dict, path: Path) -> None:
    F = P.get("fairness") or {}
    subs = [s for s in F if isinstance(F[s], dict) and "by_size" in F[s]]
    if not subs:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    sizes = sorted(F[subs[0]]["by_size"], key=int)
    w = 0.8 / len(subs)
    for j, s in enumerate(subs):
        bs = F[s]["by_size"]
        xs = [i + j * w for i in range(len(sizes))]
        axes[0].bar(
            xs,
            [max(bs[k]["mean_wait_ms"], 0.1) for k in sizes],
            w,
            color=COLORS[s],
            label=f"{LABELS[s]} (Jain {F[s]['jain_mean_wait']:.2f})",
        )
        axes[0].scatter(
            xs, [max(bs[k]["max_wait_ms"], 0.1) for k in sizes], marker="_", s=200, color="k"
        )
        axes[1].bar(xs, [bs[k]["grants_per_s"] for k in sizes], w, color=COLORS[s], label=LABELS[s])
    for ax in axes:
        ax.set_xticks(
            [i + w * (len(subs) - 1) / 2 for i in range(len(sizes))], [f"size {k}" for k in sizes]
        )
    axes[0].set_yscale("log")
    axes[0].set_ylabel("wait, ms (log; bar mean, tick max)")
    axes[0].set_title("wait by request size", fontsize=9)
    axes[1].set_ylabel("grants per second, all participants of that size")
    axes[1].set_title("throughput by request size", fontsize=9)
    axes[0].legend(fontsize=7)
    f = F[subs[0]]
    _title(
        fig,
        f"Fairness under mixed sizes: {len(f['sizes'])} participants "
        f"({'/'.join(map(str, f['sizes']))}) on capacity {f['capacity']}, hold {f['hold_ms']} ms",
        P,
    )
    fig.tight_layout(rect=(0, 0.02, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_service(S: dict, path: Path) -> None:
    V = S.get("variants") or {}
    if not V:
        return
    keys = [k for k in ("gpulock", "per-worker", "global") if k in V]
    col = {"gpulock": "#1f6feb", "per-worker": "#cf222e", "global": "#6e7781"}
    fig = plt.figure(figsize=(12, 7.5))
    gs = fig.add_gridspec(2, 4, height_ratios=[1, 1.1])
    labels = [
        V[k]["label"].split(":")[0] if ":" in V[k]["label"] else V[k]["label"][:3] for k in keys
    ]
    short = {
        "gpulock": "(a) gpulock",
        "per-worker": "(b) per-worker sem",
        "global": "(c) global lock",
    }
    labels = [short[k] for k in keys]
    panels = [
        ("requests/s", lambda d: d["requests_per_s"], "{:.0f}"),
        ("latency p99 (ms)", lambda d: d["latency_ms"]["p99"], "{:.0f}"),
        ("budget overruns (work starts over budget)", lambda d: d["budget"]["overruns"], "{:,}"),
        (
            "budget utilization (time-weighted)",
            lambda d: d["budget"]["utilization"] * 100,
            "{:.0f}%",
        ),
    ]
    for i, (t, f, fmt) in enumerate(panels):
        ax = fig.add_subplot(gs[0, i])
        vals = [f(V[k]) for k in keys]
        ax.bar(range(len(keys)), vals, color=[col[k] for k in keys])
        for x, v in enumerate(vals):
            ax.text(x, v, fmt.format(v), ha="center", va="bottom", fontsize=8)
        if "utilization" in t:
            ax.axhline(100, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(keys)), labels, fontsize=7, rotation=15)
        ax.set_title(t, fontsize=9)
        ax.margins(y=0.15)
    ax = fig.add_subplot(gs[1, :])
    cap = S["capacity"] / 2**20
    for k in keys:
        tl = V[k].get("timeline") or {}
        if tl.get("t"):
            ax.step(
                tl["t"],
                tl["used_mib"],
                where="post",
                color=col[k],
                lw=1,
                label=short[k],
                alpha=0.85,
            )
    ax.axhline(cap, color="k", ls="--", lw=1)
    ax.text(0, cap, " budget", va="bottom", fontsize=8)
    ax.set_xlabel("seconds into the measured window")
    ax.set_ylabel("MiB in use (from the workers' history)")
    ax.set_title("bytes in use by running requests, 4 workers", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    c = S["config"]
    _title(
        fig,
        f"Service: 4 workers, {c['concurrency']} clients, requests of "
        f"{'/'.join(str(s * S['unit'] // 2**20) for s in S['sizes'])} MiB x {c['hold_s'] * 1000:.0f} ms, "
        f"budget {cap:.0f} MiB",
        S,
    )
    fig.tight_layout(rect=(0, 0.02, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scheduling(R: dict, path: Path) -> None:
    """``benchmarks/scheduling.py``: utilization per workload and policy; p50/p99 wait per
    class (size; priority for the priority workload, tenant for the tenants one) per policy."""
    runs = R.get("runs") or []
    if not runs:
        return
    col = {"fifo": "#6e7781", "backfill": "#1f6feb"}
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    fig, axes = plt.subplots(1, 1 + len(workloads), figsize=(4 + 3.6 * len(workloads), 4.2))
    ax = axes[0]
    for j, pol in enumerate(("fifo", "backfill")):
        vals = [
            next(
                (r["utilization"] * 100 for r in runs if r["workload"] == w and r["policy"] == pol),
                0,
            )
            for w in workloads
        ]
        xs = [i + (j - 0.5) * 0.38 for i in range(len(workloads))]
        ax.bar(xs, vals, width=0.36, color=col[pol], label=pol)
        for x, v in zip(xs, vals):
            ax.text(x, v, f"{v:.0f}%", ha="center", va="bottom", fontsize=7)
    ax.axhline(100, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(workloads)), workloads, fontsize=8)
    ax.set_title("budget utilization (time-weighted)", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.margins(y=0.12)
    for ax, w in zip(axes[1:], workloads):
        by = {"priority": "wait_by_priority_ms", "tenants": "wait_by_tenant_ms"}.get(
            w, "wait_by_size_ms"
        )
        classes = list(dict.fromkeys(k for r in runs if r["workload"] == w for k in r[by]))
        for j, pol in enumerate(("fifo", "backfill")):
            r = next((r for r in runs if r["workload"] == w and r["policy"] == pol), None)
            if r is None:
                continue
            xs = [i + (j - 0.5) * 0.38 for i in range(len(classes))]
            p99 = [r[by].get(k, {}).get("p99", 0) for k in classes]
            p50 = [r[by].get(k, {}).get("p50", 0) for k in classes]
            ax.bar(xs, p99, width=0.36, color=col[pol], alpha=0.45)
            ax.bar(xs, p50, width=0.36, color=col[pol], label=f"{pol} p50 (light: p99)")
        label = {"priority": "prio {}", "tenants": "tenant {}"}.get(w, "{} MiB")
        names = [label.format(k) for k in classes]
        ax.set_xticks(range(len(classes)), names, fontsize=7)
        ax.set_ylabel("wait (ms)", fontsize=8)
        ax.set_title(f"{w}: wait per class", fontsize=9)
        ax.legend(fontsize=7)
    c = R["config"]
    _title(
        fig,
        f"Scheduling: {c['clients']} clients, {c['hold_s'] * 1000:.0f} ms holds, 1 GiB pool, "
        f"backfill window {c['backfill_window_s']:g} s",
        R,
    )
    fig.tight_layout(rect=(0, 0.02, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_placement(R: dict, path: Path) -> None:
    """``benchmarks/scheduling.py``'s placement rows: utilization of the devices per row and
    workload; p50/p99 wait per size class per row, one panel per workload."""
    runs = R.get("placement") or []
    if not runs:
        return
    rows = list(dict.fromkeys(r["row"] for r in runs))
    palette = ["#1f6feb", "#8250df", "#6e7781", "#2da44e", "#d29922"]
    col = {row: palette[i % len(palette)] for i, row in enumerate(rows)}
    width = 0.8 / len(rows)
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    fig, axes = plt.subplots(1, 1 + len(workloads), figsize=(4.5 + 4 * len(workloads), 4.2))
    ax = axes[0]
    for j, row in enumerate(rows):
        vals = [
            next(
                (r["utilization"] * 100 for r in runs if r["workload"] == w and r["row"] == row), 0
            )
            for w in workloads
        ]
        xs = [i + (j - (len(rows) - 1) / 2) * width for i in range(len(workloads))]
        ax.bar(xs, vals, width=width * 0.95, color=col[row], label=row)
        for x, v in zip(xs, vals):
            ax.text(x, v, f"{v:.0f}%", ha="center", va="bottom", fontsize=7)
    ax.axhline(100, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(workloads)), workloads, fontsize=8)
    ax.set_title(f"utilization of the {R.get('devices', 4)} devices", fontsize=9)
    ax.set_ylim(0, 135)
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    for ax, w in zip(axes[1:], workloads):
        classes = list(
            dict.fromkeys(k for r in runs if r["workload"] == w for k in r["wait_by_size_ms"])
        )
        for j, row in enumerate(rows):
            r = next((r for r in runs if r["workload"] == w and r["row"] == row), None)
            if r is None:
                continue
            xs = [i + (j - (len(rows) - 1) / 2) * width for i in range(len(classes))]
            by = r["wait_by_size_ms"]
            p99 = [by.get(k, {}).get("p99", 0) for k in classes]
            p50 = [by.get(k, {}).get("p50", 0) for k in classes]
            ax.bar(xs, p99, width=width * 0.95, color=col[row], alpha=0.45)
            ax.bar(xs, p50, width=width * 0.95, color=col[row], label=row)
        ax.set_xticks(range(len(classes)), [f"{k} MiB" for k in classes], fontsize=7)
        ax.set_ylabel("wait (ms)", fontsize=8)
        ax.set_title(f"{w}: wait per size (dark p50, light p99)", fontsize=9)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.35)  # room for the legend above the bars
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    c = R["config"]
    _title(
        fig,
        f"Placement: {R.get('devices', 4)} devices x 1 GiB, {c['placement_clients']} clients, "
        f"{c['hold_s'] * 1000:.0f} ms holds",
        R,
    )
    fig.tight_layout(rect=(0, 0.02, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


GEN_COLORS = {
    "elastic": "#1f6feb",
    "elastic-queued": "#8250df",
    "elastic-backfill": "#bf8700",
    "reserve": "#58a6ff",
    "per-worker": "#cf222e",
    "per-worker-safe": "#6e7781",
}


def plot_generation(R: dict, path: Path) -> None:
    """``benchmarks/generation.py``: streams at once and tokens/s per mode; TTFT p50/p99 per
    mode; the KV bytes in use over the window as a share of the budget, per mode."""
    runs = R.get("runs") or []
    if not runs:
        return
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6), gridspec_kw={"width_ratios": [1, 1, 1.4]})
    names = [r["mode"] for r in runs]
    cols = [GEN_COLORS.get(m, "#8250df") for m in names]
    y = list(range(len(runs)))
    ax = axes[0]
    ax.barh(y, [r["tokens_per_s"] for r in runs], color=cols)
    for i, r in enumerate(runs):
        ax.text(
            r["tokens_per_s"],
            i,
            f" {r['tokens_per_s']:,.0f}/s; {r['concurrent_mean']:.0f} at once (max "
            f"{r['concurrent_max']:.0f})",
            va="center",
            fontsize=7,
        )
    ax.set_yticks(y, [r["label"] for r in runs], fontsize=7)
    ax.invert_yaxis()
    ax.margins(x=0.6)
    ax.set_xlabel("tokens/s, all streams")
    ax.set_title("throughput and streams admitted at once", fontsize=9)
    ax = axes[1]
    ax.barh(y, [r["ttft_ms"]["p99"] for r in runs], color=cols, alpha=0.45, label="p99")
    ax.barh(y, [r["ttft_ms"]["p50"] for r in runs], color=cols, label="p50")
    for i, r in enumerate(runs):
        ax.text(
            r["ttft_ms"]["p99"],
            i,
            f" {r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f} ms",
            va="center",
            fontsize=7,
        )
    ax.set_yticks(y, [""] * len(runs))
    ax.invert_yaxis()
    ax.margins(x=0.35)
    ax.set_xlabel("time to first token (ms): p50, light p99")
    ax.set_title("time to first token", fontsize=9)
    ax = axes[2]
    for r, c in zip(runs, cols):
        s = [v * 100 for v in r["use_series"]]
        ax.plot([i * 0.1 for i in range(len(s))], s, color=c, lw=0.9, label=r["label"])
    ax.axhline(100, color="k", lw=0.9, ls="--")
    ax.text(
        0.99,
        100,
        "budget: above it, CUDA OOM ",
        fontsize=7,
        va="bottom",
        ha="right",
        transform=ax.get_yaxis_transform(),
    )
    ax.set_ylim(0, max(130, ax.get_ylim()[1]))
    ax.set_xlabel("seconds into the window")
    ax.set_ylabel("KV cache in use, % of budget")
    ax.set_title("KV bytes in use across all workers", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    c = R["config"]
    _title(
        fig,
        f"Generations on a {c['budget'] / 2**30:g} GiB KV budget (Llama-2-7B fp16, simulated "
        f"decoding): {c['clients']} clients, {c['workers']} workers",
        R,
    )
    fig.tight_layout(rect=(0, 0.02, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make(out_dir: str | Path, peers: dict | None, service: dict | None) -> list[str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    made = []
    jobs = []
    if peers:
        jobs += [
            (plot_uncontended, peers, "uncontended.png"),
            (plot_handoff, peers, "handoff.png"),
            (plot_commands, peers, "commands.png"),
            (plot_reclaim, peers, "reclaim.png"),
            (plot_fairness, peers, "fairness.png"),
        ]
    if service:
        jobs.append((plot_service, service, "service.png"))
    for fn, data, name in jobs:
        p = out / name
        p.unlink(missing_ok=True)  # never report a stale picture from an earlier run
        try:
            fn(data, p)
        except Exception as e:  # a plot must not sink the run: say which and why
            print(f"# plot {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        if p.exists():
            made.append(str(p))
    return made


if __name__ == "__main__":
    d = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent / "results")
    load = lambda n: json.loads((d / n).read_text()) if (d / n).exists() else None  # noqa: E731
    print("\n".join(make(d, load("peers.json"), load("service.json"))))
