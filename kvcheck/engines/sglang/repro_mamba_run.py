"""The second half of the UnifiedRadixCache FULL+MAMBA reproducer script (after
repro_mamba.py's World): the conditions checked after every step and the trace's steps
played on each tree core, compared across the cores in a lockstep."""

BODY = r'''
# ---- the conditions, after every step (a method of World) --------------------------------------
def check(self):
    run = [q for q in self.reqs.values() if q["state"] == "running"]
    free, mfree = self.free_kv(), self.free_m()
    for q in run:
        for p in range(q["hit"]):
            s = q["slots"][p]
            if s in free or self.written.get(s) != tuple(q["tokens"][:p + 1]):
                self.bugs.append(f"a running request's prefix slot {s} (position {p}) was freed under its lock")
    c = self.cache
    if self.core == "rust":
        tree_kv = [int(x) for x in c.all_values_flatten().tolist()]
        tree_m = [int(x) for x in c.all_mamba_values_flatten().reshape(-1).tolist()]
        if c.full_evictable_size() + c.full_protected_size() != len(tree_kv) or \
                c.mamba_evictable_size() + c.mamba_protected_size() != len(tree_m):
            self.bugs.append("evictable + protected sizes differ from the tree's values")
    else:
        full, mamba, tree_kv, tree_m, prot, mprot = {}, {}, [], [], 0, 0
        for q in run:
            if q["mnode"] is not None: mamba[id(q["mnode"])] = mamba.get(id(q["mnode"]), 0) + 1
            n = self.node(q["h"])
            while n is not c.root_node:
                if n.parent is None or not any(ch is n for ch in n.parent.children.values()):
                    self.bugs.append("a running request's locked node left the tree"); return
                full[id(n)] = full.get(id(n), 0) + 1; n = n.parent
        for n, path, k in self.tree():
            got = (n.component_data[CT.FULL].lock_ref, n.component_data[CT.MAMBA].lock_ref)
            if got != (full.get(id(n), 0), mamba.get(id(n), 0)):
                self.bugs.append(f"node at depth {len(path)}: (full, mamba) lock_ref {got}, running requests "
                                 f"holding it {(full.get(id(n), 0), mamba.get(id(n), 0))}")
            v, sv = self.val(n, CT.FULL), self.val(n, CT.MAMBA)
            for i, s in enumerate(v or []):
                if s in free or self.written.get(s) != (path + k)[:len(path) + i + 1]:
                    self.bugs.append(f"tree position {len(path) + i} is in slot {s}, which is free or holds other tokens")
            tree_kv += v or []; prot += len(v or []) if got[0] > 0 else 0
            if sv is not None:
                tree_m += sv; mprot += got[1] > 0
                if sv[0] in mfree or not self.holds(sv[0], path + k):
                    self.bugs.append(f"node at depth {len(path)}: state slot {sv[0]} is free or not the state after its prefix")
        if (c.full_evictable_size(), c.full_protected_size(), c.mamba_evictable_size(), c.mamba_protected_size()) != \
                (len(tree_kv) - prot, prot, len(tree_m) - mprot, mprot):
            self.bugs.append("evictable / protected sizes (full, mamba) differ from the tree's")
    for name, owned, pfree, every in (
            ("KV", tree_kv + [s for q in run for s in q["slots"][q["hit"]:]], free, set(range(1, CAPACITY + 1))),
            ("Mamba state", tree_m + [q["ms"] for q in run], mfree, self.m_all)):
        seen = owned + sorted(pfree)
        if len(seen) != len(set(seen)) or set(seen) != every:
            self.bugs.append(f"{name} slots: {len(owned)} owned + {len(pfree)} free of {len(every)}: "
                             f"{len(seen) - len(set(seen))} counted twice, {len(every - set(seen))} leaked")
    if not run:
        try:
            c.sanity_check()
        except Exception as e:
            self.bugs.append("SGLang's own sanity_check: " + " | ".join(str(e).splitlines())[:300])


World.check = check


def fault_for(core):          # as kvcheck's lockstep plants it: wrappers of the cache's calls on both cores,
    if len(CORES) == 1 or FAULT in BOTH:      # node edits on the Python core, core_drops_insert on the Rust one
        return FAULT
    return FAULT if (FAULT == "core_drops_insert") == (core == "rust") else None


worlds = [World(core, fault_for(core)) for core in CORES]
print(f"SGLang {importlib.metadata.version('sglang')} (finding recorded on {RECORDED_RELEASE}); UnifiedRadixCache "
      f"FULL+MAMBA on the {' + '.join(CORES)} tree core(s), {CAPACITY} slots; fault {FAULT}")
PLAYS = ("submit", "match", "chunk", "decode", "finish", "abort", "evict")
if {a for a, _ in STEPS} - set(PLAYS):        # a step skipped could make a present bug look fixed
    print(f"CANNOT PLAY: steps {sorted({a for a, _ in STEPS} - set(PLAYS))}; replay the trace with kvcheck")
    sys.exit(2)
for n, (action, p) in enumerate(STEPS):
    print(f"step {n}: {action} {p}")
    r, outs = p.get("r"), []
    for w in worlds:
        if action in ("submit", "match") and "tokens" in p:
            w.reqs[r] = {"tokens": list(p["tokens"]), "state": "waiting"}
        q = w.reqs.get(r, {})
        s = q.get("sched")                   # a request admitted by a chunk: the scheduler path
        mid = s is not None and s["computed"] < s["prompt"]
        if action == "match" and q.get("state") == "waiting":
            outs.append(w.match(r))
        elif action == "chunk" and (q.get("state") == "waiting" or mid):
            outs.append(w.chunk(r, p["n"]))
        elif action == "decode" and q.get("state") == "running" and not mid:
            outs.append([(w.sched_decode if s else w.decode)(r, t) for t in p.get("toks", [p.get("tok")])])
        elif action == "finish" and q.get("state") == "running" and not mid:
            outs.append(w.release_sched(r, True) if s else w.finish(r))
        elif action == "abort" and r in w.reqs and (not mid or can_abort_mid_prefill(w.cache)):
            outs.append(w.release_sched(r, False) if s else w.abort(r))
        elif action == "evict":
            outs.append(w.evict(p["n"], p.get("mamba", 0)))
        if not w.bugs:
            w.check()
    bugs = [f"[{w.core} core] {b}" for w in worlds for b in w.bugs]
    if not bugs and len(worlds) == 2:
        a, b = worlds
        for what, x, y in (("result", outs[0] if outs else None, outs[1] if len(outs) > 1 else None),
                           ("sizes", [getattr(a.cache, s)() for s in ("full_evictable_size", "full_protected_size",
                                                                       "mamba_evictable_size", "mamba_protected_size")],
                            [getattr(b.cache, s)() for s in ("full_evictable_size", "full_protected_size",
                                                             "mamba_evictable_size", "mamba_protected_size")]),
                           ("free slots", (len(a.free_kv()), len(a.free_m())), (len(b.free_kv()), len(b.free_m())))):
            if x != y:
                bugs.append(f"the tree cores differ in {what}: python {x}, rust {y}")
    if bugs:
        print("BUG: " + "; ".join(dict.fromkeys(bugs)))
        sys.exit(1)
print("OK: every condition holds on every step (fixed, or not this release)")
sys.exit(0)
'''
