"""The per-action table of docs/adapters.md, generated from the spec's declarations.

Owns what an adapter author reads instead of spec/actions.py: per action its parameters and
their ranges, its guard and effect, the state fields the guard reads and the effect writes
(computed from the action bodies: the TRACE logic records every slot an expression reads),
and whether a full-attention config (examples/hashchain.json's shape) ever enables it. The
prose guard/effect lines are written here, one per action; tests/cli/test_action_table.py
fails when an action has none, or when docs/adapters.md differs from `render()`
(`python scripts/action-table.py --write` regenerates it).
"""
from __future__ import annotations

import random
from typing import Any

from ..spec.actions import ACTIONS, run_body
from ..spec.config import Config, LayerSpec
from ..spec.logic import TRACE, Expr
from ..spec.state import View
from ..spec.system import Spec

BEGIN, END = "<!-- action-table:begin (generated: scripts/action-table.py) -->", "<!-- action-table:end -->"

# action -> (guard, effect), in words; the fields each reads and writes are generated.
PROSE: dict[str, tuple[str, str]] = {
    "submit": ("request idle", "waiting, covering n blocks of the shared prefix; lease fields cleared"),
    "lookup": ("request waiting", "the funnel's decision: decided (waiting again on PREFETCH), `rdec`, `rk` = k; the lease records the versions"),
    "bind": ("decided; fewer than `max_active` requests bound or running; lease current; the decision still valid at `rk` (with `prompts > 1` or `publish = \"release\"`, its hashes still published)", "bound at `rpos` = `rk`; pins (ref + 1) what a resume at `rk` reads"),
    "bind_stale": ("decided, and the decision no longer valid", "waiting (look up again)"),
    "use": ("bound; lease current (no version changed since lookup)", "running"),
    "use_stale": ("bound; lease stale", "waiting; pins released"),
    "append": ("running at `rpos` = j < `rlen`; block j's objects to rewrite are unreferenced and not in a graph; every pool has room for the new ones (capacity); with `publish = \"release\"`, block j is not this request's content cached unpublished (that is `append_copy`)", "block j's objects written (ready; compressed and indexer entries writing) with the current versions; holder refs; `rpos` = j + 1; block j's hash published (with `publish = \"release\"`: unpublished where rewritten, published at the release)"),
    "slide": ("running, and some group's window start moved (a later window step at `rpos`)", "`rwin` advanced to the window step of `rpos`; each group's SWA pages below its own window released"),
    "finish": ("running, `rpos` = `rlen`", "idle; every pin released (cached objects stay); with `publish = \"release\"` the hash of each position below `rpos` still holding its content published"),
    "preempt": ("decided, bound or running", "preempted; pins released; with `publish = \"release\"` its positions published as at finish"),
    "resume": ("preempted", "waiting (look up again)"),
    "compress": ("the compressed entry is writing", "ready"),
    "indexer_sync": ("the indexer entry is writing", "ready"),
    "evict": ("the object is live, unreferenced, not in a graph, and its block's copy is not being offloaded", "evicted (the hash stays: a tombstone; with `eviction = \"drop_hash\"` the hash is unpublished too)"),
    "drop_hash": ("`eviction = \"drop_hash\"` only; block j's hash is published", "block j's hash unpublished (`hashed` = 0); its objects stay until evicted, unreachable by a lookup"),
    "decode": ("`decode = true` only; running at `rpos` = `rlen` = j (past the prompt); block j's objects to rewrite are unreferenced", "one token appended (`rtok` + 1); when block j fills it is written as by append, its hash published, `rlen` = j + 1"),
    "append_evict": ("`alloc = \"evict\"` only; running at `rpos` = j < `rlen`; block j's new objects do not fit; block v (not j) has a live object and every live one is unreferenced, not in a graph, not being offloaded; with v's slots freed they fit", "block v's live objects evicted (with `eviction = \"drop_hash\"` its hash unpublished), then block j written as by append"),
    "append_fail": ("`alloc = \"evict\"` only; running at `rpos` = j < `rlen`; block j's new objects do not fit and no single block v could be evicted to make room; request x decided, bound or running", "request x preempted (pins released; with `publish = \"release\"` its positions published as at finish); the appending request retries later"),
    "append_copy": ("`duplicates = \"allow\"` only; running at `rpos` = j < `rlen`; every object of block j ready, current, of this request's content and without a second copy; room in the pools for the copy", "a second copy of each object (`dup` = 1, counted in the pool); pins move on as by append (`ref` counts the holders of both copies)"),
    "evict_copy": ("`duplicates = \"allow\"` only; the object has a second copy and fewer than 2 holders (so one copy is unreferenced), not in a graph, its block's copy not being offloaded", "`dup` = 0: the unreferenced copy back to the pool"),
    "append_evict_copy": ("`duplicates = \"allow\"` and `alloc = \"evict\"` only; running at `rpos` = j < `rlen`; block j's new objects do not fit; every object of block v (not j) has an unreferenced second copy (as evict_copy); with those slots freed they fit", "block v's second copies evicted (`dup` = 0), then block j written as by append"),
    "migrate": ("ready, unreferenced, not in a graph", "moved: `gmv` = 1, aligned"),
    "offload_start": ("tiers enabled; no copy (or a quarantined one); transfers below `max_inflight`; every object of block j ready and current", "copy offloading with the current versions in its header (and with `prompts > 1` the slot's content, `dcid`); `inflight` + 1"),
    "offload_ack": ("copy offloading", "durable; `inflight` - 1"),
    "prefetch_start": ("copy durable; some object of block j missing; transfers below `max_inflight`; room within capacity minus `reserve`", "loading; `inflight` + 1"),
    "prefetch_complete": ("copy loading", "loaded but unverified; `inflight` - 1"),
    "verify_ok": ("copy unverified, intact, header versions current; room in the pools; with `prompts > 1`, the copy holds the slot's content (`dcid` = `bcid`) or no object of the slot is live", "missing objects ready again (aligned or not); copy durable; hash published (with `prompts > 1`, as the copy's content: `bcid` = `bkey` = `dcid`)"),
    "checksum_fail": ("copy unverified and corrupt or of another version (or, with `prompts > 1`, of content its live slot no longer holds)", "quarantined (never served)"),
    "corrupt": ("copy offloading, durable or loading, and intact", "its bytes damaged (`dbad` = 1)"),
    "bump_model": ("below `max_version`", "`cur_ver` + 1; running requests preempted"),
    "bump_compressor": ("below `max_version`", "`cur_cmp` + 1; running requests preempted"),
    "bump_indexer": ("below `max_version`", "`cur_ix` + 1; running requests preempted"),
    "bump_abi": ("below `max_version`", "`cur_abi` + 1; running requests preempted"),
    "capture": ("no graph live; request running", "a graph over its pages (`graph`, `gwin`, `gpos`); `gmv` cleared"),
    "release_graph": ("a graph is live", "released"),
}

