"""The fleet benchmark's step results (``benchmarks/bench_fleet.py``): the client processes'
counters merged into one row per step, and the row printed as markdown tables (absolute figures,
ratios to the store's single-client step, where hits and loads came from, the store's own
per-command costs)."""

from __future__ import annotations

import statistics

GB = 1e9
KINDS = ("lookup", "get", "put")
#: Store-tier counters summed over clients (the StorageManager's, the metrics wrapper's, the
#: value tier's): what the report reads.
STORE_STATS = ("hits", "misses", "bytes_read", "bytes_put", "written", "dropped_puts",
               "dropped_queue_full", "dropped_down", "dropped_full", "put_errors", "faults",
               "timeouts", "socket_timeouts", "breaker_trips", "breaker_refused", "remote_errors",
               "store_errors", "gets", "negative_hits")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def merge(results: list[dict], store: str, clients: int, timeout_s: float) -> dict:
    """Sum counters over clients; rates over the clients' mean run time; latency percentiles
    over every call."""
    dur = statistics.mean(r["elapsed"] for r in results) or 1e-9
    n = {k: sum(r["n"][k] for r in results) for k in results[0]["n"]}
    st = {k: sum(r["store"][k] for r in results) for k in STORE_STATS}
    lat = {k: [x for r in results for x in r["lat"][k]] for k in KINDS}
    l1_hits = sum(r["l1_hits"] for r in results)
    bounded_calls = n["lookup_calls"] + max(0.0, st["gets"])
    row = {
        "store": store, "clients": clients, "timeout_s": timeout_s, "duration_s": dur,
        # CPU of the client processes (every thread: kvplug's and the store client library's)
        "client_cores": sum(r.get("cpu_s", 0.0) for r in results) / dur,
        "passes": n["passes"], "events": n["events"],
        # how many engines' traffic, at the recorded pace, the step carried
        "engines_equiv": n["trace_s"] / dur,
        "lookup_calls_s": n["lookup_calls"] / dur, "lookup_keys_s": n["lookup_keys"] / dur,
        "lookup_found": n["lookup_found"] / max(1, n["lookup_keys"]),
        "put_gb_s": st["bytes_put"] / dur / GB, "put_submitted_gb_s": n["put_bytes"] / dur / GB,
        "get_store_gb_s": st["bytes_read"] / dur / GB, "get_total_gb_s": n["get_bytes"] / dur / GB,
        "get_calls_s": n["get_calls"] / dur,
        "get_miss": 1 - n["get_hits"] / n["get_keys"] if n["get_keys"] else 0.0,
        "get_from_l1": l1_hits, "get_from_store": st["hits"],
        **{f"get_{k}": n[f"get_{k}"] for k in ("l1_shared", "store_shared", "l1_private",
                                               "store_private")},
        # calls past the tier's timeout_s (socket) or the StorageManager's bound on the tier
        "timeouts": st["timeouts"] + st["socket_timeouts"],
        "timeout_share": (st["timeouts"] + st["socket_timeouts"]) / max(1, bounded_calls),
        "remote_errors": st["remote_errors"], "store_errors": st["store_errors"],
        "faults": st["faults"], "breaker_trips": st["breaker_trips"],
        "breaker_refused": st["breaker_refused"],
        "dropped_puts": st["dropped_puts"], "dropped_share": st["dropped_puts"] / max(1, n["put_keys"]),
        "errors": n["errors"],
        **{f"found_{k}": n[f"found_{k}"] for k in ("l1_shared", "store_shared", "l1_private",
                                                   "store_private")},
    }
    for k in KINDS:
        row[f"{k}_p50_ms"] = _pct(lat[k], 0.5) * 1e3
        row[f"{k}_p99_ms"] = _pct(lat[k], 0.99) * 1e3
    return row


def report(rows: list[dict]) -> None:
    """Markdown tables: absolute figures, then ratios to the store's 1-client step."""
    print("\n| store | N | timeout s | lookups/s (keys/s) | put GB/s | get GB/s store (all) | "
          "p50/p99 ms lookup | get | put | load misses | timeouts | breaker refused | "
          "dropped puts | errors | store CPU (cores) | clients' CPU | engines carried |\n|"
          + "---|" * 17)
    for r in rows:
        print(f"| {r['store']} | {r['clients']} | {r['timeout_s']:g} | {r['lookup_calls_s']:.0f} "
              f"({r['lookup_keys_s']:.0f}) | {r['put_gb_s']:.3f} | {r['get_store_gb_s']:.3f} "
              f"({r['get_total_gb_s']:.3f}) | {r['lookup_p50_ms']:.1f}/{r['lookup_p99_ms']:.0f} "
              f"| {r['get_p50_ms']:.1f}/{r['get_p99_ms']:.0f} | {r['put_p50_ms']:.1f}/"
              f"{r['put_p99_ms']:.0f} | {r['get_miss']:.1%} | {r['timeout_share']:.1%} "
              f"| {r['breaker_refused']:.0f} | {r['dropped_share']:.1%} | {r['errors']:.0f} "
              f"| {r['store_cores']:.2f}" + (f" (master {r['server_cores']:.2f}, storage "
                                             f"{r['node_cores']:.2f})" if "node_cores" in r
                                             else "") + f" | {r['client_cores']:.2f} | "
              f"{r['engines_equiv']:.1f} |")
    print("\nratios to the same store's N=1 step of this run:\n\n| store | N | timeout s | "
          "lookups/s | put GB/s | get GB/s (store) | p99 lookup | p99 get |\n|" + "---|" * 8)
    for r in rows:
        base = next((b for b in rows if b["store"] == r["store"] and b["clients"] == 1), None)
        if base is None:
            continue

        def ratio(k: str, b: dict = base, r: dict = r) -> str:
            return f"{r[k] / b[k]:.2f}x" if b[k] else "-"

        print(f"| {r['store']} | {r['clients']} | {r['timeout_s']:g} | {ratio('lookup_calls_s')} "
              f"| {ratio('put_gb_s')} | {ratio('get_store_gb_s')} | {ratio('lookup_p99_ms')} "
              f"| {ratio('get_p99_ms')} |")
    print("\nhot prefixes: where lookups found chunks and where loaded chunks came from, shared "
          "ids / private ids:\n\n| store | N | timeout s | found shared: L1 / store | found "
          "private: L1 / store | loaded shared: L1 / store | loaded private: L1 / store |\n|"
          + "---|" * 7)
    for r in rows:
        print(f"| {r['store']} | {r['clients']} | {r['timeout_s']:g} | {r['found_l1_shared']:.0f} "
              f"/ {r['found_store_shared']:.0f} | {r['found_l1_private']:.0f} / "
              f"{r['found_store_private']:.0f} | {r['get_l1_shared']:.0f} / "
              f"{r['get_store_shared']:.0f} | {r['get_l1_private']:.0f} / "
              f"{r['get_store_private']:.0f} |")


    for r in rows:
        if r.get("store_commands"):
            cmds = ", ".join(f"{k} {c:.0f} calls {u / max(1, c):.1f} us/call"
                             for k, (c, u) in sorted(r["store_commands"].items())
                             if k != "evicted_keys")
            cmds += f"; keys evicted by maxmemory: {r['store_commands']['evicted_keys'][0]}"
            print(f"\nredis-server commands, N={r['clients']} timeout_s={r['timeout_s']:g}: {cmds}")
