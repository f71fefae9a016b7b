"""A toy prefix-cache allocator for one full-attention layer, plugged into kvcheck.

It is written the way an engine team would write their own cache manager (a page table, a
hash table, reference counts), not by copying the spec; kvcheck drives it in lockstep with the
spec and compares decisions and abstract state. `ToyAllocator(fault="hash_only_hit")` is the
classic bug: a hash hit is reused without checking that every page is still there.

    kvcheck fuzz --sut examples.toy_allocator:ToyAllocator --config examples/toy.json --budget 20s
"""
from kvcheck.spec.objects import R_BOUND, R_DECIDED, R_IDLE, R_PREEMPTED, R_RUNNING, R_WAITING, READY, EVICTED
from kvcheck.spec.state import Layout
from kvcheck.spec.sut import ActionRejected


class ToyAllocator:
    name = "toy"
    actions = frozenset({"submit", "lookup", "bind", "bind_stale", "use", "append", "finish",
                         "preempt", "resume", "evict"})
    faults = {"hash_only_hit": "decision_matches_spec"}   # planted bug -> the check that must catch it

    def reset(self, cfg):
        self.cfg, self.lay = cfg, Layout(cfg)
        self.pages = {}                       # block -> {"ref": n}   (present pages)
        self.evicted, self.hashed = set(), set()
        self.req = {r: {"st": R_IDLE, "len": 0, "k": 0, "pos": 0} for r in range(cfg.requests)}

    def __init__(self, fault=None):
        self.fault = fault

    def _decide(self, r):
        n = self.req[r]["len"]
        logical = next((k for k in range(n, 0, -1) if all(j in self.hashed for j in range(k))), 0)
        k = logical if self.fault == "hash_only_hit" else \
            next((k for k in range(logical, 0, -1) if all(j in self.pages for j in range(k))), 0)
        kind = "REUSE" if k == logical > 0 else "PARTIAL" if k else "RECOMPUTE"
        return {"kind": kind, "k": k, "logical": logical, "reasons": ["window_incomplete"] if k < logical else []}

    def _pin(self, r, delta):
        for j in range(self.req[r]["pos"]):
            self.pages[j]["ref"] += delta

    def apply(self, action, p):
        q = self.req.get(p.get("r"))
        active = sum(x["st"] in (R_BOUND, R_RUNNING) for x in self.req.values())
        if action == "submit" and q["st"] == R_IDLE:
            q.update(st=R_WAITING, len=p["n"], k=0, pos=0)
        elif action == "lookup" and q["st"] == R_WAITING:
            d = self._decide(p["r"])
            q.update(st=R_DECIDED, k=d["k"])
            return {"decision": d}
        elif action in ("bind", "bind_stale") and q["st"] == R_DECIDED:
            valid = all(j in self.pages for j in range(q["k"]))
            if action == "bind_stale" and not valid:
                q["st"] = R_WAITING
            elif action == "bind" and valid and active < self.cfg.max_active:
                q.update(st=R_BOUND, pos=q["k"])
                self._pin(p["r"], +1)
            else:
                raise ActionRejected(action)
        elif action == "use" and q["st"] == R_BOUND:
            q["st"] = R_RUNNING
        elif action == "append" and q["st"] == R_RUNNING and q["pos"] == p["j"] < q["len"]:
            j = p["j"]
            if j not in self.pages:
                if len(self.pages) >= self.cfg.cap("swa_window"):
                    raise ActionRejected("pool full")
                self.pages[j] = {"ref": 0}
                self.evicted.discard(j)
            self.pages[j]["ref"] += 1
            self.hashed.add(j)
            q["pos"] += 1
        elif action == "finish" and q["st"] == R_RUNNING and q["pos"] == q["len"]:
            self._pin(p["r"], -1)
            q["st"] = R_IDLE
        elif action == "preempt" and q["st"] in (R_DECIDED, R_BOUND, R_RUNNING):
            if q["st"] != R_DECIDED:
                self._pin(p["r"], -1)
            q["st"] = R_PREEMPTED
        elif action == "resume" and q["st"] == R_PREEMPTED:
            q["st"] = R_WAITING
        elif action == "evict" and p["j"] in self.pages and self.pages[p["j"]]["ref"] == 0:
            del self.pages[p["j"]]
            self.evicted.add(p["j"])
        else:
            raise ActionRejected(f"{action} {p}")
        return {}

    def observe(self):
        """The abstraction function, onto the slots this allocator has: page state and ref
        count, published hashes, request state and positions."""
        lay, out = self.lay, {}
        for j in range(self.cfg.blocks):
            st = READY if j in self.pages else EVICTED if j in self.evicted else 0
            out[lay.o(0, "swa_window", j, "st")] = st
            out[lay.o(0, "swa_window", j, "ref")] = self.pages.get(j, {"ref": 0})["ref"]
            out[lay.b(j, "hashed")] = int(j in self.hashed)
        for r, q in self.req.items():
            out[lay.r(r, "rst")] = q["st"]
            if q["st"] in (R_BOUND, R_RUNNING):
                out[lay.r(r, "rpos")] = q["pos"]
        return out