FULL_ATTENTION = Config(layers=(LayerSpec("full"),), blocks=3, requests=2, tiers=("device",),
                        capacity={"swa_window": 3})


def _field(spec: Spec, i: int) -> str:
    key = spec.lay.names[i]
    return {"o": "obj.", "b": "blk.", "r": "req."}.get(key[0], "") + str(key[-1])


def _reads_writes(spec: Spec, name: str) -> tuple[set[str], set[str]]:
    reads: set[str] = set()
    writes: set[str] = set()
    act = ACTIONS[name]
    for params in act.params(spec.lay):
        TRACE.frames.append([])
        try:
            guard, w = run_body(act, View(spec.sym, spec.lay), TRACE, spec.lay, spec.planted, params)
        finally:
            TRACE.frames.pop()
        if guard is False:
            continue
        if isinstance(guard, Expr):
            reads.update(_field(spec, i) for i in guard.reads)
        writes.update(_field(spec, i) for i, e in w.items() if not (isinstance(e, Expr) and e.src == f"s[{i}]"))
    return reads, writes


def _ranges(spec: Spec, name: str) -> str:
    cfg = spec.cfg
    ps = list(ACTIONS[name].params(spec.lay))
    if not ps:          # exists only with its semantic on (decode, drop_hash): see its guard
        return "none in the default config"
    if ps == [{}]:
        return "—"
    names = {"r": "0..requests-1", "j": "0..blocks-1"}
    out = []
    for p in ps[0]:
        vals = sorted({q[p] for q in ps}, key=str)
        if p == "n" and vals == list(range(1, cfg.blocks + 1)):
            out.append("`n` 1..blocks")
        elif p in names and vals == list(range(cfg.requests if p == "r" else cfg.blocks)):
            out.append(f"`{p}` {names[p]}")
        elif p == "g":
            out.append("`g` a group")
        elif p == "kind":
            out.append("`kind` " + " \\| ".join(vals))
        else:
            out.append(f"`{p}` " + " \\| ".join(map(str, vals)))
    if "kind" in ps[0]:
        out.append("(one per device object of the layout)")
    return ", ".join(out)


def _full_attention(steps: int = 3000) -> dict[str, str]:
    """Per action: enabled somewhere in a seeded walk of the full-attention config, never
    enabled, or absent (no instance in that config)."""
    spec = Spec(FULL_ATTENTION)
    rng = random.Random(0)
    seen: set[str] = set()
    s = spec.init()
    for n in range(steps):
        en = spec.enabled(s)
        seen.update(i.action for i in en)
        if not en or n % 200 == 199:
            s = spec.init()
            continue
        by: dict[str, list[Any]] = {}
        for i in en:
            by.setdefault(i.action, []).append(i)
        s = rng.choice(by[rng.choice(sorted(by))]).effect(s)
    out = {}
    for a in ACTIONS:
        out[a] = "yes" if a in seen else "never enabled" if a in spec.actions else "absent"
    return out


def rows() -> list[dict[str, str]]:
    spec = Spec(Config())
    full = _full_attention()
    out = []
    for name in ACTIONS:
        guard, effect = PROSE[name]
        reads, writes = _reads_writes(spec, name)
        out.append({"action": name, "params": _ranges(spec, name), "guard": guard, "effect": effect,
                    "reads": ", ".join(f"`{f}`" for f in sorted(reads)) or "—",
                    "writes": ", ".join(f"`{f}`" for f in sorted(writes)) or "—", "full": full[name]})
    return out


def render() -> str:
    lines = [BEGIN,
             "| action | parameters (ranges) | guard | effect | guard reads | effect writes | full attention |",
             "|---|---|---|---|---|---|---|"]
    for r in rows():
        lines.append(f"| `{r['action']}` | {r['params']} | {r['guard']} | {r['effect']} | {r['reads']} | "
                     f"{r['writes']} | {r['full']} |")
    lines.append(END)
    return "\n".join(lines)


def splice(doc: str, table: str) -> str:
    """`doc` with the text between the markers replaced by `table` (markers included)."""
    a, b = doc.index(BEGIN), doc.index(END) + len(END)
    return doc[:a] + table + doc[b:]
